// A stream through the official Node SDK (@anthropic-ai/sdk) against the daemon at SIDECAR_URL:
// prints the streamed text, the event types and the final message as one JSON line for
// tests/test_anthropic_node.py to check.
import Anthropic from "@anthropic-ai/sdk";

const client = new Anthropic({ baseURL: process.env.SIDECAR_URL, apiKey: "unused", maxRetries: 0 });
const stream = client.messages.stream({
  model: process.env.SIDECAR_MODEL,
  max_tokens: Number(process.env.SIDECAR_MAX_TOKENS),
  messages: JSON.parse(process.env.SIDECAR_MESSAGES),
});
let text = "";
const types = [];
for await (const event of stream) {
  types.push(event.type);
  if (event.type === "content_block_delta" && event.delta.type === "text_delta") text += event.delta.text;
}
const message = await stream.finalMessage();
console.log(JSON.stringify({ text, types, message }));
