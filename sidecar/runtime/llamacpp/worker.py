"""The thread that owns a loaded target's llama.cpp context, and the bounded bridge to asyncio.

llama.cpp contexts are not thread-safe, so every call that touches one runs on the thread that
owns it. A loaded target has ONE context, with a KV stream per sequence it can run at once
(OLLAMA_NUM_PARALLEL), and one `Batcher` thread that steps all of its running sequences together
(engine.step.StepLoop): one llama_decode per step, whatever the number of requests. Driving
several contexts from several threads was what made four slots slow: each native thread that
calls into ggml brings its own OpenMP team, and on two cores a lone stream ran at 0.7x of a
one-slot daemon (README, Concurrency); four contexts stepped from one thread ran at full speed.

Requests wait in one queue (the per-model request queue), interactive (streamed) ones first
within a bound, FIFO within each class (runtime.admission). Between steps the batcher admits the
request that goes next while a stream is free, and runs calls that must touch the context
(building a pair's drafters: `call`; freeing them, unloading: `after`, once every request
submitted before has finished) in arrival order: no request moves ahead of a call.

Each request's items go to the event loop through a bounded buffer. The batcher never waits on
it: a sequence whose client has `maxsize` items unread from before its last step sits out the
steps until the client reads (its stream stays held), so a slow client slows only its own
stream. When the client goes away the sequence sees the cancel flag at the next step and leaves
it.

Admission runs in a copy of the submitter's contextvars, so its log lines carry the request id.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sidecar.engine.decoder import Result
from sidecar.engine.sequence import Sequence as EngineSequence
from sidecar.engine.step import Output, StepLoop
from sidecar.runtime.admission import AdmissionQueue

T = TypeVar("T")
_END = object()


class Stopped(RuntimeError):
    """The model was unloaded before this request could start."""


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any]
    context: contextvars.Context
    after: bool  # wait until every request admitted before it has finished


class _Sink:
    """One request's side of the bridge: its items, its cancel flag and the event loop to wake."""

    def __init__(self, loop: asyncio.AbstractEventLoop, maxsize: int, wake: Callable[[], None]) -> None:
        self.loop = loop
        self.maxsize = maxsize
        self.items: deque[Any] = deque()
        self.fresh = 0  # how many of the items the last step put (the newest)
        self.cancel = threading.Event()
        self.waiting = False
        self.future: asyncio.Future[None] | None = None
        self._wake_batcher = wake

    @property
    def full(self) -> bool:
        """`maxsize` items unread from before the last step's. A step's own items never count: a
        round that accepted a long draft puts more than `maxsize` at once, and its sequence would
        sit out the next step while the client reads them, and a waiting prompt's chunk with it
        would go in whole (StepLoop cuts it only beside the sequences that decode)."""
        return len(self.items) - self.fresh >= self.maxsize

    def put_step(self, items: Sequence[Any]) -> None:
        """From the batcher: a step's items."""
        self.fresh = len(items)
        for item in items:
            self.put(item)

    def put(self, item: Any) -> None:
        """From the batcher: hand an item over, waking the consumer only if it waits (under the GIL
        the consumer publishes that it waits, then looks again; so either it sees the item or we
        see the flag)."""
        self.items.append(item)
        if self.waiting:
            self.waiting = False
            try:
                self.loop.call_soon_threadsafe(_wake, self.future)
            except RuntimeError:  # the loop closed under us
                self.cancel.set()

    async def get(self) -> Any:
        while not self.items:
            self.future = self.loop.create_future()
            self.waiting = True
            if self.items:
                self.waiting = False
                break
            await self.future
        was_full = self.full
        item = self.items.popleft()
        if was_full:  # the sequence sat out steps for want of room: it may go on
            self._wake_batcher()
        return item

    def close(self) -> None:
        self.cancel.set()
        self._wake_batcher()


@dataclass
class _Admit:
    prompt: Sequence[int]
    make: Callable[[int, Callable[[], bool]], EngineSequence]
    sink: _Sink
    context: contextvars.Context
    interactive: bool


