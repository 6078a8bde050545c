// One /v1/responses stream through the official `openai` npm package, as a Node agent reads it.
// Usage: node responses_stream.mjs <base_url> <model> <input>
// Prints one JSON line: the event types in order, the text the deltas make, and the final response.
import OpenAI from "openai";

const [baseURL, model, input] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 120_000 });
const stream = await client.responses.create({
  model, input, stream: true, temperature: 0, max_output_tokens: 24,
});
const types = [];
let text = "";
let final = null;
for await (const event of stream) {
  types.push(event.type);
  if (event.type === "response.output_text.delta") text += event.delta;
  if (event.type === "response.completed" || event.type === "response.incomplete") final = event.response;
}
console.log(JSON.stringify({ types, text, status: final?.status, output_text: final?.output?.[0]?.content?.[0]?.text,
                             usage: final?.usage }));
