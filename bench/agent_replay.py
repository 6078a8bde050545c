"""A coding agent's session replayed through /v1/messages: n-gram + suffix drafting against plain decoding.

An agent re-sends its whole conversation every turn: a long system prompt with its tool list, the
files it read (as tool_result blocks), its own earlier answers. Then it asks for a file back with a
small change, which the n-gram and suffix drafts copy from the history. This replays such a session
of 8 turns against the demo pair (SmolLM2-135M, greedy) served three ways, side by side:

- `ngram`: `draft: ngram` (the suffix cache on, its default);
- `plain`: `draft: none`;
- `cold`: `draft: none`, each request's system prompt prefixed with a fresh nonce, so nothing of
  it is in the prefix cache: the time to first token of a cold prefill of the same history.

Each turn goes to `ngram` and `plain` in alternating order, then to `cold` (max_tokens 1). The
conversation carries each turn's answer on (from `ngram`; greedy decoding is lossless, so the two
answers must be equal, and the script says where they are not). Per turn: decode tok/s (output
tokens after the first, over the time from the first text to the last), the ratio ngram/plain, and
each side's time to first token against the cold one. Every repetition starts fresh daemons, so
no repetition's suffix cache learns from another's.

The edit turns prefill their answer (`--prefill`, on by default; `--no-prefill` to ask plainly):
the request ends with an assistant message holding the answer's opening, "Here is the whole
file:", a ```python fence and the file's first line, and the model continues it (a final
assistant message is continued, as Ollama and Anthropic's API do; docs/agents.md). A capable
agent model writes the file back unforced, and that copy is the n-gram and suffix drafts' best
case; SmolLM2-135M, asked plainly, answers in some 50 tokens and never writes the file, so without
the prefill the edit turns would not exercise the copying they are here to measure. The
conversation carries on with the prefill and the answer as the assistant's message.
`--prefill-lines` opens with more of the file's lines when the model strays from the copy. The
JSON keeps each turn's answer (prefill included), so a run shows what the edit turns wrote.

    PYTHONPATH=. .venv/bin/python bench/agent_replay.py [--reps 2] [--out bench/out/agent_replay.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import SMOLLM2_REF, Daemon  # noqa: E402

PAIR = "smollm2:135m"
T = 900

# The file the agent reads: about 80 lines of ordinary Python.
SOURCE = '''"""Small helpers for reading and summarising tab-separated tables."""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Table:
    """A table read from disk: its column names and its rows."""

    name: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def column(self, key: str) -> list[str]:
        index = self.columns.index(key)
        return [row[index] for row in self.rows]

    def numbers(self, key: str) -> list[float]:
        out = []
        for value in self.column(key):
            try:
                out.append(float(value))
            except ValueError:
                continue
        return out


def parse_line(line: str, sep: str = "\\t") -> list[str]:
    """One line of the file as its fields, stripped of surrounding spaces."""
    return [part.strip() for part in line.rstrip("\\n").split(sep)]


def load_table(path: Path, sep: str = "\\t") -> Table:
    with path.open(encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    if not lines:
        raise ValueError(f"{path} is empty")
    columns = parse_line(lines[0], sep)
    rows = [parse_line(line, sep) for line in lines[1:]]
    for number, row in enumerate(rows, start=2):
        if len(row) != len(columns):
            raise ValueError(f"{path}:{number}: expected {len(columns)} fields, got {len(row)}")
    return Table(path.stem, columns, rows)


def merge(left: Table, right: Table, key: str) -> Table:
    index = {row[right.columns.index(key)]: row for row in right.rows}
    columns = left.columns + [c for c in right.columns if c != key]
    rows = []
    for row in left.rows:
        match = index.get(row[left.columns.index(key)])
        if match is None:
            continue
        rest = [v for c, v in zip(right.columns, match) if c != key]
        rows.append(row + rest)
    return Table(f"{left.name}+{right.name}", columns, rows)


def summarize(table: Table, key: str):
    values = table.numbers(key)
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def write_csv(table: Table, path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(table.columns)
        writer.writerows(table.rows)
'''

TEST_OUTPUT = """============================= test session starts ==============================
collected 6 items

tests/test_utils.py ..F...                                               [100%]

=================================== FAILURES ===================================
_____________________________ test_merge_keeps_key _____________________________

    def test_merge_keeps_key():
        left = Table("a", ["id", "x"], [["1", "2"]])
        right = Table("b", ["id", "y"], [["1", "3"]])
>       assert merge(left, right, "id").columns == ["id", "x", "y"]
E       AssertionError: assert ['id', 'x', 'y', 'id'] == ['id', 'x', 'y']

