"""One admitted, loaded job run to its end: render, decode on a slot, parse, stream.

The prompt is rendered and tokenized off the event loop (the chat is fitted to the window there),
the engine runs on a free slot of the target (runtime.worker), and what it yields is parsed into
Deltas on the event loop: thinking, content and tool calls (runtime.output), with the target's
logprobs attached to the Delta their tokens produced.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from sidecar.config.entries import PairEntry
from sidecar.engine.decoder import Logprobs, Request, Result
from sidecar.engine.window import truncate_prompt
from sidecar.errors import Unavailable
from sidecar.runtime import render
from sidecar.runtime.contract import Delta, Job, Logprob, Outcome, TokenLogprob
from sidecar.runtime.loading import Loaded, Slot
from sidecar.runtime.options import Effective
from sidecar.runtime.output import OutputParser
from sidecar.runtime.worker import stream


class ShuttingDown(Unavailable):
    """The daemon is stopping: no new work, and running generations were cut at the drain deadline."""


async def render_text(entry: PairEntry, job: Job, lm: Loaded, opts: Effective) -> str:
    """The prompt text the job runs on (Ollama's `_debug_render_only`: after fitting the window)."""
    parser = OutputParser.start(entry, job.prompt)
    rendered = await asyncio.to_thread(render.prepare, entry, job.prompt, lm.weights, lm.n_ctx, job.truncate,
                                       parser.rendered_tools)
    return rendered.text


async def run(entry: PairEntry, job: Job, lm: Loaded, opts: Effective, grammar: str | None, load_seconds: float,
              halt: threading.Event) -> AsyncIterator[Delta | Outcome]:
    parser = OutputParser.start(entry, job.prompt)
    rendered = await asyncio.to_thread(render.prepare, entry, job.prompt, lm.weights, lm.n_ctx, job.truncate,
                                       parser.rendered_tools)
    parser.after_render(entry, job.prompt, rendered.text)
    pe = lm.pairs[entry.name]
    req = Request(
        rendered.tokens, opts.sampling, bounded_num_predict(opts.num_predict, lm.n_ctx), opts.stop,
        speculate=opts.draft_num_predict != 0, n_max=opts.draft_num_predict or None, grammar=grammar,
        logprobs=job.logprobs, truncate=job.truncate, num_keep=opts.num_keep, shift=job.shift,
        grammar_after=parser.end_of_thinking(job.prompt) if grammar else None,
        preserve=frozenset(lm.weights.special_ids(parser.preserved_tokens())),
    )

    def produce(slot: Slot, cancelled: Callable[[], bool]) -> Iterator[str | Logprobs | Outcome]:
        def stop() -> bool:  # the client went away, or the shutdown's drain deadline passed
            return cancelled() or halt.is_set()

        for item in pe.decoders[slot.index].generate(req, stop):
            if isinstance(item, Result):
                yield Outcome(item, load_seconds, used_prompt(req, item, lm) + item.tokens)
            else:
                yield item

    pending: list[Logprob] = []  # logprobs of tokens whose text the parsers still hold
    # Close the inner stream explicitly: an abandoned async generator is only finalised by the
    # garbage collector, and until then the worker keeps generating.
    items = stream(lm.pool, produce)
    try:
        async for item in items:
            if isinstance(item, Logprobs):
                pending += _logprobs(item)
                continue
            if isinstance(item, str):
                d = _delta(parser, item, False, pending)
            else:
                if item.result.done_reason == "cancel" and halt.is_set():
                    raise ShuttingDown("server shutting down")
                d = _delta(parser, "", True, pending)
            if d is not None:
                pending = []
                yield d
            if isinstance(item, Outcome):
                yield item
    finally:
        await items.aclose()


OPEN_ENDED_WINDOWS = 10  # Ollama's openEndedGenerationContextMultiplier (llm/llama_server.go)


def bounded_num_predict(num_predict: int, n_ctx: int) -> int:
    """Ollama's boundedNumPredict: an open-ended generation (or one asking for more) stops after
    ten windows' worth of tokens, which a context shift would otherwise never reach."""
    limit = OPEN_ENDED_WINDOWS * n_ctx
    return limit if num_predict < 0 or num_predict > limit else num_predict


def used_prompt(req: Request, result: Result, lm: Loaded) -> list[int]:
    """The prompt the engine ran on: the request's, or the same cut it made to fit the window."""
    if not result.prompt_truncated:
        return req.prompt
    return truncate_prompt(req.prompt, lm.n_ctx, req.num_keep, lm.weights.vocab_info().add_bos)


def _delta(parser: OutputParser, text: str, done: bool, logprobs: list[Logprob]) -> Delta | None:
    if parser.parses:
        content, thinking, calls = parser.feed(text, done)
    else:
        content, thinking, calls = text, "", []
    if not (content or thinking or calls or logprobs):
        return None
    return Delta(content, tuple(calls), thinking, tuple(logprobs))


def _logprobs(item: Logprobs) -> list[Logprob]:
    return [Logprob(TokenLogprob(e.token, e.logprob, e.bytes),
                    tuple(TokenLogprob(a.token, a.logprob, a.bytes) for a in e.top)) for e in item.entries]

