"""One OS thread per llama.cpp context, and the bounded bridge between it and asyncio.

llama.cpp contexts are not thread-safe, so every call that touches one runs on its worker thread,
one job at a time in arrival order (that is also the per-model request queue). A streaming job
hands its items to the event loop through a small asyncio.Queue: when the client reads slowly the
queue fills and the worker blocks, so generation never runs ahead of the client; when the client
goes away the job sees the cancel flag within one decode step and stops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
_STOP = object()
_END = object()


class Cancelled(Exception):
    """The consumer of a stream went away."""


class Worker:
    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"llama:{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # delivered to the awaiting request, never kills the thread
                fut.set_exception(e)

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    def stop(self) -> None:
        """Finish queued jobs, then end the thread."""
        self._jobs.put(_STOP)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


async def stream(worker: Worker, produce: Callable[[Callable[[], bool]], Iterator[Any]],
                 maxsize: int = 4) -> AsyncIterator[Any]:
    """Run `produce(cancelled)` on the worker and yield its items on the event loop.

    Exceptions raised by the producer are re-raised here. Leaving the `async for` early (client
    disconnect, server shutdown) sets the cancel flag; the producer stops at its next check."""
    loop = asyncio.get_running_loop()
    out: asyncio.Queue[Any] = asyncio.Queue()  # bounded by `room`, not by the queue itself
    room = threading.Semaphore(maxsize)
    cancel = threading.Event()

    def put(item: Any) -> None:
        # Wait only when `maxsize` items are unread (backpressure); otherwise hand the item over
        # without waiting for the event loop to wake, so decoding never stalls on it.
        while not room.acquire(timeout=0.05):
            if cancel.is_set() or loop.is_closed():
                raise Cancelled
        try:
            loop.call_soon_threadsafe(out.put_nowait, item)
        except RuntimeError:  # the loop closed under us
            raise Cancelled from None

    def job() -> None:
        try:
            for item in produce(cancel.is_set):
                put(item)
            put(_END)
        except Cancelled:
            pass
        except BaseException as e:
            if not cancel.is_set():
                with contextlib.suppress(Cancelled):
                    put(_Failure(e))

    done = worker.submit(job)
    try:
        while True:
            item = await out.get()
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


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error
