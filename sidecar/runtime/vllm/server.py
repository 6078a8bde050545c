"""A vLLM server the daemon owns (a managed pair): started, watched, restarted, stopped.

The server runs in its own process group (vLLM forks engine-core workers), its output goes line by
line into the daemon's log, and it counts as up only once /health answers. A crash after start
is restarted with a doubling back-off, so a broken GPU does not spin the machine; while it is
down, requests get a 503 at once instead of waiting on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections import deque

import aiohttp

from sidecar.errors import BadGateway

log = logging.getLogger("sidecar.vllm")

BACKOFF_FIRST, BACKOFF_MAX = 1.0, 60.0
HEALTH_EVERY = 0.5  # seconds between /health polls while starting
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child (Linux): SIGTERM when the daemon dies, even by SIGKILL, so no server is orphaned."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerDied(BadGateway):
    """The server exited before it became healthy; the message carries its last log lines."""


class ManagedServer:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], url: str, start_timeout: float) -> None:
        self.name = name  # the pair it was started for, in every log line
        self.argv = argv
        self.env = env
        self.url = url
        self.start_timeout = start_timeout
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self.restarts = 0
        self.started_at: float | None = None
        self._stopping = False
        self._tail: deque[str] = deque(maxlen=20)  # the last lines, for the error when it dies starting
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the server and wait until it is healthy; then watch it for crashes."""
        await self._spawn_until_healthy()
        self._watcher = asyncio.create_task(self._watch(), context=contextvars.Context())

    async def _spawn_until_healthy(self) -> None:
        t0 = time.monotonic()
        log.info("%s: starting vLLM: %s", self.name, " ".join(self.argv))
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env={**os.environ, **self.env}, start_new_session=True,
            preexec_fn=_die_with_parent)
        # The server outlives the request that started it: its log lines carry no request's id.
        relay = asyncio.create_task(self._relay(self.proc), context=contextvars.Context())
        try:
            await self._healthy(self.proc, t0)
        except BaseException:
            await self._kill(self.proc)
            relay.cancel()
            raise
        self.started_at = time.time()
        self.ready.set()
        log.info("%s: vLLM is up at %s after %.1f s", self.name, self.url, time.monotonic() - t0)

    async def _relay(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line:
                self._tail.append(line)
                log.info("%s: vllm[%d] %s", self.name, proc.pid, line)

    async def _healthy(self, proc: asyncio.subprocess.Process, t0: float) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while True:
                if proc.returncode is not None:
                    raise ServerDied(f"the vLLM server for {self.name} exited with {proc.returncode} while starting: "
                                     + " | ".join(list(self._tail)[-5:]))
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    async with http.get(f"{self.url}/health") as r:
                        if r.status == 200:
                            return
                if time.monotonic() - t0 > self.start_timeout:
                    raise ServerDied(f"the vLLM server for {self.name} was not healthy after "
                                     f"{self.start_timeout:.0f} s")
                await asyncio.sleep(HEALTH_EVERY)

    async def _watch(self) -> None:
        """Restart the server whenever it exits on its own, waiting longer after each failure."""
        backoff = BACKOFF_FIRST
        while not self._stopping:
            assert self.proc is not None
            code = await self.proc.wait()
            if self._stopping:
                return
            with contextlib.suppress(ProcessLookupError, PermissionError):  # its orphaned workers hold memory
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.ready.clear()
            log.error("%s: the vLLM server exited with %s; restarting in %.0f s", self.name, code, backoff)
            await asyncio.sleep(backoff)
            if self._stopping:
                return
            try:
                await self._spawn_until_healthy()
                self.restarts += 1
                backoff = BACKOFF_FIRST
            except ServerDied as e:
                log.error("%s: %s", self.name, e)
                backoff = min(backoff * 2, BACKOFF_MAX)

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop for good: SIGTERM to the server's process group (vLLM drains), SIGKILL after `timeout`."""
        self._stopping = True
        self.ready.clear()
        if self._watcher is not None:
            self._watcher.cancel()
        if self.proc is not None:
            await self._kill(self.proc, timeout)

    @staticmethod
    async def _kill(proc: asyncio.subprocess.Process, timeout: float = 10.0) -> None:
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
