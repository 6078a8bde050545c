"""One admitted, loaded job run to its end: render, generate on the engine, parse, stream.

The prompt is rendered and tokenized off the event loop (the chat is fitted to the window there),
the engine runs it on a free sequence of the target, and what it yields is parsed into Deltas on
the event loop: thinking, content and tool calls (runtime.output), with the target's logprobs
attached to the Delta their tokens produced.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from sidecar.config.entries import PairEntry
from sidecar.errors import Unavailable
from sidecar.runtime import render
from sidecar.runtime.contract import Delta, Engine, Generation, Job, Logprob, Model, Outcome
from sidecar.runtime.format import PairFormat
from sidecar.runtime.options import Effective
from sidecar.runtime.output import OutputParser


class ShuttingDown(Unavailable):
    """The daemon is stopping: no new work, and running generations were cut at the drain deadline."""


async def rendered(entry: PairEntry, fmt: PairFormat, job: Job, model: Model, num_keep: int) -> render.Rendered:
    """The prompt the job runs on, as text (Ollama's `_debug_render_only`: after fitting the window
    unless the job says not to) and as tokens (what /v1/messages/count_tokens counts)."""
    parser = OutputParser.start(fmt, job.prompt)
    return await asyncio.to_thread(render.prepare, entry, fmt, job.prompt, model, job.truncate,
                                   parser.rendered_tools, num_keep)


async def run(engine: Engine, model: Model, entry: PairEntry, fmt: PairFormat, job: Job, opts: Effective,
              grammar: str | None, load_seconds: float, halt: threading.Event,
              stop: Callable[[], bool] | None = None) -> AsyncIterator[Delta | Outcome]:
    parser = OutputParser.start(fmt, job.prompt)
    rendered = await asyncio.to_thread(render.prepare, entry, fmt, job.prompt, model, job.truncate,
                                       parser.rendered_tools, opts.num_keep)
    parser.begin(rendered.text)
    gen = Generation(
        rendered.tokens, opts, bounded_num_predict(opts.num_predict, model.n_ctx), grammar,
        grammar_after=parser.end_of_thinking() if grammar else None, logprobs=job.logprobs,
        truncate=job.truncate, shift=job.shift, preserve=tuple(parser.preserved_tokens()), format=job.format,
        whole=rendered.whole, interactive=job.interactive,
    )
    pending: list[Logprob] = []  # logprobs of tokens whose text the parser still holds
    # halt: the shutdown's drain deadline passed; stop: the request's client left
    items = engine.generate(model, entry.name, gen, lambda: halt.is_set() or (stop is not None and stop()))
    try:
        async for item in items:
            if isinstance(item, tuple):
                pending += item
                continue
            if isinstance(item, str):
                d = parser.delta(item, False, pending)
            else:
                if item.done_reason == "cancel" and halt.is_set():
                    raise ShuttingDown("server shutting down")
                d = parser.delta("", True, pending)
            if d is not None:
                pending = []
                yield d
            if isinstance(item, Outcome):
                yield replace(item, load_seconds=load_seconds,
                              prompt_truncated=item.prompt_truncated + rendered.dropped)
    finally:
        await items.aclose()  # type: ignore[attr-defined]


OPEN_ENDED_WINDOWS = 10  # Ollama's openEndedGenerationContextMultiplier (llm/llama_server.go)


def bounded_num_predict(num_predict: int, n_ctx: int) -> int:
    """Ollama's boundedNumPredict: an open-ended generation (or one asking for more) stops after
    ten windows' worth of tokens, which a context shift would otherwise never reach."""
    limit = OPEN_ENDED_WINDOWS * n_ctx
    return limit if num_predict < 0 or num_predict > limit else num_predict
