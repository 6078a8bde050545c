"""From a request's Prompt to the model's input, through the pair's template.

The template is chosen in one place, `template_source`, by Ollama's precedence: a request's
`template` > the pair's `template` > the Ollama TEMPLATE layer > the GGUF's own
`tokenizer.chat_template` (jinja) > a bare fallback. A manifest that names a built-in `renderer`
gets the GGUF's template instead of the TEMPLATE layer: Ollama renders such models with Go code
that is not ported here, and the GGUF's template is the closest honest stand-in (`notes` says so).
What a pair can do (`capabilities`, server/images.go) follows from the same choice, so /api/show,
the capability checks and the parser can never disagree with what was rendered.

`prepare` renders and tokenizes, dropping the oldest messages when the prompt does not fit the
context window (server/prompt.go chatPrompt): system messages and the last message always stay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar.config.entries import PairEntry
from sidecar.engine.llama import Weights
from sidecar.errors import ClientError
from sidecar.models.resolve import ModelNotFound, parse_ollama_name
from sidecar.runtime.contract import Prompt
from sidecar.templates.chat import (
    FALLBACK_TEMPLATE,
    ChatTemplate,
    GoChatTemplate,
    JinjaChatTemplate,
    TemplateError,
)
from sidecar.templates.gotemplate import GoTemplate
from sidecar.templates.ollama import template_vars
from sidecar.templates.parsers import IMPLEMENTED_PARSER_NAMES, KNOWN_PARSER_NAMES, ThinkingParser, parser_for_name
from sidecar.templates.tags import infer_think_tags
from sidecar.templates.tools import supports_tools


class PromptError(ClientError):
    """The pair's template cannot render this prompt."""


class Unsupported(ClientError):
    """The pair lacks a capability the request needs."""


@dataclass(frozen=True)
class TemplateSource:
    text: str
    go: bool  # an Ollama Go template; else the GGUF's jinja template


@functools.lru_cache(maxsize=64)
def _go(source: str) -> GoTemplate | None:
    try:
        return GoTemplate(source)
    except TemplateError:
        return None


def _gguf_template(entry: PairEntry) -> str | None:
    gguf = entry.metadata.get("tokenizer.chat_template")
    return gguf if isinstance(gguf, str) and gguf else None


def renderer(entry: PairEntry) -> str | None:
    """The built-in renderer the Ollama manifest names (none is ported, see the module docstring)."""
    name = entry.target.config.get("renderer")
    return name if isinstance(name, str) and name else None


def template_source(entry: PairEntry, override: str | None = None) -> TemplateSource:
    for go in (override, entry.config.template):
        if go:
            return TemplateSource(go, True)
    gguf = _gguf_template(entry)
    if entry.target.template and not (renderer(entry) and gguf):
        return TemplateSource(entry.target.template, True)
    if gguf:
        return TemplateSource(gguf, False)
    return TemplateSource(FALLBACK_TEMPLATE, True)


def family(entry: PairEntry) -> str:
    return str(entry.target.config.get("model_family") or entry.metadata.get("general.architecture") or "")


def parser_name(entry: PairEntry) -> str | None:
    """The built-in output parser: the manifest's `parser`, else harmony for gpt-oss (routes.go shouldUseHarmony)."""
    name = entry.target.config.get("parser")
    if isinstance(name, str) and name:
        return name
    source = template_source(entry).text
    if family(entry) in ("gptoss", "gpt-oss") and "<|start|>" in source and "<|end|>" in source:
        return "harmony"
    return None


def notes(entry: PairEntry) -> list[str]:
    """What the pair's Ollama manifest asks for that is served differently here (check, logs, status)."""
    out = []
    if (name := renderer(entry)) is not None:
        how = "the GGUF's chat template" if _gguf_template(entry) else "the TEMPLATE layer"
        out.append(f"built-in renderer {name!r} is not implemented; rendering with {how}")
    name = parser_name(entry)
    if name is not None and name not in IMPLEMENTED_PARSER_NAMES:
        known = "built-in parser" if name in KNOWN_PARSER_NAMES else "unknown parser"
        out.append(f"{known} {name!r} is not implemented; output is parsed with the template's tags")
    return out


def thinking_tags(entry: PairEntry) -> tuple[str, str] | None:
    """The tags around thinking in this pair's output, when its template has them."""
    source = template_source(entry)
    if source.go:
        t = _go(source.text)
        tags = infer_think_tags(t) if t is not None else ("", "")
        return tags if tags[0] and tags[1] else None
    return ("<think>", "</think>") if _jinja_thinks(source.text) else None


def _jinja_thinks(source: str) -> bool:
    """server/images.go chatTemplateHasThinkingSupport."""
    if "<think>" in source and "</think>" in source:
        return True
    return (("content.split('</think>')" in source or 'content.split("</think>")' in source)
            and "reasoning_content" not in source and "<SPECIAL_12>" not in source)


def capabilities(entry: PairEntry) -> list[str]:
    """Ollama's capability names for this pair (server/images.go capabilitiesForTemplate)."""
    caps: list[str] = []

    def add(name: str) -> None:
        if name not in caps:
            caps.append(name)

    for c in entry.target.config.get("capabilities") or []:
        add(str(c))
    add("completion")
    source = template_source(entry)
    if supports_tools(source.text):
        add("tools")
    if source.go and (t := _go(source.text)) is not None and "suffix" in template_vars(t):
        add("insert")
    if thinking_tags(entry) is not None:
        add("thinking")
    parser = parser_for_name(parser_name(entry) or "")
    if parser is not None:
        if parser.has_tool_support():
            add("tools")
        if parser.has_thinking_support():
            add("thinking")
    if family(entry) in ("gptoss", "gpt-oss"):
        add("thinking")
    return caps