def _wake(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class Batcher:
    """The thread that owns a target's context: admission (interactive first, runtime.admission),
    one step over every running sequence at a time, and the calls that need the context, in
    between (module docstring)."""

    def __init__(self, name: str, loop: StepLoop) -> None:
        self.name = name
        self.loop = loop
        self._cond = threading.Condition()
        self._queue: AdmissionQueue[_Admit | _Call] = AdmissionQueue()
        self._sinks: dict[int, _Sink] = {}  # id(sequence) -> its request's sink
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"llama:{name}", daemon=True)
        self._thread.start()

    # -- the event loop's side -------------------------------------------------------------
    def call(self, fn: Callable[[], T], *, after: bool = False) -> concurrent.futures.Future[T]:
        """Run fn() on the batcher's thread between steps; with `after`, once every request
        submitted before it has finished (so fn may free what they use)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._put(_Call(fn, fut, contextvars.copy_context(), after))
        return fut

    async def stream(self, prompt: Sequence[int], make: Callable[[int, Callable[[], bool]], EngineSequence],
                     maxsize: int = 16, interactive: bool = False) -> AsyncGenerator[Any, None]:
        """Queue a request: `make(stream, cancelled)` builds its engine sequence on the batcher's
        thread once a stream is free; yield its items on the event loop as they come. An
        `interactive` one (someone watches it stream) waits ahead of those that are not.

        Exceptions its start or its steps raise are re-raised here. Leaving the `async for` early
        (client disconnect, server shutdown) sets the cancel flag; the sequence leaves at its
        next step, or never starts."""
        sink = _Sink(asyncio.get_running_loop(), maxsize, self._notify)
        self._put(_Admit(prompt, make, sink, contextvars.copy_context(), interactive))
        try:
            while True:
                item = await sink.get()
                if item is _END:
                    break
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:
            sink.close()

    def stop(self) -> None:
        """End the thread once everything queued before this has run and finished."""
        def stop() -> None:
            self._stopping = True

        self.call(stop, after=True)

    def waiting(self) -> tuple[int, int]:
        """(interactive, non-interactive) requests waiting for a free stream."""
        with self._cond:
            return self._queue.waiting(True), self._queue.waiting(False)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _put(self, entry: _Admit | _Call) -> None:
        with self._cond:
            if self._stopping:
                err = Stopped("the model was unloaded")
                if isinstance(entry, _Call):
                    entry.future.set_exception(err)
                else:
                    entry.sink.put(_Failure(err))
                return
            self._queue.append(entry, entry.interactive if isinstance(entry, _Admit) else None)
            self._cond.notify()

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify()

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        loop = self.loop
        while True:
            self._admit()
            with self._cond:
                if self._stopping and not loop.running and not self._queue:
                    return
                if not self._runnable():
                    if not self._admissible():
                        # Nothing to do until a request or call comes, a client reads or leaves.
                        self._cond.wait(0.5)
                    continue
            self._step()

    def _runnable(self) -> bool:
        """Whether a step has work: a running sequence whose client has room or is gone."""
        return any(not sink.full or sink.cancel.is_set() for sink in self._sinks.values())

    def _admissible(self) -> bool:
        """Whether the request or call that goes next can go now (called under the lock)."""
        head = self._queue.peek()
        if head is None:
            return False
        if isinstance(head, _Call):
            return not (head.after and self.loop.running)
        return not self.loop.full or head.sink.cancel.is_set()

    def _admit(self) -> None:
        """Take what goes next while it can: calls, and requests while a stream is free."""
        loop = self.loop
        while True:
            with self._cond:
                if not self._admissible():
                    return
                head = self._queue.pop()
            if isinstance(head, _Call):
                if head.future.set_running_or_notify_cancel():
                    try:
                        head.future.set_result(head.context.run(head.fn))
                    except BaseException as e:  # delivered to the caller, never kills the thread
                        head.future.set_exception(e)
                continue
            sink = head.sink
            if sink.cancel.is_set():  # the client left while it waited: not even a prefill
                continue
            try:
                seq = head.context.run(loop.add, head.prompt, _bound(head.make, sink.cancel.is_set))
            except BaseException as e:
                sink.put(_Failure(e))
                continue
            self._sinks[id(seq)] = sink

    def _step(self) -> None:
        sinks = self._sinks

        def skip(seq: EngineSequence) -> bool:
            sink = sinks[id(seq)]
            return sink.full and not sink.cancel.is_set()

        # The step may hand over the last step's output while its decode runs (StepLoop.overlap).
        self._publish(self.loop.step(skip, self._publish))

    def _publish(self, outputs: list[Output]) -> None:
        """Each sequence's output to its request's sink; a Result or a failure ends the request."""
        sinks = self._sinks
        for seq, got in outputs:
            sink = sinks[id(seq)]
            if isinstance(got, BaseException):
                del sinks[id(seq)]
                sink.put(_Failure(got))
                continue
            sink.put_step(got)
            if isinstance(got[-1], Result):
                del sinks[id(seq)]
                sink.put(_END)


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _bound(make: Callable[[int, Callable[[], bool]], EngineSequence], cancelled: Callable[[], bool]
           ) -> Callable[[int], EngineSequence]:
    """`make` with its request's cancel check: what the step loop calls with the stream it gives."""
    return lambda sid: make(sid, cancelled)
