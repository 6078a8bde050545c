"""The order waiting requests take a free slot in: interactive first, within a bound.

When every slot of a target is busy, requests wait. An app such as Open WebUI sends, at the moment
a user's chat goes out, side requests nobody watches: a title (non-streamed, num_predict 1000),
tags, follow-up suggestions; an agent sends summaries and sub-tasks beside its turn. In plain FIFO
order those took the slots, and the next user's chat waited behind them (the issue's trial: one
title ran 145 s while a chat waited). Ollama has no such order (server/sched.go queues requests
FIFO).

So a waiting *interactive* request (streamed: someone watches the first token come) goes before
waiting non-interactive ones, and:

* a running sequence is never preempted: the order only picks who takes a slot once one is free;
* FIFO holds within each class;
* nothing starves: a non-interactive request is passed by at most `PASSES` later interactive ones,
  then it goes first whatever waits. Four covers the side requests one app turn fires at once
  (Open WebUI: title, tags, follow-ups) for a few users chatting together, and bounds the
  worst case a batch job waits to four interactive turns beyond FIFO;
* a barrier (a call on the engine's thread that must run between requests in arrival order:
  building or freeing a pair's drafters, unloading) is never passed, and nothing behind it moves
  ahead of it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

PASSES = 4  # how many later interactive requests may go before a waiting non-interactive one


@dataclass
class _Entry(Generic[T]):
    item: T
    interactive: bool | None  # None: a barrier
    passed: int = 0  # later interactive requests that went before this one


class AdmissionQueue(Generic[T]):
    """Waiting requests and barriers, in arrival order; `peek`/`pop` give the one that goes next."""

    def __init__(self, passes: int = PASSES) -> None:
        self.passes = passes
        self._entries: deque[_Entry[T]] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, item: T, interactive: bool | None) -> None:
        """Queue a request (interactive or not) or, with None, a barrier."""
        self._entries.append(_Entry(item, interactive))

    def waiting(self, interactive: bool) -> int:
        """How many requests of the class wait (barriers are not requests)."""
        return sum(e.interactive is interactive for e in self._entries)

    def _next(self) -> int:
        entries = self._entries
        first = entries[0]
        if first.interactive is not False or first.passed >= self.passes:
            return 0
        for i in range(1, len(entries)):
            e = entries[i]
            if e.interactive is None:
                break  # a barrier: nothing moves ahead of it
            if e.interactive:
                return i
        return 0

    def peek(self) -> T | None:
        """What goes next, or None when nothing waits."""
        return self._entries[self._next()].item if self._entries else None

    def pop(self) -> T:
        """Take what goes next; the non-interactive requests it passes count the pass."""
        i = self._next()
        for j in range(i):
            self._entries[j].passed += 1
        item = self._entries[i].item
        del self._entries[i]
        return item
