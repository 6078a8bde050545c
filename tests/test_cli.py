"""The command line: OLLAMA_HOST parsing and the address the daemon binds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sidecar.cli import parse_ollama_host
from tests.conftest import free_port, write_config

pytestmark = pytest.mark.model


@pytest.mark.parametrize(("value", "expected"), [
    (None, ("127.0.0.1", 11434)),
    ("", ("127.0.0.1", 11434)),
    ("1.2.3.4", ("1.2.3.4", 11434)),
    ("0.0.0.0:8080", ("0.0.0.0", 8080)),
    (":56789", ("", 56789)),  # all interfaces, as Ollama binds it
    ("http://example.com", ("example.com", 80)),
    ("https://example.com", ("example.com", 443)),
    ("http://127.0.0.1:11435/path", ("127.0.0.1", 11435)),
    ('  "127.0.0.1:9000"  ', ("127.0.0.1", 9000)),
    ("[::1]:11434", ("::1", 11434)),
    ("::1", ("::1", 11434)),
    ("127.0.0.1:99999", ("127.0.0.1", 11434)),  # out-of-range port → default
])
def test_ollama_host(value: str | None, expected: tuple[str, int]) -> None:
    assert parse_ollama_host(value) == expected


def test_serve_listens_on_ollama_host(tmp_path: Path, tiny: Path) -> None:
    cfg = write_config(tmp_path / "pairs.yaml", f"pairs:\n  t:1:\n    from: {tiny}\n")
    port = free_port()
    env = {**os.environ, "OLLAMA_HOST": f"127.0.0.1:{port}"}
    proc = subprocess.Popen([sys.executable, "-m", "sidecar.cli", "serve", "--config", str(cfg)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/api/tags").json()["models"][0]["name"] == "t:1"
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_bad_config_exits_with_file_and_line(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "pairs.yaml", "pairs:\n  t:1:\n    from: x.gguf\n    colour: blue\n")
    r = subprocess.run([sys.executable, "-m", "sidecar.cli", "serve", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert f"{cfg}:4: pairs.t:1.colour: unknown key" in r.stderr
