"""The plain values the API hands the runtime and gets back, and the seam to an inference engine.

A request arrives as a `Job`: the prompt to continue as the client gave it (`Prompt`, before any
template), the request's own options layer and its output constraint. The runtime answers with
`Delta`s, the output already split into content and tool calls, then one `Outcome`. Nothing here
knows about HTTP, JSON framing or llama.cpp: both API flavours build these, and the runtime never
calls back into the API.

Below the runtime sits an `Engine`: it loads a pair's target as a `Model` (tokenizer, vocabulary,
context length, a status snapshot), adds the pairs' drafting to it, and runs a rendered
`Generation` into text pieces, logprobs and an `Outcome`. The runtime (keep_alive, admission,
queueing limits, reloads, templates, output parsing) talks to nothing else, so an engine other
than llama.cpp (runtime.llamacpp) plugs in beside it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sidecar.config.entries import PairEntry
from sidecar.runtime.options import Effective


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
    # Someone watches the answer come (a streamed request): when every slot is busy, it is admitted
    # before waiting requests nobody watches (titles, tags, batch jobs), within a bound (the engine's).
    interactive: bool = False


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
    """The end of a generation: Ollama's metrics, the speculation counters, and what the API
    reports around them.

    `done_reason` is the engine's (stop, length, cancel), or `load` / `unload` for a load-only job."""

    done_reason: str = "stop"
    tokens: list[int] = field(default_factory=list)  # generated tokens, end-of-generation excluded
    prompt_tokens: int = 0  # prompt tokens evaluated (after any cut to fit the window; cached ones not)
    prompt_cached: int = 0  # prompt tokens taken from the prefix cache instead of evaluated
    prompt_seconds: float = 0.0
    eval_seconds: float = 0.0
    draft_tokens: int = 0  # drafted
    draft_accepted_tokens: int = 0
    draft_rounds: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted drafts by position in the draft
    drafts_by_source: dict[str, tuple[int, int]] = field(default_factory=dict)  # source: (drafted, accepted)
    fallback: str | None = None  # why speculation was switched off, if it was
    drafter: str | None = None  # what drafted (for the request's log line)
    prompt_truncated: int = 0  # prompt tokens dropped to fit the window
    shifts: int = 0  # context shifts during generation
    withdrawn: int = 0  # rounds the schedule stepped plain though a draft was ready (engine.schedule)
    # Decode seconds drafting saved against stepping plain, by the engine's cost model (negative:
    # lost; 0 where the engine cannot tell): eval_seconds + this is the target-only time.
    saved_seconds: float = 0.0
    load_seconds: float = 0.0
    context: list[int] = field(default_factory=list)  # prompt plus output tokens (Ollama's `context`)

    @property
    def load_only(self) -> bool:
        return self.done_reason in ("load", "unload")

    @property
    def eval_count(self) -> int:
        return len(self.tokens)


# -- the engine seam ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Generation:
    """A job rendered for the engine: the tokens to continue, and everything that shapes the output."""

    tokens: list[int]
    options: Effective  # sampling, stop strings, draft length (0: no speculation), num_keep
    num_predict: int  # already bounded (runtime.generation.bounded_num_predict)
    grammar: str | None = None  # GBNF the output must follow
    grammar_after: str | None = None  # hold the grammar back until the output's text contains this
    logprobs: int | None = None  # None: none; N: each token's, plus the N most likely alternatives
    truncate: bool = True  # cut a prompt that does not fit instead of refusing it
    shift: bool = True  # shift a full window and go on instead of stopping
    preserve: tuple[str, ...] = ()  # control tokens to emit as their text (the output parser needs them)
    format: str | dict[str, Any] | None = None  # the job's `format`, for an engine that constrains natively
    # The whole conversation's tokens where `tokens` was fitted to the window (runtime.render):
    # what drafters that cost no model pass look up in. None: `tokens` is all of it.
    whole: list[int] | None = None
    interactive: bool = False  # admitted before waiting non-interactive generations (Job.interactive)


@dataclass(frozen=True)
class Vocabulary:
    """What the runtime needs of a model's vocabulary, whatever the engine: the BOS and EOS texts
    ("" if it has none) a chat template writes, and a rendered prompt may already begin with.
    Token-level facts (ids, types) stay with the engine and pairing."""

    bos: str
    eos: str