tests/test_utils.py:21: AssertionError
=========================== short test summary info ============================
FAILED tests/test_utils.py::test_merge_keeps_key - AssertionError
========================= 1 failed, 5 passed in 0.04s =========================="""


def _tool(name: str, description: str, props: dict[str, str], required: list[str]) -> dict[str, Any]:
    return {"name": name, "description": description, "input_schema": {
        "type": "object", "required": required,
        "properties": {k: {"type": "string", "description": v} for k, v in props.items()}}}


# An agent's tool list: about 2k tokens of descriptions and schemas, as coding agents send them.
TOOLS = [
    _tool("read_file", "Read a file from the local filesystem and return its contents with line numbers. Use this "
          "before editing a file, so that edits are based on its current contents. Paths are relative to the "
          "project root. Large files are returned in pages; ask for an offset to read further. Binary files are "
          "refused with a short description of their type.",
          {"path": "The path of the file to read, relative to the project root.",
           "offset": "The line to start reading from, 1-based; omit to read from the start.",
           "limit": "How many lines to read at most; omit for the whole file or the first page."}, ["path"]),
    _tool("write_file", "Write a file to the local filesystem, replacing it if it exists. Always read a file "
          "before overwriting it. Prefer edit_file for small changes to existing files, since it sends less and "
          "is less likely to lose content. Never write secrets or credentials into files.",
          {"path": "The path of the file to write, relative to the project root.",
           "content": "The complete new contents of the file."}, ["path", "content"]),
    _tool("edit_file", "Replace an exact string in a file with another string. The old string must occur "
          "exactly once in the file unless replace_all is set, and must match the file byte for byte, "
          "including indentation and line endings. Read the file first to get its exact contents.",
          {"path": "The path of the file to edit.", "old_string": "The exact text to replace.",
           "new_string": "The text to put in its place.",
           "replace_all": "Set to true to replace every occurrence instead of exactly one."},
          ["path", "old_string", "new_string"]),
    _tool("list_directory", "List the files and directories at a path, with their sizes and types. Hidden "
          "files are listed too. Use glob for finding files by pattern across the whole project instead.",
          {"path": "The directory to list, relative to the project root; omit for the root."}, []),
    _tool("glob", "Find files whose paths match a glob pattern such as src/**/*.py, sorted by modification "
          "time, newest first. Use this to locate files by name; use grep to search their contents.",
          {"pattern": "The glob pattern to match.", "path": "The directory to search in; omit for the root."},
          ["pattern"]),
    _tool("grep", "Search file contents with a regular expression and return the matching lines with their "
          "file names and line numbers. Supports full regular expression syntax. Filter files with include, a "
          "glob pattern. Results are limited to the first few hundred matches.",
          {"pattern": "The regular expression to search for.", "path": "The directory or file to search.",
           "include": "A glob pattern that the searched files must match, such as *.py.",
           "case_insensitive": "Set to true to ignore case."}, ["pattern"]),
    _tool("run_command", "Run a shell command in the project directory and return its standard output, "
          "standard error and exit status. Commands time out after two minutes. Do not run commands that wait "
          "for input, start servers that never exit, or change files outside the project. Quote paths that "
          "contain spaces. Prefer the dedicated tools for reading, searching and editing files.",
          {"command": "The command line to run.", "description": "What the command does, in a few words.",
           "timeout": "The timeout in seconds, at most 600."}, ["command"]),
    _tool("run_tests", "Run the project's test suite, or the tests matching a pattern, and return the report. "
          "Use this after every change to check that nothing broke. The report lists each failing test with "
          "its traceback and the assertion that failed.",
          {"pattern": "Run only the tests whose names match this pattern.",
           "verbose": "Set to true for one line per test."}, []),
    _tool("web_fetch", "Fetch a web page and return its main text converted to Markdown. Use this for "
          "documentation and references the user names. Pages behind logins are not available. Long pages are "
          "truncated to their first part.",
          {"url": "The address of the page to fetch.", "prompt": "What to look for in the page."}, ["url"]),
    _tool("todo_write", "Create or update the task list for the current session. Use it for work with several "
          "steps, so that the user sees progress: mark a task in progress before starting it and completed as "
          "soon as it is done. Keep exactly one task in progress at a time.",
          {"todos": "The whole list as JSON: items with content, status (pending, in_progress, completed) "
                    "and a short id."}, ["todos"]),
    _tool("ask_user", "Ask the user a question and wait for the answer. Use this only when a decision cannot "
          "be made from the code, the conversation or the documentation, for example a choice between two "
          "designs that both work. Offer the options you see.",
          {"question": "The question to ask.", "options": "The options to offer, one per line."}, ["question"]),
    _tool("notebook_edit", "Replace, insert or delete a cell in a Jupyter notebook. Cells are addressed by "
          "their id; read the notebook first to learn the ids. The new source replaces the whole cell.",
          {"path": "The notebook's path.", "cell_id": "The id of the cell to change.",
           "new_source": "The cell's new source.", "edit_mode": "replace, insert or delete."},
          ["path", "cell_id"]),
]

SYSTEM = ("You are a coding agent working in the user's project. You read files before changing them, make "
          "the smallest change that does what was asked, and keep the code's style. When asked for a file, "
          "write it out in full in one fenced code block, with nothing left out. Answer briefly otherwise.")

# (kind, the user's turn, max_tokens). "read" and "tests" turns come after a scripted tool call whose
# result the user turn carries; "edit" turns ask for the whole file back with one change.
TURNS: list[tuple[str, str, int]] = [
    ("read", "Summarise what utils.py does in three sentences.", 160),
    ("edit", "Give me the whole of utils.py back with parse_line renamed to parse_record everywhere.", 900),
    ("follow", "What does merge return when no row matches?", 120),
    ("edit", "Now the whole file again, with a return type annotation on summarize.", 900),
    ("tests", "The tests fail. Explain the failure in two sentences.", 160),
    ("edit", "Fix merge so the key column appears once, and show the whole file.", 900),
    ("follow", "Write a unit test for parse_record.", 300),
    ("edit", "Show the final version of the whole file once more.", 900),
]


def prefill(lines: int) -> str:
    """The opening of an edit turn's answer: what a capable model writes before the file itself."""
    return "Here is the whole file:\n\n```python\n" + "\n".join(SOURCE.splitlines()[:lines])


