"""From a request's Prompt to the model's input text, through the pair's template.

The template is chosen in one place, `template_source`, by Ollama's precedence: a request's
`template` > the pair's `template` > the Ollama TEMPLATE layer > the GGUF's own
`tokenizer.chat_template` (jinja) > a bare fallback. What a pair can do (`capabilities`) and how
its output is parsed (`output_parser`) follow from that same choice, so /api/show, the capability
checks and the parser can never disagree with what was rendered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sidecar.config.entries import PairEntry
from sidecar.engine.llama import Weights
from sidecar.errors import ClientError
from sidecar.runtime.contract import Prompt
from sidecar.templates.chat import (
    FALLBACK_TEMPLATE,
    ChatTemplate,
    GoChatTemplate,
    JinjaChatTemplate,
    TemplateError,
)
from sidecar.templates.tools import ToolCallParser, supports_tools


class PromptError(ClientError):
    """The pair's template cannot render this prompt."""


class Unsupported(ClientError):
    """The pair lacks a capability the request needs."""


@dataclass(frozen=True)
class TemplateSource:
    text: str
    go: bool  # an Ollama Go template; else the GGUF's jinja template


def template_source(entry: PairEntry, override: str | None = None) -> TemplateSource:
    for go in (override, entry.config.template, entry.target.template):
        if go:
            return TemplateSource(go, True)
    gguf = entry.metadata.get("tokenizer.chat_template")
    if isinstance(gguf, str) and gguf:
        return TemplateSource(gguf, False)
    return TemplateSource(FALLBACK_TEMPLATE, True)


def capabilities(entry: PairEntry) -> list[str]:
    """Ollama's capability names for this pair (server/images.go Capabilities)."""
    return ["completion", "tools"] if supports_tools(template_source(entry).text) else ["completion"]


def check(entry: PairEntry, prompt: Prompt) -> None:
    """Refuse, before any work, a prompt that needs what the pair cannot do."""
    if prompt.tools and "tools" not in capabilities(entry):
        raise Unsupported(f"{entry.name} does not support tools")


def messages(entry: PairEntry, prompt: Prompt) -> list[dict[str, Any]]:
    """The messages the template sees: the pair's SYSTEM and MESSAGE history around the request's.

    Chat: the pair's history, then the request's messages, with the pair's system prompt first
    unless the request starts with its own. Completion: the system prompt (the request's, else the
    pair's), the history (not when continuing an earlier `context`), then the prompt as a user turn."""
    if prompt.chat:
        full = entry.history + list(prompt.messages)
        if entry.system and prompt.messages and prompt.messages[0]["role"] != "system":
            full = [{"role": "system", "content": entry.system}, *full]
        return full
    out: list[dict[str, Any]] = []
    system = prompt.system if prompt.system is not None else entry.system
    if system:
        out.append({"role": "system", "content": system})
    if prompt.context is None:
        out += entry.history
    out.append({"role": "user", "content": prompt.text})
    return out


def chat_template(source: TemplateSource, weights: Weights) -> ChatTemplate:
    if source.go:
        return GoChatTemplate(source.text)
    vi = weights.vocab_info()
    return JinjaChatTemplate(
        source.text,
        bos_token=weights.token_text(vi.bos).decode("utf-8", "replace") if vi.bos >= 0 else "",
        eos_token=weights.token_text(vi.eos).decode("utf-8", "replace") if vi.eos >= 0 else "",
    )


def render(entry: PairEntry, prompt: Prompt, weights: Weights) -> tuple[str, list[int] | None]:
    """The prompt text (to tokenize with special tokens parsed) and token ids to put before it."""
    if prompt.raw:
        return prompt.text, None
    try:
        template = chat_template(template_source(entry, prompt.template), weights)
        text = template.render(messages(entry, prompt), list(prompt.tools) if prompt.tools else None)
    except TemplateError as e:
        raise PromptError(f"template error: {e}") from None
    return text, list(prompt.context) if prompt.context is not None else None


def output_parser(entry: PairEntry, prompt: Prompt) -> ToolCallParser | None:
    """Like Ollama, tool calls are looked for only when the request offers tools."""
    return ToolCallParser(template_source(entry).text, list(prompt.tools)) if prompt.tools else None
