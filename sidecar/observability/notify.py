"""systemd's sd_notify protocol without a dependency: readiness, status, watchdog, stopping.

Under `Type=notify` systemd waits for `READY=1` before it calls the unit started, so
`systemctl start` and units ordered `After=spec-sidecar.service` only proceed once the config is
loaded and the port answers. The protocol is one AF_UNIX datagram of `KEY=value` lines to the
socket named in `$NOTIFY_SOCKET` (a leading `@` means the Linux abstract namespace); see
sd_notify(3). Outside systemd the variable is unset and every call is a cheap no-op, so the daemon
calls these unconditionally.

The watchdog ping is sent from an asyncio task on purpose: if the event loop stalls (a blocking
call, a deadlock), the pings stop and systemd restarts the daemon. A thread would keep pinging
while the loop that serves requests is dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger("sidecar.notify")


def _address(env: Mapping[str, str]) -> str | None:
    path = env.get("NOTIFY_SOCKET", "")
    if not path:
        return None
    if path.startswith("@"):
        return "\0" + path[1:]  # abstract namespace
    if path.startswith("/"):
        return path
    return None  # vsock: and other transports (systemd >= 253) are not needed on a host install


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send `state` (newline-separated KEY=value lines) to systemd; True if it was sent.

    Failures are logged at debug level and swallowed: a daemon must never die because its
    supervisor's socket went away."""
    addr = _address(os.environ if env is None else env)
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode("utf-8"))
        return True
    except OSError as e:
        log.debug("sd_notify %r failed: %s", state, e)
        return False


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """The watchdog timeout in seconds (from `WatchdogSec=`), or None when not asked to ping.

    `WATCHDOG_PID`, when set, names the process systemd expects pings from; if it is another
    process (say, a wrapper that exec'd us under a different pid), the pings are not ours."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID", "").strip()
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 1_000_000


async def watchdog_loop(interval: float, env: Mapping[str, str] | None = None) -> None:
    """Ping `WATCHDOG=1` every half interval (what sd_watchdog_enabled(3) recommends) forever."""
    period = max(interval / 2, 0.01)
    while True:
        notify("WATCHDOG=1", env)
        await asyncio.sleep(period)


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())  # a newline would start a new KEY=value assignment
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ServiceNotifier:
    """What `sidecar serve` tells systemd over its lifetime; every method is a no-op outside systemd.

    Usage in the daemon (after the listener is bound):

        notifier = ServiceNotifier()
        notifier.ready(f"serving {n} pair(s) on {host}:{port}")
        notifier.start_watchdog()
        ...
        notifier.stopping()
        await notifier.stop_watchdog()
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env: Mapping[str, str] = dict(os.environ if env is None else env)
        self._watchdog: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return _address(self.env) is not None

    def send(self, *lines: str) -> bool:
        return notify("\n".join(lines), self.env)

    def ready(self, status: str | None = None) -> bool:
        """Config loaded and listener bound: systemd may now start dependent units."""
        lines = ["READY=1"]
        if status:
            lines.append(f"STATUS={_one_line(status)}")
        return self.send(*lines)

    def status(self, text: str) -> bool:
        """A one-line summary `systemctl status` shows ("2 pairs, 1 loaded")."""
        return self.send(f"STATUS={_one_line(text)}")

    def reloading(self, status: str | None = "reloading configuration") -> bool:
        """Start of a reload (SIGHUP); follow with `ready()` whether or not the reload worked.

        MONOTONIC_USEC lets `Type=notify-reload` units (systemd >= 253) match the reply."""
        lines = ["RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"]
        if status:
            lines.append(f"STATUS={_one_line(status)}")
        return self.send(*lines)

    def stopping(self, status: str | None = "shutting down") -> bool:
        """Shutdown has begun: systemd stops routing start jobs to us and waits for exit."""
        lines = ["STOPPING=1"]
        if status:
            lines.append(f"STATUS={_one_line(status)}")
        return self.send(*lines)

    def start_watchdog(self, loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Task[None] | None:
        """Start pinging if systemd asked for it (WatchdogSec=); returns the task or None."""
        interval = watchdog_interval(self.env)
        if interval is None or not self.enabled or self._watchdog is not None:
            return self._watchdog
        loop = loop or asyncio.get_running_loop()
        self._watchdog = loop.create_task(watchdog_loop(interval, self.env), name="sd-watchdog")
        log.info("systemd watchdog: pinging every %.1fs", interval / 2)
        return self._watchdog

    async def stop_watchdog(self) -> None:
        task, self._watchdog = self._watchdog, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
