"""A pair's format, resolved once when its declaration is applied: template, parser, thinking, capabilities.

The template is chosen in one place, `template_source`, by Ollama's precedence: a request's
`template` (runtime.render) > the pair's `template` > the Ollama TEMPLATE layer > the GGUF's own
`tokenizer.chat_template` (jinja) > a bare fallback. A manifest that names a built-in `renderer`
gets the GGUF's template instead of the TEMPLATE layer: Ollama renders such models with Go code
that is not ported here, and the GGUF's template is the closest honest stand-in (`notes` says so).

A pair whose model is not from Ollama's store (a path, `pkg:`, LM Studio, a Hugging Face folder)
shows in /api/show the Go template `ollama create` would detect for its jinja (templates.named;
`detected_template`), as Ollama shows a model created from that file. It still renders with the
jinja itself, which is the model's own and may carry more (SmolLM2's default system prompt): a
pair's prompts, and so its outputs, do not change with the display. A model from Ollama's store
already carries whatever its creation detected, so it is never matched again.

The output parser, the thinking tags and what the pair can do (`capabilities`, server/images.go)
all follow from that one choice, so /api/show, the capability checks, the rendering and the
parsing can never disagree; `PairFormat` holds them so no request recomputes them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from sidecar.config.entries import PairEntry
from sidecar.models.resolve import ModelNotFound, parse_ollama_name
from sidecar.templates.chat import FALLBACK_TEMPLATE, TemplateError
from sidecar.templates.gotemplate import GoTemplate
from sidecar.templates.named import NamedTemplate, named
from sidecar.templates.ollama import template_vars
from sidecar.templates.parsers import (
    IMPLEMENTED_PARSER_NAMES,
    KNOWN_PARSER_NAMES,
    Parser,
    PassthroughParser,
    TemplateParser,
    parser_for_name,
)
from sidecar.templates.tags import infer_think_tags
from sidecar.templates.tools import supports_tools

GPT_OSS = ("gptoss", "gpt-oss")


@dataclass(frozen=True)
class TemplateSource:
    text: str
    go: bool  # an Ollama Go template; else the GGUF's jinja template


@functools.lru_cache(maxsize=64)
def go_template(source: str) -> GoTemplate | None:
    try:
        return GoTemplate(source)
    except TemplateError:
        return None


def _gguf_template(entry: PairEntry) -> str | None:
    gguf = entry.metadata.get("tokenizer.chat_template")
    return gguf if isinstance(gguf, str) and gguf else None


def _renderer(entry: PairEntry) -> str | None:
    """The built-in renderer the Ollama manifest names (none is ported, see the module docstring)."""
    name = entry.target.config.get("renderer")
    return name if isinstance(name, str) and name else None


def template_source(entry: PairEntry) -> TemplateSource:
    if entry.config.template:
        return TemplateSource(entry.config.template, True)
    gguf = _gguf_template(entry)
    if entry.target.template and not (_renderer(entry) and gguf):
        return TemplateSource(entry.target.template, True)
    if gguf:
        return TemplateSource(gguf, False)
    return TemplateSource(FALLBACK_TEMPLATE, True)


def detected_template(entry: PairEntry) -> NamedTemplate | None:
    """The built-in Go template `ollama create` would store as this pair's TEMPLATE layer, if used.

    server/model.go detectChatTemplate runs template.Named on the GGUF's jinja when a model is
    created from a file; a pair with its own `template`, or whose model comes from Ollama's store
    (which already holds what its creation detected), gets nothing. Ollama 0.30+ then still renders
    the jinja when it can do more than the match (server/images.go GetModel, shouldPreferChatTemplate):
    a match that would cost the pair its tools or thinking is not used.
    """
    gguf = _gguf_template(entry)
    if gguf is None or entry.config.template or entry.target.template or entry.target.digest is not None:
        return None
    found = named(gguf)
    return None if found is None or _prefers_chat_template(gguf, found.text) else found


def shown_template(entry: PairEntry) -> str:
    """/api/show's `template`: the pair's Go template, the TEMPLATE layer, else the detected one.

    Ollama shows the model's TEMPLATE layer (server/routes.go GetModelInfo), and for a model
    created from a GGUF that layer is the detected template, so a pair on a file shows that. A
    jinja that can do more than its match shows "" as before (Ollama 0.30+ selectedModelTemplate
    would show the jinja text itself there).
    """
    if shown := entry.config.template or entry.target.template:
        return shown
    detected = detected_template(entry)
    return detected.text if detected is not None else ""


def _jinja_capabilities(source: str) -> list[str]:
    """server/images.go chatTemplateCapabilities (what Ollama weighs the jinja by, not `_capabilities`)."""
    caps = []
    if "tools" in source or "tool_call" in source:  # chatTemplateHasToolSupport
        caps.append("tools")
    if _jinja_thinks(source):
        caps.append("thinking")
    return caps


def _jinja_tool_round_trip(source: str) -> bool:
    """server/images.go chatTemplateHasToolRoundTrip."""
    if "tools" not in source and "tool_call" not in source:
        return False
    calls = "tool_calls" in source or "assistant_tool_call" in source
    results = ("tool_response", "tool_results", "role'] == 'tool'", "role'] == \"tool\"", "role\"] == 'tool'",
               "role\"] == \"tool\"", "message.role == 'tool'", "message.role == \"tool\"", "ipython")
    return calls and any(r in source for r in results)


def _go_capabilities(source: str) -> list[str]:
    """server/images.go goTemplateCapabilities."""
    t = go_template(source)
    if t is None:
        return []
    names = template_vars(t)
    caps = [c for c, var in (("tools", "tools"), ("insert", "suffix")) if var in names]
    opening, closing = infer_think_tags(t)
    if opening and closing:
        caps.append("thinking")
    return caps


def _go_tool_round_trip(source: str) -> bool:
    """server/images.go goTemplateHasToolRoundTrip."""
    t = go_template(source)
    if t is None or not {"tools", "toolcalls"} <= template_vars(t):
        return False
    return 'eq .Role "tool"' in source or "tool_response" in source or "TOOL_RESULTS" in source


def _prefers_chat_template(jinja: str, go: str) -> bool:
    """server/images.go shouldPreferChatTemplate: whether Ollama renders the jinja over the Go template."""
    jinja_caps, go_caps = _jinja_capabilities(jinja), _go_capabilities(go)
    if len(jinja_caps) > len(go_caps):  # hasMoreCapabilities
        return not _go_tool_round_trip(go) or _jinja_tool_round_trip(jinja)
    if set(jinja_caps) != set(go_caps) or len(jinja_caps) != len(go_caps) or "tools" not in jinja_caps:
        return False
    return _jinja_tool_round_trip(jinja) and not _go_tool_round_trip(go)


def _family(entry: PairEntry) -> str:
    return str(entry.target.config.get("model_family") or entry.metadata.get("general.architecture") or "")


@dataclass(frozen=True)
class PairFormat:
    """How one pair's prompts are written and its output is read."""

    template: TemplateSource  # the pair's own (a request's `template` overrides it for rendering only)
    parser: str | None  # the built-in output parser Ollama would use (ported or not); None: the generic one
    thinking_tags: tuple[str, str] | None  # the tags around thinking in the output, when the template has them
    capabilities: tuple[str, ...]  # Ollama's names, in Ollama's order
    notes: tuple[str, ...]  # what the manifest asks for that is served differently here (check, logs, status)
    filters_thinking: bool  # earlier assistant turns lose their <think> blocks (qwen3, deepseek-r1)
    shown_template: str = ""  # /api/show's `template` (see `shown_template`)

    def new_parser(self, raw: bool) -> Parser:
        """A fresh output parser for one request. Every parser has the same lifecycle (init with the
        tools, `begin` with the rendered prompt, then `add`); a raw prompt's output is all content."""
        if raw:
            return PassthroughParser()
        builtin = parser_for_name(self.parser) if self.parser else None
        return builtin if builtin is not None else TemplateParser(self.thinking_tags, self.template.text)


