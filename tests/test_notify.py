"""sd_notify: the protocol helpers, and the real daemon talking to a socket that plays systemd."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sidecar.observability import notify
from tests.conftest import free_port, write_config

pytestmark = pytest.mark.daemon


class FakeSystemd:
    """A bound AF_UNIX datagram socket, as systemd's notify socket; `path` is what NOTIFY_SOCKET holds."""

    def __init__(self, abstract: bool = False) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"sidecar-test-{uuid.uuid4().hex}"
            self.sock.bind("\0" + name)
            self.path = "@" + name
        else:
            self._dir = tempfile.mkdtemp(prefix="sdn")  # short: AF_UNIX paths stop at 107 bytes
            self.path = os.path.join(self._dir, "notify")
            self.sock.bind(self.path)
        self.messages: list[str] = []

    def receive(self, timeout: float) -> str | None:
        self.sock.settimeout(timeout)
        try:
            msg = self.sock.recv(4096).decode()
        except TimeoutError:
            return None
        self.messages.append(msg)
        return msg

    def wait_for(self, line: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self.receive(left)
            if msg is not None and line in msg.split("\n"):
                return msg
        raise AssertionError(f"no {line!r} within {timeout}s; got {self.messages}")

    def lines(self) -> list[str]:
        return [ln for m in self.messages for ln in m.split("\n")]

    def close(self) -> None:
        self.sock.close()
        if not self.path.startswith("@"):
            os.unlink(self.path)
            os.rmdir(self._dir)


@pytest.fixture
def systemd() -> Iterator[FakeSystemd]:
    s = FakeSystemd()
    yield s
    s.close()


@pytest.fixture
def abstract_systemd() -> Iterator[FakeSystemd]:
    s = FakeSystemd(abstract=True)
    yield s
    s.close()


# -- the helpers, in process --------------------------------------------------------------------
def test_notify_sends_one_datagram(systemd: FakeSystemd) -> None:
    assert notify.notify("READY=1\nSTATUS=ok", {"NOTIFY_SOCKET": systemd.path})
    assert systemd.receive(1) == "READY=1\nSTATUS=ok"


def test_notify_abstract_socket(abstract_systemd: FakeSystemd) -> None:
    assert notify.notify("STATUS=hi", {"NOTIFY_SOCKET": abstract_systemd.path})
    assert abstract_systemd.receive(1) == "STATUS=hi"


def test_notify_outside_systemd_is_a_no_op(tmp_path: Path) -> None:
    assert not notify.notify("READY=1", {})
    assert not notify.notify("READY=1", {"NOTIFY_SOCKET": "relative/path"})
    assert not notify.notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "gone")})  # never raises
    assert not notify.ServiceNotifier({}).ready("x")


