"""From a request's Prompt to the model's input, through the pair's template (runtime.format).

`admit` refuses what the pair cannot do and settles `think`. `prepare` renders and tokenizes with
the loaded model's tokenizer (whatever the engine), dropping the oldest messages when the prompt
does not fit the context window (server/prompt.go chatPrompt): system messages and the last
message always stay.

When even the system messages and the last message do not fit (an app's 6,000-token tool list in
a 4,096-token window), Ollama's runner cuts tokens: it keeps `num_keep` tokens at the start and the
newest ones (llm/llama_server.go completionPromptForRequest). Its cut moves with every token the
conversation grows by, so the next turn shares only those `num_keep` tokens with the last, and the
prefix cache cannot help. `prepare` cuts to about the same length, but keeps a head that does not
move: the rendered system part (system messages and the tools the template writes with them), up
to half of what the cut keeps; the newest tokens fill the rest. The same conversation then cuts the
same way, and the next turn, or a parallel request with the same system prompt and tools, finds
that head in the prefix cache.

The newest tokens start at a multiple of a grain (a power of two, at most 1/16 of them: `GRAIN`),
not at whatever token Ollama's length would start them: requests that share everything but their
last message (Open WebUI's users, with one system prompt and 36 tools; an agent's parallel
sub-tasks) then keep the same tokens up to that message, not only the head, and the second one
evaluates its own question alone. The cut is up to a grain shorter than Ollama's for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from sidecar.config.entries import PairEntry
from sidecar.engine.drafters import common_prefix
from sidecar.engine.window import prompt_limit
from sidecar.errors import ClientError, ServerError
from sidecar.models.resolve import parse_ollama_name
from sidecar.runtime.contract import Model, Prompt, Vocabulary
from sidecar.runtime.format import PairFormat, TemplateSource
from sidecar.templates.chat import ChatTemplate, GoChatTemplate, JinjaChatTemplate, TemplateError
from sidecar.templates.parsers import ThinkingParser

GRAIN = 16  # a cut's newest tokens start on the largest power of two <= 1/16 of their count


class PromptError(ServerError):
    """The pair's template cannot render this prompt: Ollama answers 500 (routes.go, both when a
    request's own template does not parse and when a template fails while executing)."""


class TemplateInvalid(PromptError):
    """The template does not parse (a request's own, mostly): Ollama's 500 too, but nothing of the
    daemon's failed, so the log gets the message without a traceback."""

    traced = False


class Unsupported(ClientError):
    """The pair lacks a capability the request needs."""


def full_name(entry: PairEntry) -> str:
    """The name as Ollama spells it in capability errors: registry.ollama.ai/library/x:tag."""
    host, ns, model, tag = parse_ollama_name(entry.name)
    return f"{host}/{ns}/{model}:{tag}"


def admit(entry: PairEntry, fmt: PairFormat, prompt: Prompt) -> Prompt:
    """Refuse what the pair cannot do, and settle `think` as Ollama does (routes.go): a model that
    can think thinks unless told not to; asking one that cannot is the client's error."""
    caps = fmt.capabilities
    if prompt.tools and "tools" not in caps:
        raise Unsupported(f"{full_name(entry)} does not support tools")
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


def messages(entry: PairEntry, fmt: PairFormat, prompt: Prompt) -> list[dict[str, Any]]:
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
        return _filter_think_tags(full) if fmt.filters_thinking else full
    out: list[dict[str, Any]] = []
    system = prompt.system if prompt.system is not None else entry.system
    if system:
        out.append({"role": "system", "content": system})
    if prompt.context is None:
        out += entry.history
    out.append({"role": "user", "content": prompt.text})
    return out


