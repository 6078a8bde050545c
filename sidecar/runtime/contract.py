"""The plain values the API hands the runtime, and the ones it gets back.

A request arrives as a `Job`: the prompt to continue as the client gave it (`Prompt`, before any
template), the request's own options layer and its output constraint. The runtime answers with
`Delta`s, the output already split into content and tool calls, then one `Outcome`. Nothing here
knows about HTTP, JSON framing or llama.cpp: both API flavours build these, and the runtime never
calls back into the API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sidecar.engine.decoder import Result


@dataclass(frozen=True)
class Prompt:
    """What to continue. `chat` prompts are messages; a completion is one prompt text that the
    pair's template wraps as a user turn (`/api/generate`, `/v1/completions`), or, `raw`, is the
    model's input verbatim."""

    chat: bool = True
    messages: tuple[dict[str, Any], ...] = ()  # chat: the request's messages (Ollama's shape)
    tools: tuple[dict[str, Any], ...] | None = None  # chat: the tools offered
    text: str = ""  # completion: the prompt
    raw: bool = False  # completion: no template, no system, no history
    system: str | None = None  # completion: replaces the pair's SYSTEM
    template: str | None = None  # completion: replaces the pair's TEMPLATE
    context: tuple[int, ...] | None = None  # completion: token ids an earlier answer returned
    suffix: str = ""  # completion: fill in the middle, between `text` and this
    think: bool | str | None = None  # Ollama's `think`: None (the model's default), a bool, or a level

    @classmethod
    def of_chat(cls, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                think: bool | str | None = None) -> Prompt:
        return cls(chat=True, messages=tuple(messages), tools=tuple(tools) if tools else None, think=think)

    @classmethod
    def of_completion(cls, text: str, *, raw: bool = False, system: str | None = None,
                      template: str | None = None, context: list[int] | None = None, suffix: str = "",
                      think: bool | str | None = None) -> Prompt:
        return cls(chat=False, text=text, raw=raw, system=system, template=template,
                   context=tuple(context) if context is not None else None, suffix=suffix, think=think)

    @property
    def thinks(self) -> bool:
        """Whether thinking is asked for (api.ThinkValue.Bool)."""
        return self.think is True or isinstance(self.think, str)


@dataclass(frozen=True)
class Job:
    """One generation as a client asked for it."""

    prompt: Prompt
    options: Any = None  # the request's `options` object as sent (type-checked by the runtime)
    format: str | dict[str, Any] | None = None  # Ollama's `format`: "json" or a JSON schema
    keep_alive: float | None = None  # seconds; None: the daemon's default; negative: forever
    load_only: bool = False  # Ollama's empty prompt: load the model (or, keep_alive 0, unload it)
    truncate: bool = True  # fit the prompt to the context window (chat: drop the oldest messages)
    shift: bool = True  # when generation fills the window, shift it instead of stopping
    logprobs: int | None = None  # None: no logprobs; N: each token's, plus the N most likely alternatives


@dataclass(frozen=True)
class TokenLogprob:
    """A token and the target's log probability of it (Ollama's api.TokenLogprob)."""

    token: str
    logprob: float
    bytes: bytes


@dataclass(frozen=True)
class Logprob:
    """An emitted token's log probability and the most likely alternatives (Ollama's api.Logprob)."""

    token: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Delta:
    """A piece of output, final: text to show, the model's thinking, tool calls completed by it
    (Ollama's shape), and the log probabilities of the tokens that produced it."""

    content: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()
    thinking: str = ""
    logprobs: tuple[Logprob, ...] = ()


@dataclass
class Outcome:
    """The end of a generation: the engine's Result plus what the API reports around it.

    `result.done_reason` is the engine's (stop, length, cancel), or `load` / `unload` for a
    load-only job."""

    result: Result
    load_seconds: float = 0.0
    context: list[int] = field(default_factory=list)  # prompt plus output tokens (Ollama's `context`)

    @property
    def load_only(self) -> bool:
        return self.result.done_reason in ("load", "unload")