def full_name(entry: PairEntry) -> str:
    """The name as Ollama spells it in capability errors: registry.ollama.ai/library/x:tag."""
    host, ns, model, tag = parse_ollama_name(entry.name)
    return f"{host}/{ns}/{model}:{tag}"


def admit(entry: PairEntry, prompt: Prompt) -> Prompt:
    """Refuse what the pair cannot do, and settle `think` as Ollama does (routes.go): a model that
    can think thinks unless told not to; asking one that cannot is the client's error."""
    caps = capabilities(entry)
    if prompt.tools and "tools" not in caps:
        raise Unsupported(f"{entry.name} does not support tools")
    if prompt.suffix and "insert" not in caps:
        raise Unsupported(f"{full_name(entry)} does not support insert")
    think = prompt.think
    if "thinking" in caps:
        think = True if think is None else think
    elif prompt.thinks:
        raise Unsupported(f'"{entry.name}" does not support thinking')
    if think != prompt.think:
        return Prompt(**{**vars(prompt), "think": think})
    return prompt


def messages(entry: PairEntry, prompt: Prompt) -> list[dict[str, Any]]:
    """The messages the template sees: the pair's SYSTEM and MESSAGE history around the request's.

    Chat: the pair's history, then the request's messages, with the pair's system prompt first
    unless the request starts with its own; earlier assistant turns lose their <think> blocks for
    qwen3 and deepseek-r1, as Ollama strips them (routes.go filterThinkTags). Completion: the system
    prompt (the request's, else the pair's), the history (not when continuing an earlier `context`),
    then the prompt as a user turn."""
    if prompt.chat:
        full = entry.history + list(prompt.messages)
        if entry.system and prompt.messages and prompt.messages[0]["role"] != "system":
            full = [{"role": "system", "content": entry.system}, *full]
        return _filter_think_tags(entry, full)
    out: list[dict[str, Any]] = []
    system = prompt.system if prompt.system is not None else entry.system
    if system:
        out.append({"role": "system", "content": system})
    if prompt.context is None:
        out += entry.history
    out.append({"role": "user", "content": prompt.text})
    return out


def _model_name(ref: str) -> str:
    """The model part of an Ollama name (`deepseek-r1` in `deepseek-r1:70b`); "" for paths and others."""
    try:
        return parse_ollama_name(ref)[2]
    except ModelNotFound:
        return ""


def _filter_think_tags(entry: PairEntry, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if family(entry) != "qwen3" and _model_name(entry.target.ref) != "deepseek-r1":
        return msgs
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
    out = []
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and i < last_user:
            _, content = ThinkingParser("<think>", "</think>").add(m["content"])
            m = {**m, "content": content}
        out.append(m)
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


@dataclass(frozen=True)
class Rendered:
    text: str  # the template's output (what _debug_render_only shows)
    tokens: list[int]  # what the model runs on: `context` ids, then the text's tokens


def prepare(entry: PairEntry, prompt: Prompt, weights: Weights, n_ctx: int, truncate: bool,
            tools: list[dict[str, Any]] | None = None) -> Rendered:
    """Render and tokenize; with `truncate`, drop the oldest messages until the prompt fits.

    `tools` are the tools as the output parser wants them rendered (harmony renames them).
    Blocking (templates, tokenizer): run it off the event loop."""
    if prompt.raw:
        return _tokenized(prompt.text, None, weights)
    before = list(prompt.context) if prompt.context is not None else None
    try:
        template = chat_template(template_source(entry, prompt.template), weights)
        if prompt.suffix:
            assert isinstance(template, GoChatTemplate)  # admit() required the insert capability
            return _tokenized(template.render_fim(prompt.text, prompt.suffix, prompt.think), before, weights)

        def render(msgs: list[dict[str, Any]]) -> str:
            return template.render(msgs, tools, prompt.think)

        msgs = messages(entry, prompt)
        if not truncate or prompt.template:
            return _tokenized(render(msgs), before, weights)
        return _fit(msgs, render, lambda text: _tokenized(text, before, weights), n_ctx)
    except TemplateError as e:
        raise PromptError(f"template error: {e}") from None


def _tokenized(text: str, before: list[int] | None, weights: Weights) -> Rendered:
    # Add BOS when the vocabulary wants it, unless the template already wrote it (or ids come first).
    add_special = not before and not weights.starts_with_bos(text)
    return Rendered(text, list(before or []) + weights.tokenize(text, add_special=add_special, parse_special=True))


def _fit(msgs: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str],
         tokenize: Callable[[str], Rendered], n_ctx: int) -> Rendered:
    """Ollama's chatPrompt: the first start i whose prompt fits in n_ctx tokens, keeping the system
    messages before it and always the last message.

    Ollama tries i = 0, 1, 2 ... in turn; dropping messages from the front only shortens a prompt,
    so a bisection finds the same i with log(n) renders (a 5,000-message chat stays cheap)."""

    seen: dict[int, Rendered] = {}

    def at(i: int) -> Rendered:
        if i not in seen:
            kept = [m for m in msgs[:i] if m["role"] == "system"] + msgs[i:]
            seen[i] = tokenize(render(kept))
        return seen[i]

    if len(msgs) <= 1 or len(at(0).tokens) <= n_ctx:
        return at(0)
    lo, hi = 1, len(msgs) - 1  # the answer is in [lo, hi]; hi (the last message alone) is taken anyway
    while lo < hi:
        mid = (lo + hi) // 2
        if len(at(mid).tokens) <= n_ctx:
            hi = mid
        else:
            lo = mid + 1
    return at(lo)