def _filter_think_tags(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
    out = []
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and i < last_user:
            _, content = ThinkingParser("<think>", "</think>").add(m["content"])
            m = {**m, "content": content}
        out.append(m)
    return out


def chat_template(source: TemplateSource, vocab: Vocabulary) -> ChatTemplate:
    if source.go:
        return GoChatTemplate(source.text)
    return JinjaChatTemplate(source.text, bos_token=vocab.bos, eos_token=vocab.eos)


@dataclass(frozen=True)
class Rendered:
    text: str  # the template's output (what _debug_render_only shows)
    tokens: list[int]  # what the model runs on: `context` ids, then the text's tokens
    dropped: int = 0  # tokens the stable cut took out of `tokens` (messages dropped whole not counted)
    # The whole conversation's tokens, nothing dropped, when `tokens` was fitted to the window:
    # what free drafters look up in (a file or tool call the cut left out is still worth copying).
    whole: list[int] | None = None


def prepare(entry: PairEntry, fmt: PairFormat, prompt: Prompt, model: Model, truncate: bool,
            tools: list[dict[str, Any]] | None = None, num_keep: int = 4) -> Rendered:
    """Render and tokenize; with `truncate`, drop the oldest messages until the prompt fits the
    model's window, and cut the rest with a stable head if it still does not (module docstring).

    `tools` are the tools as the output parser wants them rendered (harmony renames them);
    `num_keep` the request's option (the head keeps at least that many tokens, as Ollama's cut).
    Blocking (templates, tokenizer): run it off the event loop."""
    if prompt.raw:
        return _tokenized(prompt.text, None, model)
    before = list(prompt.context) if prompt.context is not None else None
    source = TemplateSource(prompt.template, True) if prompt.template else fmt.template
    try:
        template = chat_template(source, model.vocabulary())
    except TemplateError as e:
        raise TemplateInvalid(e.go) from None
    try:
        if prompt.suffix:
            assert isinstance(template, GoChatTemplate)  # admit() required the insert capability
            return _tokenized(template.render_fim(prompt.text, prompt.suffix, prompt.think), before, model)

        def render(msgs: list[dict[str, Any]]) -> str:
            return template.render(msgs, tools, prompt.think)

        msgs = messages(entry, fmt, prompt)
        if not truncate or prompt.template:
            return _tokenized(render(msgs), before, model)
        fitted, full = _fit(msgs, render, lambda text: _tokenized(text, before, model), model.n_ctx)
        whole = None if fitted is full else full.tokens
        if len(fitted.tokens) < model.n_ctx or num_keep < 0:
            # Fits; or num_keep -1 (keep the whole prompt): the engine's cut, as Ollama's.
            return replace(fitted, whole=whole)
        system = [m for m in msgs if m["role"] == "system"]
        head = common_prefix(_tokenized(render(system), before, model).tokens, fitted.tokens) if system else 0
        add_bos = bool(model.tokenize("", add_special=True))  # Ollama's tokenizerAddsBOS: num_keep + 1
        return stable_cut(fitted, head, model.n_ctx, num_keep + int(add_bos), whole or full.tokens)
    except TemplateError as e:
        raise PromptError(e.go) from None


def _tokenized(text: str, before: list[int] | None, model: Model) -> Rendered:
    # Add BOS when the vocabulary wants it, unless the template already wrote it (or ids come first).
    bos = model.vocabulary().bos
    add_special = not before and not (bos and text.startswith(bos))
    return Rendered(text, list(before or []) + model.tokenize(text, add_special=add_special))


def _fit(msgs: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str],
         tokenize: Callable[[str], Rendered], n_ctx: int) -> tuple[Rendered, Rendered]:
    """Ollama's chatPrompt: the first start i whose prompt fits in n_ctx tokens, keeping the system
    messages before it and always the last message; and the prompt of every message (i = 0).

    Ollama tries i = 0, 1, 2 ... in turn; dropping messages from the front only shortens a prompt,
    so a bisection finds the same i with log(n) renders (a 5,000-message chat stays cheap)."""

    seen: dict[int, Rendered] = {}

    def at(i: int) -> Rendered:
        if i not in seen:
            kept = [m for m in msgs[:i] if m["role"] == "system"] + msgs[i:]
            seen[i] = tokenize(render(kept))
        return seen[i]

    if len(msgs) <= 1 or len(at(0).tokens) <= n_ctx:
        return at(0), at(0)
    lo, hi = 1, len(msgs) - 1  # the answer is in [lo, hi]; hi (the last message alone) is taken anyway
    while lo < hi:
        mid = (lo + hi) // 2
        if len(at(mid).tokens) <= n_ctx:
            hi = mid
        else:
            lo = mid + 1
    return at(lo), at(0)


def stable_cut(fitted: Rendered, system: int, n_ctx: int, n_keep: int, whole: list[int]) -> Rendered:
    """`fitted` cut to at most the length Ollama's runner cuts it to (`prompt_limit`), keeping its
    first `system` tokens (the rendered system part), at most half of that length and at least
    `n_keep`, and the newest tokens after them from a multiple of the grain on (module docstring)."""
    tokens = fitted.tokens
    limit = prompt_limit(n_ctx, min(n_keep, n_ctx - 1))
    head = max(min(system, limit // 2), min(n_keep, limit))
    if limit <= head:
        return Rendered(fitted.text, tokens[:limit], len(tokens) - limit, whole)
    grain = 1 << (max((limit - head) // GRAIN, 1).bit_length() - 1)  # never a whole message's worth
    start = -(-(len(tokens) - (limit - head)) // grain) * grain  # Ollama's start, up to the grain
    cut = [*tokens[:head], *tokens[start:]]
    return Rendered(fitted.text, cut, len(tokens) - len(cut), whole)
