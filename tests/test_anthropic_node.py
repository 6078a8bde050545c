"""A /v1/messages stream through Anthropic's official Node SDK (tests/node, `make install-test`
installs it with `npm ci`): the text it assembles is /api/chat's for the same conversation."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import SMOLLM2_REF, Daemon, write_config

NODE = Path(__file__).resolve().parent / "node"
PAIR = "smollm2:135m"
T = 180
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]

pytestmark = [pytest.mark.daemon, pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = tmp_path_factory.mktemp("anthropic-node")
    cfg = write_config(d / "pairs.yaml", f"""
pairs:
  {PAIR}:
    from: {SMOLLM2_REF}
    draft: ngram
    parameters: {{temperature: 0, num_ctx: 2048}}
    runtime: {{num_gpu: 0}}
""")
    daemon = Daemon(cfg)
    yield daemon
    daemon.stop()


def test_stream_through_the_node_sdk(daemon: Daemon) -> None:
    assert (NODE / "node_modules" / "@anthropic-ai" / "sdk").is_dir(), "run `make install-test` (npm ci)"
    env = {**os.environ, "SIDECAR_URL": daemon.url, "SIDECAR_MODEL": PAIR, "SIDECAR_MAX_TOKENS": "16",
           "SIDECAR_MESSAGES": json.dumps(MESSAGES)}
    run = subprocess.run(["node", str(NODE / "anthropic_stream.mjs")], env=env, capture_output=True, text=True,
                         timeout=T, check=False)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    ref = httpx.post(daemon.url + "/api/chat", timeout=T, json={
        "model": PAIR, "messages": MESSAGES, "stream": False, "options": {"num_predict": 16}}).json()
    assert got["text"] == ref["message"]["content"] == got["message"]["content"][0]["text"]
    assert got["types"][0] == "message_start" and got["types"][-1] == "message_stop"
    assert got["message"]["usage"]["output_tokens"] == ref["eval_count"]
    assert got["message"]["stop_reason"] in ("end_turn", "max_tokens")
