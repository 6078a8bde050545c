"""The agents' and apps' shape of work, through a real daemon (issue 55, point 4):

* a prompt longer than the window is cut the same way every time, with a head (the system prompt
  and tools) that stays put, so the same request again is all cached, and the next turn, or a
  parallel request with the same system prompt, reuses the head; /metrics counts it;
* interactive first: with every slot busy, a waiting streamed request starts before a waiting
  non-streamed one that came earlier (order of events, not timing);
* huge num_predict and prompts several windows long answer 200 on /api/chat and
  /v1/chat/completions, as Ollama answers them (truncate, shift, ten windows at most).

The tiny model that never ends its output, with a 256-token window (llama.cpp's smallest): a byte
vocabulary, so a character is a token.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.engine.window import prompt_limit
from sidecar.runtime.render import Rendered, stable_cut
from tests.conftest import Daemon, write_config

pytestmark = pytest.mark.daemon

T = 120
N_CTX = 256
LIMIT = prompt_limit(N_CTX, 5)  # Ollama's cut: num_keep 4, + 1 for the BOS: 131 tokens
TOOLS = "".join(f"tool_{i}(path): reads the file at path and returns its lines numbered. " for i in range(12))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_endless: Path) -> Iterator[Daemon]:
    d = tmp_path_factory.mktemp("agents")
    params = f"parameters: {{temperature: 0, num_ctx: {N_CTX}}}"
    cfg = write_config(d / "pairs.yaml", f"""
pairs:
  two:slots:
    from: {tiny_endless}
    {params}
    runtime: {{num_thread: 1}}
  one:slot:
    from: {tiny_endless}
    parameters: {{temperature: 0, num_ctx: 2048}}
    runtime: {{num_thread: 1, num_parallel: 1}}