def tool_call(call_id: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": name, "input": args}]}


def tool_result(call_id: str, text: str, ask: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": text},
                                        {"type": "text", "text": ask}]}


def config(draft: str, num_ctx: int) -> str:
    """The demo pair as sidecar/pairs.yaml declares it (its template takes tools), greedy."""
    template = yaml.safe_load((REPO / "sidecar" / "pairs.yaml").read_text())["pairs"][PAIR]["template"]
    return f"""
pairs:
  {PAIR}:
    from: {SMOLLM2_REF}
    draft: {draft}
    template: {json.dumps(template)}
    parameters: {{temperature: 0, num_ctx: {num_ctx}}}
    runtime: {{num_gpu: 0}}
"""


def stream(url: str, messages: list[dict[str, Any]], max_tokens: int, system: str) -> dict[str, Any]:
    """One streamed /v1/messages request: its text, TTFT, decode rate and usage."""
    body = {"model": PAIR, "max_tokens": max_tokens, "stream": True, "system": system, "tools": TOOLS,
            "messages": messages}
    t0 = time.perf_counter()
    first = last = None
    text: list[str] = []
    usage: dict[str, int] = {}
    pieces = 0
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=T) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: {r.status_code} {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev["type"] == "content_block_delta":
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                pieces += 1
                text.append(ev["delta"].get("text", ""))
            elif ev["type"] == "message_delta":
                usage = ev["usage"]
    ttft = (first if first is not None else time.perf_counter()) - t0
    out = usage.get("output_tokens", 0)
    span = (last - first) if first is not None and last is not None else 0.0
    return {"text": "".join(text), "ttft": ttft, "tokens": out, "tok_s": (out - 1) / span if span > 0 else 0.0,
            "input": usage.get("input_tokens", 0), "cached": usage.get("cache_read_input_tokens", 0)}


def last_request(daemon: Daemon) -> dict[str, Any]:
    """The daemon's summary line of its latest generation (api/respond.py log_request): what it
    drafted, from which source, how much was accepted, and why it fell back, if it did."""
    for line in reversed(daemon.log().splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == "request" and "draft_sources" in rec:
            return {k: rec.get(k) for k in ("draft_rounds", "draft_sources", "fallback", "withdrawn")}
    return {}


def replay(daemons: dict[str, Daemon], rep: int, turns: int, cold_turns: int,
           prefill_lines: int) -> list[dict[str, Any]]:
    urls = {side: d.url for side, d in daemons.items()}
    history: list[dict[str, Any]] = [{"role": "user", "content": "Open utils.py, I want to work on it."},
                                     tool_call("toolu_read", "read_file", {"path": "utils.py"})]
    rows = []
    for i, (kind, ask, max_tokens) in enumerate(TURNS[:turns]):
        if i == 0:
            history.append(tool_result("toolu_read", SOURCE, ask))
        elif kind == "tests":
            history += [tool_call("toolu_tests", "run_tests", {}), tool_result("toolu_tests", TEST_OUTPUT, ask)]
        else:
            history.append({"role": "user", "content": ask})
        opening = prefill(prefill_lines) if kind == "edit" and prefill_lines > 0 else ""
        asked = [*history, {"role": "assistant", "content": opening}] if opening else history
        order = ["ngram", "plain"] if (i + rep) % 2 == 0 else ["plain", "ngram"]
        got = {side: stream(urls[side], asked, max_tokens, SYSTEM) for side in order}
        for side in order:
            g = got[side]
            print(f"  {side}: {g['tokens']} tokens, {g['tok_s']:.1f} tok/s, TTFT {g['ttft']:.2f}s, "
                  f"prompt evaluated {g['input']} + cached {g['cached']}", flush=True)
        cold = stream(urls["cold"], asked, 1, f"[{uuid.uuid4().hex}] {SYSTEM}") if i < cold_turns else \
            {"ttft": float("nan"), "input": got["plain"]["input"] + got["plain"]["cached"], "cached": 0}
        same = got["ngram"]["text"] == got["plain"]["text"]
        # What the speculative daemon's cost model believes after the turn (a row's price decides
        # how long it drafts): docs/design/scheduler.md.
        beliefs = [m.get("cost") for m in httpx.get(urls["ngram"] + "/sidecar/status", timeout=T).json()["models"]]
        measured = {f"{s}_{k}": v for s in order for k, v in got[s].items() if k != "text"}
        drafts = last_request(daemons["ngram"])
        rows.append({"turn": i + 1, "kind": kind, "prefilled": bool(opening), "same_text": same,
                     "cold_ttft": cold["ttft"], "prompt": cold["input"] + cold["cached"], **measured,
                     "answer": opening + got["ngram"]["text"], "cost": beliefs, "drafts": drafts})
        print(f"rep {rep} turn {i + 1} {kind:6} prompt {rows[-1]['prompt']:5} | ngram {got['ngram']['tok_s']:6.1f} "
              f"tok/s ttft {got['ngram']['ttft']:6.2f}s | plain {got['plain']['tok_s']:6.1f} tok/s ttft "
              f"{got['plain']['ttft']:6.2f}s | cold ttft {cold['ttft']:6.2f}s | out {got['ngram']['tokens']}"
              f"{'' if same else ' (texts differ)'} | drafts {drafts}", flush=True)
        history.append({"role": "assistant", "content": opening + got["ngram"]["text"] or "(no answer)"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--num-ctx", type=int, default=8192)
    ap.add_argument("--turns", type=int, default=len(TURNS), help="replay only the first N turns")
    ap.add_argument("--cold-turns", type=int, default=len(TURNS),
                    help="measure the cold prefill on the first N turns only (each costs a whole prefill)")
    ap.add_argument("--prefill", action=argparse.BooleanOptionalAction, default=True,
                    help="edit turns end with the opening of their answer, which the model continues (docstring)")
    ap.add_argument("--prefill-lines", type=int, default=1, help="how many of the file's lines the prefill holds")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "agent_replay.json")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            daemons = {}
            try:
                for side, draft in (("ngram", "ngram"), ("plain", "none"), ("cold", "none")):
                    cfg = Path(tmp) / side / "pairs.yaml"
                    cfg.parent.mkdir()
                    cfg.write_text(config(draft, args.num_ctx))
                    # A cold prefill of a later turn's history takes minutes on a CPU, past Ollama's
                    # default keep_alive of 5 minutes: an unload would make the next turn cold too.
                    daemons[side] = Daemon(cfg, env={"OLLAMA_KEEP_ALIVE": "-1"})
                # Each daemon loads its model (and measures its cost curve, the first time on this
                # machine) on a short request of its own, so no side's first turn pays for that or
                # runs beside another daemon doing it (a first turn ran at 0.53x without this).
                for d in daemons.values():
                    stream(d.url, [{"role": "user", "content": "Hello."}], 2, f"[{uuid.uuid4().hex}] Warm up.")
                rows += [{"rep": rep, **r} for r in replay(daemons, rep, args.turns, args.cold_turns,
                                                           args.prefill_lines if args.prefill else 0)]
            finally:
                for d in daemons.values():
                    d.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print("\n| turn | kind | prompt tokens | plain tok/s | ngram tok/s | ratio | plain TTFT s | ngram TTFT s | "
          "cold TTFT s | ngram TTFT / cold |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for turn in range(1, args.turns + 1):
        rs = [r for r in rows if r["turn"] == turn]

        def med(key: str, rs: list[dict[str, Any]] = rs) -> float:
            return statistics.median(r[key] for r in rs)

        ratio = statistics.median(r["ngram_tok_s"] / r["plain_tok_s"] for r in rs if r["plain_tok_s"] > 0)
        print(f"| {turn} | {rs[0]['kind']} | {med('prompt'):.0f} | {med('plain_tok_s'):.1f} | {med('ngram_tok_s'):.1f} "
              f"| {ratio:.2f} | {med('plain_ttft'):.2f} | {med('ngram_ttft'):.2f} | {med('cold_ttft'):.2f} "
              f"| {med('ngram_ttft') / med('cold_ttft'):.2f} |")


if __name__ == "__main__":
    main()