def test_watchdog_interval() -> None:
    pid = str(os.getpid())
    assert notify.watchdog_interval({}) is None
    assert notify.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert notify.watchdog_interval({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": pid}) == 0.5
    assert notify.watchdog_interval({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": "1"}) is None
    assert notify.watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert notify.watchdog_interval({"WATCHDOG_USEC": "soon"}) is None


def test_service_notifier_messages(systemd: FakeSystemd) -> None:
    n = notify.ServiceNotifier({"NOTIFY_SOCKET": systemd.path})
    assert n.enabled
    n.ready("serving 2 pairs\non 127.0.0.1:11434")
    n.status("1 loaded")
    n.reloading()
    n.stopping()
    got = [systemd.receive(1) for _ in range(4)]
    assert got[0] == "READY=1\nSTATUS=serving 2 pairs on 127.0.0.1:11434"  # one line: no injected keys
    assert got[1] == "STATUS=1 loaded"
    assert got[2] is not None and got[2].startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert got[3] == "STOPPING=1\nSTATUS=shutting down"


async def test_watchdog_task_pings_at_half_the_interval(systemd: FakeSystemd) -> None:
    n = notify.ServiceNotifier({"NOTIFY_SOCKET": systemd.path, "WATCHDOG_USEC": "100000"})
    task = n.start_watchdog()
    assert task is not None and n.start_watchdog() is task
    await asyncio.sleep(0.32)  # pings at 0, 50, 100, ... ms
    await n.stop_watchdog()
    assert task.done()
    pings = 0
    while systemd.receive(0.05) is not None:
        pings += 1
    assert 4 <= pings <= 8
    assert set(systemd.messages) == {"WATCHDOG=1"}


async def test_no_watchdog_without_watchdog_usec(systemd: FakeSystemd) -> None:
    assert notify.ServiceNotifier({"NOTIFY_SOCKET": systemd.path}).start_watchdog() is None


# -- the daemon ------------------------------------------------------------------------------------
def start_daemon(config: Path, port: int, env: dict[str, str], *, exec_wrapper: bool = False) -> subprocess.Popen:
    full = {**os.environ, **env}
    for k in ("OLLAMA_HOST", "WATCHDOG_PID"):
        full.pop(k, None)
    cmd = [sys.executable, "-m", "sidecar.cli", "serve", "--config", str(config), "--port", str(port)]
    if exec_wrapper:  # what systemd does: WATCHDOG_PID names the process that is then exec'd
        cmd = ["/bin/sh", "-c", 'WATCHDOG_PID=$$ exec "$0" "$@"', *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full, cwd=config.parent)


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    if proc.stdout is None or proc.stdout.closed:  # stopped before
        return proc.wait(), ""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out.decode(errors="replace")


@pytest.fixture
def config(tmp_path: Path, tiny: Path) -> Path:
    return write_config(tmp_path / "pairs.yaml", f"""
pairs:
  tiny:test:
    from: {tiny}
    parameters:
      num_ctx: 256
""")


def wait_ready(proc: subprocess.Popen, port: int, systemd: FakeSystemd, timeout: float = 60) -> None:
    """Wait for READY=1; fail fast if the daemon dies, or answers HTTP but never says READY=1."""
    deadline = time.monotonic() + timeout
    answered: float | None = None
    while time.monotonic() < deadline:
        msg = systemd.receive(0.2)
        if msg is not None and "READY=1" in msg.split("\n"):
            return
        if proc.poll() is not None:
            _, out = stop(proc)
            raise AssertionError(f"daemon exited with {proc.returncode} before READY=1:\n{out}")
        if answered is None:
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=0.5)
                answered = time.monotonic()
            except httpx.HTTPError:
                pass
        elif time.monotonic() - answered > 5:
            _, out = stop(proc)
            raise AssertionError("the daemon serves HTTP but sent no READY=1 (is ServiceNotifier wired into "
                                 f"cli.py cmd_serve?); messages {systemd.messages}\n{out[-2000:]}")
    _, out = stop(proc)
    raise AssertionError(f"no READY=1 within {timeout}s; messages {systemd.messages}\n{out[-2000:]}")


def test_daemon_ready_status_watchdog_stopping(config: Path, systemd: FakeSystemd) -> None:
    port = free_port()
    proc = start_daemon(config, port, {"NOTIFY_SOCKET": systemd.path, "WATCHDOG_USEC": "400000"})
    try:
        wait_ready(proc, port, systemd)
        # READY=1 means the listener is bound: the very next request must be answered.
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200
        assert any(ln.startswith("STATUS=") for ln in systemd.lines()), systemd.messages
        deadline = time.monotonic() + 5
        while systemd.lines().count("WATCHDOG=1") < 2 and time.monotonic() < deadline:
            systemd.receive(0.5)
        assert systemd.lines().count("WATCHDOG=1") >= 2, systemd.messages
        # systemctl reload = SIGHUP: the daemon reloads pairs.yaml and reports the outcome in STATUS=.
        before = len(systemd.messages)
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
                m.startswith("STATUS=") for m in systemd.messages[before:]):
            systemd.receive(0.5)
        assert any(m.startswith("STATUS=serving") for m in systemd.messages[before:]), systemd.messages
        assert proc.poll() is None
    finally:
        code, out = stop(proc)
    while systemd.receive(0.2) is not None:
        pass
    assert code == 0, out
    assert "STOPPING=1" in systemd.lines(), systemd.messages
    assert systemd.lines().index("STOPPING=1") > systemd.lines().index("READY=1")


def test_daemon_abstract_socket_and_watchdog_pid(config: Path, abstract_systemd: FakeSystemd) -> None:
    port = free_port()
    proc = start_daemon(config, port, {"NOTIFY_SOCKET": abstract_systemd.path, "WATCHDOG_USEC": "400000"},
                        exec_wrapper=True)
    try:
        wait_ready(proc, port, abstract_systemd)
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200
        abstract_systemd.wait_for("WATCHDOG=1", timeout=5)  # WATCHDOG_PID is the daemon's own pid
    finally:
        code, out = stop(proc)
    while abstract_systemd.receive(0.2) is not None:
        pass
    assert code == 0, out
    assert "STOPPING=1" in abstract_systemd.lines()