""")
    daemon = Daemon(cfg, env={"OLLAMA_NUM_PARALLEL": "2"})
    yield daemon
    daemon.stop()


def chat(d: Daemon, messages: list[dict[str, Any]], n: int = 4, model: str = "two:slots") -> dict[str, Any]:
    r = httpx.post(d.url + "/api/chat", timeout=T, json={
        "model": model, "messages": messages, "stream": False, "options": {"num_predict": n}})
    assert r.status_code == 200, r.text
    return r.json()


def metric(d: Daemon, name: str) -> float:
    text = httpx.get(d.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


# -- the stable cut ------------------------------------------------------------------------------


GRAIN = 4  # the largest power of two <= 1/16 of a cut's newest tokens (66 of 131 with a long head)


def test_stable_cut_keeps_the_system_head_and_the_newest_tokens() -> None:
    tokens = list(range(1000))
    got = stable_cut(Rendered("", tokens), 300, N_CTX, 5, tokens)
    # The head is the system part up to half of Ollama's length; the newest tokens from the first
    # multiple of the grain at or after where Ollama's length would start them.
    def start(head: int) -> int:
        ollama = 1000 - (LIMIT - head)
        return ollama + -ollama % GRAIN

    assert got.tokens == tokens[:LIMIT // 2] + tokens[start(LIMIT // 2):] and got.dropped == 1000 - len(got.tokens)
    assert LIMIT - GRAIN < len(got.tokens) <= LIMIT
    # A short system part is kept whole; none at all is Ollama's cut (num_keep + BOS), on the grain.
    assert stable_cut(Rendered("", tokens), 20, N_CTX, 5, tokens).tokens[:21] == [*range(20), start(20)]
    assert stable_cut(Rendered("", tokens), 0, N_CTX, 5, tokens).tokens == tokens[:5] + tokens[start(5):]


def test_cuts_of_prompts_that_differ_at_their_end_keep_the_same_tokens_until_then() -> None:
    """Two users of one app, or an agent's sub-tasks: the same system prompt and tools, different
    last messages. Where Ollama's length starts their newest tokens a few tokens apart, the cuts
    start them on one grain, so the second finds all but its own end in the cache. (Here Ollama's
    length would start them at 945 and 948, and at 937 and 940; both pairs' cuts start at 948 and
    940. Ends whose lengths straddle a multiple of the grain share the head alone.)"""
    shared = list(range(1000))
    for mine, theirs in ((list(range(2000, 2011)), list(range(3000, 3014))),
                         (list(range(2000, 2003)), list(range(3000, 3006)))):
        a, b = shared + mine, shared + theirs
        cut_a = stable_cut(Rendered("", a), 300, N_CTX, 5, a).tokens
        cut_b = stable_cut(Rendered("", b), 300, N_CTX, 5, b).tokens
        assert cut_a[: len(cut_a) - len(mine)] == cut_b[: len(cut_b) - len(theirs)]
        assert cut_a[-len(mine):] == mine and cut_b[-len(theirs):] == theirs


def test_a_cut_prompt_is_cached_and_the_next_turn_reuses_its_head(daemon: Daemon) -> None:
    system = {"role": "system", "content": "You help with code. Tools: " + TOOLS}
    assert len(system["content"]) > 3 * N_CTX
    turn = [system, {"role": "user", "content": "What is in main.py?"}]
    cached = 'sidecar_prompt_cached_tokens_total{model="two:slots"}'
    before = metric(daemon, cached)
    first = chat(daemon, turn)
    # Cut to Ollama's length, or up to a grain shorter (stable_cut), all of it evaluated.
    assert LIMIT - GRAIN < first["prompt_eval_count"] <= LIMIT
    # The same request again: the same cut, in the prefix cache (the last token is always evaluated).
    again = chat(daemon, turn)
    assert again["prompt_eval_count"] == 1
    assert metric(daemon, cached) - before == first["prompt_eval_count"] - 1
    # Another user's first turn, a question of another length whose cut starts the newest tokens
    # on the same grain (stable_cut): it evaluates only where it differs, "x...x.py?" and the
    # template's 13 tokens after it (<|im_end|>, a newline, <|im_start|>, "assistant\n"). The cut
    # of `first` started its newest tokens `late` tokens after Ollama's length would have, so a
    # question up to `late` tokens longer starts them there too (or, at 0, one token shorter).
    late = LIMIT - first["prompt_eval_count"]
    name = "x" * (len("main") + (late or -1))
    other = chat(daemon, [system, {"role": "user", "content": f"What is in {name}.py?"}])
    assert other["prompt_eval_count"] <= len(f"{name}.py?") + 13 < LIMIT - LIMIT // 2
    # The next turn: the conversation grew, the head (half the cut: the system prompt's start) stays.
    follow = chat(daemon, [*turn, {"role": "assistant", "content": first["message"]["content"]},
                           {"role": "user", "content": "And in util.py?"}])
    assert follow["prompt_eval_count"] <= LIMIT - LIMIT // 2
    # A side request with the same system prompt (an agent's sub-task) reuses it too.
    side = chat(daemon, [system, {"role": "user", "content": "Summarise the session in five words."}])
    assert side["prompt_eval_count"] <= LIMIT - LIMIT // 2


# -- interactive first ---------------------------------------------------------------------------


def waiting(d: Daemon, cls: str) -> float:
    return metric(d, f'sidecar_batch_waiting{{class="{cls}",model="one:slot"}}')


def test_a_waiting_stream_starts_before_an_earlier_waiting_batch_request(daemon: Daemon) -> None:
    """One slot. A long non-streamed request runs; a non-streamed request, then a streamed one,
    wait; when the slot frees, the streamed one goes first. The long request's client leaves only
    once both wait (read from /metrics), so the order does not depend on how fast anything runs."""
    body = json.dumps({"model": "one:slot", "messages": [{"role": "user", "content": "write a novel"}],
                       "stream": False, "options": {"num_predict": 100000}}).encode()
    runner = socket.create_connection(("127.0.0.1", daemon.port))
    runner.sendall(b"POST /api/chat HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    got: dict[str, Any] = {}

    def batch() -> None:
        got["batch"] = chat(daemon, [{"role": "user", "content": "a title please"}], n=8, model="one:slot")

    def stream() -> None:
        with httpx.stream("POST", daemon.url + "/api/chat", timeout=T, json={
                "model": "one:slot", "messages": [{"role": "user", "content": "hello"}],
                "options": {"num_predict": 8}}) as r:
            got["stream"] = [json.loads(ln) for ln in r.iter_lines() if ln]

    threads = []
    try:
        until(lambda: metric(daemon, 'sidecar_batch_sequences{model="one:slot"}') == 1, "the long request runs")
        for fn, cls in ((batch, "background"), (stream, "interactive")):
            threads.append(threading.Thread(target=fn))
            threads[-1].start()
            until(lambda cls=cls: waiting(daemon, cls) == 1, f"the {cls} request waits")
    finally:
        runner.close()  # the client leaves: its generation stops at the next step, the slot frees
    for t in threads:
        t.join(T)
    title, streamed = got["batch"], got["stream"]
    assert title["done"] and streamed[-1]["done"]
    # One slot: whichever started first finished before the other started.
    assert stamp(streamed[-1]) <= stamp(title), "the batch request went first"


def until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + T
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def stamp(chunk: dict[str, Any]) -> float:
    return datetime.fromisoformat(chunk["created_at"].replace("Z", "+00:00")).timestamp()


# -- huge num_predict, prompts larger than the window ------------------------------------------------


@pytest.mark.parametrize("api", ["ollama", "openai"])
def test_huge_max_tokens_and_a_prompt_three_windows_long_answer_200(daemon: Daemon, api: str) -> None:
    long = "Here is the file again: " + "def f(x):\n    return x + 1\n" * 30
    assert len(long) > 3 * N_CTX
    for content, n in (("hi", 100_000), (long, 8), (long, 100_000)):
        messages = [{"role": "user", "content": content}]
        if api == "ollama":
            r = httpx.post(daemon.url + "/api/chat", timeout=T, json={
                "model": "two:slots", "messages": messages, "stream": False, "options": {"num_predict": n}})
            assert r.status_code == 200, r.text
            body = r.json()
            # Open-ended beyond ten windows: Ollama's boundedNumPredict; the window shifts on the way.
            assert body["eval_count"] == min(n, 10 * N_CTX) and body["prompt_eval_count"] < N_CTX
        else:
            r = httpx.post(daemon.url + "/v1/chat/completions", timeout=T, json={
                "model": "two:slots", "messages": messages, "max_tokens": n})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["completion_tokens"] == min(n, 10 * N_CTX) and usage["prompt_tokens"] < N_CTX
