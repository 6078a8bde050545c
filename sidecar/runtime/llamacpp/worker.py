"""Worker threads for llama.cpp contexts, and the bounded bridge between them and asyncio.

llama.cpp contexts are not thread-safe, so every call that touches one runs on the thread that
owns it. A loaded model has one or more *slots* (OLLAMA_NUM_PARALLEL), each a context with its own
thread; a `Pool` is those threads pulling jobs from one FIFO queue, so a job runs on the first slot
that is free and jobs run in arrival order (that queue is also the per-model request queue). With
one slot this is exactly one thread working through its queue.

A streaming job hands its items to the event loop through a bounded buffer: when the client reads
slowly the buffer fills and the worker blocks, so generation never runs ahead of the client; when
the client goes away the job sees the cancel flag within one decode step and stops.

Every job runs in a copy of the submitter's contextvars, so log lines from a worker carry the
request id of the request they work for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
S = TypeVar("S")
_STOP = object()
_END = object()


class Cancelled(Exception):
    """The consumer of a stream went away."""


class Pool(Generic[S]):
    """One thread per slot, all taking jobs from one queue; a job gets the slot it runs on."""

    def __init__(self, name: str, slots: Sequence[S]) -> None:
        self.name = name
        self.slots = list(slots)
        self._index = {id(s): i for i, s in enumerate(self.slots)}
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._threads = [threading.Thread(target=self._run, args=(slot,), name=f"llama:{name}#{i}", daemon=True)
                         for i, slot in enumerate(self.slots)]
        for t in self._threads:
            t.start()

    def _run(self, slot: S) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            fn, fut, ctx = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(ctx.run(fn, slot))
            except BaseException as e:  # delivered to the awaiting request, never kills the thread
                fut.set_exception(e)

    def submit(self, fn: Callable[[S], T]) -> concurrent.futures.Future[T]:
        """Run fn(slot) on the first free slot, after every job submitted before it has started."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fn, fut, contextvars.copy_context()))
        return fut

    async def call(self, fn: Callable[[S], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    def broadcast(self, fn: Callable[[S], T], then: Callable[[], None] | None = None
                  ) -> concurrent.futures.Future[list[T]]:
        """Run fn(slot) once on every slot, then `then()` once all of them are through.

        Each slot runs its call after finishing the job it had taken before, so fn may free what
        that slot alone uses. A barrier holds each thread until every slot has run its call: that is
        what makes every slot take exactly one of the N queued calls, and it lets `then` free what
        the slots share. The result lists fn's results by slot; the first failure is raised after
        all have run (and after `then`)."""
        n = len(self.slots)
        results: list[Any] = [None] * n
        errors: list[BaseException] = []
        done: concurrent.futures.Future[list[T]] = concurrent.futures.Future()

        def finish() -> None:  # the barrier's action: runs once, in the last thread to arrive
            try:
                if then is not None:
                    then()
            except BaseException as e:
                errors.append(e)
            if errors:
                done.set_exception(errors[0])
            else:
                done.set_result(results)

        barrier = threading.Barrier(n, action=finish)

        def one(slot: S) -> None:
            try:
                results[self._index[id(slot)]] = fn(slot)
            except BaseException as e:
                errors.append(e)
            barrier.wait()

        for _ in range(n):
            self.submit(one)
        return done

    def stop(self) -> None:
        """End every thread once the jobs queued before this have run."""
        for _ in self._threads:
            self._jobs.put(_STOP)

    def join(self, timeout: float | None = None) -> None:
        for t in self._threads:
            t.join(timeout)

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)


async def stream(pool: Pool[S], produce: Callable[[S, Callable[[], bool]], Iterator[Any]],
                 maxsize: int = 16) -> AsyncIterator[Any]:
    """Run `produce(slot, cancelled)` on a free slot of the pool and yield its items on the event loop.

    Exceptions raised by the producer are re-raised here. Leaving the `async for` early (client
    disconnect, server shutdown) sets the cancel flag; the producer stops at its next check.

    Every item stays its own item (one token piece, one chunk, as Ollama streams). The worker
    wakes the event loop only when the consumer waits on an empty buffer: on a small machine each
    wake-up is CPU taken from decoding, and a consumer that is still busy will look anyway."""
    loop = asyncio.get_running_loop()
    buf: deque[Any] = deque()
    room = threading.Semaphore(maxsize)
    cancel = threading.Event()
    handoff = _Handoff(loop, buf)

    def put(item: Any) -> None:
        # Wait only when `maxsize` items are unread (backpressure); otherwise hand the item over
        # without waiting for the event loop, so decoding never stalls on it.
        while not room.acquire(timeout=0.05):
            if cancel.is_set() or loop.is_closed():
                raise Cancelled
        buf.append(item)
        handoff.notify()

    def job(slot: S) -> None:
        if cancel.is_set():  # the consumer left while the job waited in the queue: not even a prefill
            return
        try:
            for item in produce(slot, cancel.is_set):
                put(item)
            put(_END)
        except Cancelled:
            pass
        except BaseException as e:
            if not cancel.is_set():
                with contextlib.suppress(Cancelled):
                    put(_Failure(e))

    done = pool.submit(job)
    try:
        while True:
            if not buf:
                await handoff.wait()
            item = buf.popleft()
            room.release()
            if item is _END:
                break
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        cancel.set()
        # Unblock a producer waiting for room so it notices the flag right away.
        room.release()
        del done


class _Handoff:
    """Wakes the event loop for a new item only while the consumer waits on an empty buffer.

    Under the GIL each step is atomic: the consumer publishes that it waits, then looks at the
    buffer again; the producer appends, then looks at the flag. Either the producer sees the flag
    and wakes the consumer, or its item was there before the consumer looked again."""

    def __init__(self, loop: asyncio.AbstractEventLoop, buf: deque[Any]) -> None:
        self.loop = loop
        self.buf = buf
        self.waiting = False
        self.future: asyncio.Future[None] | None = None

    async def wait(self) -> None:
        while not self.buf:
            self.future = self.loop.create_future()
            self.waiting = True
            if self.buf:
                self.waiting = False
                return
            await self.future

    def notify(self) -> None:
        """Called from the worker thread after appending."""
        if self.waiting:
            self.waiting = False
            try:
                self.loop.call_soon_threadsafe(self._wake, self.future)
            except RuntimeError:  # the loop closed under us
                raise Cancelled from None

    @staticmethod
    def _wake(future: asyncio.Future[None] | None) -> None:
        if future is not None and not future.done():
            future.set_result(None)


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error