@dataclass(frozen=True)
class ModelStatus:
    """A loaded target as /api/ps and /sidecar/status show it."""

    target: str  # the model file (or what the engine loads it from)
    context_length: int
    parallel: int  # sequences it runs at once
    pairs: tuple[str, ...]  # the pairs riding on it
    gpu_layers: int  # layers offloaded to a GPU (0: all on the CPU)
    cost_curve: str | None = None  # where the verify cost curve came from: cached, measured, provisional
    in_flight: int = 0  # requests running or queued on it (the runtime's count)
    expires_at: float | None = None  # time.time() of its keep_alive expiry; None: never
    busy: int = 0  # sequences running in its batch right now
    steps: int = 0  # batched decodes so far
    rows: int = 0  # rows those decodes held (rows / steps: the batch's mean width)
    tokens: int = 0  # tokens its sequences emitted so far, counted as they come (sidecar top's tok/s)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of prefilled
    restored_tokens: int = 0  # ... of which loaded back from host memory (engine.hostcache)
    host_cache_bytes: int = 0  # what the prompts kept in host memory take
    withdrawn: int = 0  # rounds its schedule ran plain though a draft was ready (engine.schedule)
    together: int = 0  # model drafts made in one batch with another sequence's (drafters.propose_together)
    waiting_interactive: int = 0  # streamed requests waiting for a free sequence (runtime.admission)
    waiting_background: int = 0  # ... and the non-streamed ones, which they go before
    # Its steps' wall seconds and the host's part of them (all but llama_decode and waiting for
    # it), each as a histogram: bucket bounds, cumulative counts with +Inf last, and their sum;
    # None where the engine does not time its steps (vLLM's server steps itself).
    step_seconds: tuple[tuple[float, ...], tuple[int, ...], float] | None = None
    host_seconds: tuple[tuple[float, ...], tuple[int, ...], float] | None = None
    host_share: float | None = None  # the host's share of the recent steps' wall time
    # What each pair's cost model believes (engine.cost.CostModel.beliefs: the device's and the
    # draft model's fitted weights, in seconds), and the host's fitted price; None where the
    # engine prices nothing (vLLM).
    cost: dict[str, Any] | None = None


class Model(Protocol):
    """A target an engine has loaded, with the pairs riding on it."""

    @property
    def n_ctx(self) -> int:
        """The context window of each sequence."""
        ...

    def fits(self, n_ctx: int, num_gpu: int = -1) -> bool:
        """Whether a request asking for this window and `num_gpu` target layers on the GPUs (-1: any)
        runs on this load; False: reload for it."""
        ...

    def vocabulary(self) -> Vocabulary: ...

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        """Special tokens written in the text (`<|im_start|>`) are parsed as such; `add_special`
        adds the BOS where the vocabulary wants one."""
        ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...

    def pair(self, name: str) -> PairEntry | None:
        """The declaration the pair's drafting on this model was built from; None: not loaded here."""
        ...

    def status(self) -> ModelStatus:
        """The engine's facts; the runtime fills in `in_flight` and `expires_at`."""
        ...


Piece = str | tuple[Logprob, ...] | Outcome  # what a generation yields: text, the logprobs of its tokens, the end


class Engine(Protocol):
    """What the runtime needs from an inference engine. Blocking work runs off the event loop."""

    def load_key(self, entry: PairEntry, parallel: int) -> str:
        """What makes two pairs share one loaded target: its file and the load settings the engine honours."""
        ...

    async def load(self, entry: PairEntry, n_ctx: int, parallel: int, num_gpu: int = -1) -> Model:
        """Load the pair's target with `parallel` sequences of `n_ctx` tokens each, and `num_gpu`
        of its layers on the GPUs where the request names a count (-1: the pair's own setting)."""
        ...

    async def add_pair(self, model: Model, entry: PairEntry) -> None:
        """Build the pair's drafting on the model; one it displaces is freed after its running requests."""
        ...

    def rebind_pair(self, model: Model, entry: PairEntry) -> None:
        """Keep the pair's drafting for a new declaration that differs only in per-request defaults."""
        ...

    def drop_pair(self, model: Model, name: str) -> None:
        """Free the pair's drafting once the requests already queued on the model are through."""
        ...

    def unload(self, model: Model) -> None:
        """Free the model once the requests already queued on it are through."""
        ...

    async def join(self, model: Model, timeout: float) -> None:
        """Wait (at most `timeout` seconds) until an unloaded model is freed."""
        ...

    async def close(self) -> None:
        """Write what must outlive the process (the suffix caches' files)."""
        ...

    def generate(self, model: Model, pair: str, gen: Generation, stop: Callable[[], bool]) -> AsyncIterator[Piece]:
        """Run one generation on a free sequence of the model: text pieces and logprobs as they are
        final, then one Outcome (`context` filled in). It ends early with done_reason `cancel` when
        `stop()` turns true or the consumer leaves."""
        ...

    def status(self) -> dict[str, Any]:
        """Engine-wide facts for /sidecar/status (what is mapped and shared)."""
        ...
