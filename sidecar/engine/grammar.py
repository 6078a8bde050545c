"""Structured output: llama.cpp's GBNF grammar sampler, used as a logit mask.

Ollama's `format` ("json" or a JSON schema) becomes a GBNF grammar (llama-cpp-python's converter)
and a `Grammar` here tells which tokens may come next. The mask is applied to the logits before
the one shared sampling function shapes them (engine.sampling), so plain decoding, the draft's q
and the verifier's p all see the same constrained distribution.

The grammar sampler is used for two calls only: `llama_sampler_apply` (mask, never changes state)
and `llama_sampler_accept` (advance). Verification scores row i of a draft under the state after
draft tokens 0..i-1, so the decoder clones the committed state and walks the clone along the draft;
the committed state advances only for tokens that are emitted. llama.cpp aborts the process when a
grammar accepts a token it forbids, so `accept` checks first and raises instead.
"""

from __future__ import annotations

import ctypes
import json
from collections import abc
from collections.abc import Callable
from typing import Any

import llama_cpp as C
import numpy as np
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from sidecar.engine.llama import EngineError, Weights
from sidecar.engine.text import Trigger
from sidecar.errors import ClientError

_LOOSE_CHAR = r'char ::= [^"\\] |'
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


class GrammarError(EngineError, ClientError):
    """A format or grammar that cannot constrain decoding; the client's mistake."""


def gbnf_for_format(fmt: str | dict[str, Any] | None) -> str | None:
    """The GBNF grammar for an Ollama `format`: None (unconstrained), "json", or a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return JSON_GBNF
    if isinstance(fmt, dict):
        try:
            gbnf = json_schema_to_gbnf(json.dumps(fmt))
        except Exception as e:  # the converter asserts, raises KeyError/AttributeError on odd schemas
            raise GrammarError(f"invalid JSON schema in format: {e}") from None
        # The 0.3.36 converter lets raw control characters into strings, which is not JSON (llama.cpp's
        # own converter and JSON_GBNF exclude them).
        return gbnf.replace(_LOOSE_CHAR, _JSON_CHAR)
    raise GrammarError(f'invalid format: "{fmt}"; expected "json" or a valid JSON Schema object')


class _Scratch:
    """A reusable llama_token_data buffer (a full-vocabulary mask would otherwise allocate 600 KB)."""

    def __init__(self) -> None:
        self.data: ctypes.Array[C.llama_token_data] | None = None
        self.view: np.ndarray | None = None

    def get(self, n: int) -> tuple[ctypes.Array[C.llama_token_data], np.ndarray]:
        if self.data is None or len(self.data) < n:
            self.data = (C.llama_token_data * n)()
            self.view = np.ctypeslib.as_array(self.data)
        assert self.view is not None
        return self.data, self.view[:n]


class Grammar:
    """One grammar state over a model's vocabulary. Not thread-safe (one worker thread owns it)."""

    def __init__(self, weights: Weights, gbnf: str, *, _ptr: Any = None, _scratch: _Scratch | None = None) -> None:
        self.weights = weights
        self._ptr = None
        if _ptr is None:
            _ptr = C.llama_sampler_init_grammar(weights.vocab, gbnf.encode("utf-8"), b"root")
            if not _ptr:
                raise GrammarError("the grammar for this format does not parse (llama.cpp refused it)")
        self._ptr = _ptr
        self._gbnf = gbnf
        self._scratch = _scratch or _Scratch()

    def clone(self) -> Grammar:
        """An independent copy of the current state (to walk along a draft)."""
        ptr = C.llama_sampler_clone(self._ptr)
        if not ptr:
            raise EngineError("llama.cpp could not clone the grammar")
        return Grammar(self.weights, self._gbnf, _ptr=ptr, _scratch=self._scratch)

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` the grammar allows next (a bool per id), without changing the state."""
        n = len(ids)
        if n == 0:
            return np.zeros(0, dtype=bool)
        data, view = self._scratch.get(n)
        view["id"] = ids
        view["logit"] = 0.0
        view["p"] = 0.0
        cur = C.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
        C.llama_sampler_apply(self._ptr, ctypes.byref(cur))
        # The grammar sampler only writes -inf into rejected logits; it keeps size and order.
        out = np.ctypeslib.as_array(cur.data, shape=(cur.size,))
        return np.isfinite(out["logit"]).copy()

    def allows(self, token: int) -> bool:
        return bool(self.allowed(np.array([token], dtype=np.int32))[0])

    def accept(self, token: int) -> None:
        """Advance by one emitted token; a forbidden one raises (llama.cpp would abort)."""
        if not self.allows(token):
            raise EngineError(f"token {token} is not allowed by the grammar here")
        C.llama_sampler_accept(self._ptr, token)

    def close(self) -> None:
        if self._ptr is not None:
            C.llama_sampler_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:  # clones dropped on an exception path still get freed
        self.close()


class DraftStates:
    """Grammar states for the rows of one verification: row i sees the state after draft[:i].

    The verifiers ask for rows in order and stop at the first rejection, so one clone walked
    forward serves every row, and it only ever accepts draft tokens already verified. A deferred
    grammar not started yet masks no row until a draft token completes its trigger (a copy of the
    committed watcher walks the draft); the rows after it get the grammar's start state walked from
    there."""

    def __init__(self, grammar: Grammar | None, trigger: Trigger | None, draft: abc.Sequence[int],
                 text_of: Callable[[int], bytes]) -> None:
        self.grammar = grammar
        self.draft = draft
        self._text_of = text_of
        # Set while the grammar has not started by the row being walked to.
        self._watch = trigger.copy() if trigger is not None and not trigger.fired else None
        self._walker: Grammar | None = None
        self._walked = 0

    def at(self, i: int) -> Grammar | None:
        if self.grammar is None:
            return None
        while self._walked < i:
            tok = self.draft[self._walked]
            self._walked += 1
            if self._watch is None:
                if self._walker is None:
                    self._walker = self.grammar.clone()
                self._walker.accept(tok)
            elif self._watch.feed(self._text_of(tok)):
                self._watch = None  # the grammar applies from the next row on, from its start state
        if self._watch is not None:
            return None
        return self._walker if self._walker is not None else self.grammar

    def close(self) -> None:
        if self._walker is not None:
            self._walker.close()