def resolve(entry: PairEntry) -> PairFormat:
    """The pair's format (parses its template: milliseconds, once per declaration)."""
    source = template_source(entry)
    family = _family(entry)
    parser = _parser_name(entry, source, family)
    tags = _thinking_tags(source)
    return PairFormat(source, parser, tags, _capabilities(entry, source, family, parser, tags),
                      _notes(entry, parser), family == "qwen3" or _is_deepseek_r1(entry), shown_template(entry))


def _parser_name(entry: PairEntry, source: TemplateSource, family: str) -> str | None:
    """The manifest's `parser`, else harmony for gpt-oss (routes.go shouldUseHarmony)."""
    name = entry.target.config.get("parser")
    if isinstance(name, str) and name:
        return name
    if family in GPT_OSS and "<|start|>" in source.text and "<|end|>" in source.text:
        return "harmony"
    return None


def _notes(entry: PairEntry, parser: str | None) -> tuple[str, ...]:
    out = []
    if (name := _renderer(entry)) is not None:
        how = "the GGUF's chat template" if _gguf_template(entry) else "the TEMPLATE layer"
        out.append(f"built-in renderer {name!r} is not implemented; rendering with {how}")
    if parser is not None and parser not in IMPLEMENTED_PARSER_NAMES:
        known = "built-in parser" if parser in KNOWN_PARSER_NAMES else "unknown parser"
        out.append(f"{known} {parser!r} is not implemented; output is parsed with the template's tags")
    return tuple(out)


def _thinking_tags(source: TemplateSource) -> tuple[str, str] | None:
    if source.go:
        t = go_template(source.text)
        tags = infer_think_tags(t) if t is not None else ("", "")
        return tags if tags[0] and tags[1] else None
    return ("<think>", "</think>") if _jinja_thinks(source.text) else None


def _jinja_thinks(source: str) -> bool:
    """server/images.go chatTemplateHasThinkingSupport."""
    if "<think>" in source and "</think>" in source:
        return True
    return (("content.split('</think>')" in source or 'content.split("</think>")' in source)
            and "reasoning_content" not in source and "<SPECIAL_12>" not in source)


def _capabilities(entry: PairEntry, source: TemplateSource, family: str, parser_name: str | None,
                  tags: tuple[str, str] | None) -> tuple[str, ...]:
    """server/images.go capabilitiesForTemplate."""
    caps: list[str] = []

    def add(name: str) -> None:
        if name not in caps:
            caps.append(name)

    for c in entry.target.config.get("capabilities") or []:
        add(str(c))
    add("completion")
    if supports_tools(source.text):
        add("tools")
    if source.go and (t := go_template(source.text)) is not None and "suffix" in template_vars(t):
        add("insert")
    if tags is not None:
        add("thinking")
    parser = parser_for_name(parser_name or "")
    if parser is not None:
        if parser.has_tool_support():
            add("tools")
        if parser.has_thinking_support():
            add("thinking")
    if family in GPT_OSS:
        add("thinking")
    return tuple(caps)


def _is_deepseek_r1(entry: PairEntry) -> bool:
    """Whether the model part of the target's Ollama name is `deepseek-r1` (paths and others: no)."""
    try:
        return parse_ollama_name(entry.target.ref)[2] == "deepseek-r1"
    except ModelNotFound:
        return False
