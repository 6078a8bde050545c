"""A cross-request suffix cache: drafts that continue what earlier requests' outputs said.

Apps and agents send many requests whose outputs repeat each other: a JSON skeleton filled from
different inputs, tool-call boilerplate, the same answer to a question asked again in a fresh chat.
NgramDrafter only sees one request's own prompt and output. This cache keeps the finished requests
of a pair (or of every pair on one vocabulary) and proposes how their outputs went on after the
longest stretch that matches the current context's tail, by branch frequency, as SuffixDecoding
does (Oliaro et al. 2024; Arctic Inference's SuffixDecodingCache, which vLLM's suffix decoding
uses), restricted to one path because the verifier takes a linear draft.

Arctic keeps a suffix tree in C++; in Python a trie with dict children costs hundreds of bytes per
cached token. Here the cache is flat arrays:

* a ring of token ids, each sequence followed by a separator (-1), so evicting the oldest whole
  sequences only moves the ring's start, and the next sequences reuse their slots;
* for each n-gram length in LEVELS, a hash table of chains (zlib's LZ77 matcher, in numpy):
  `head[bucket]` is the newest position that follows an n-gram hashing there, `prev[position]`
  the next older one. Positions are absolute and grow, so an entry before the ring's start is
  known to be evicted without any sweep.

A lookup hashes the context's tail at each level, longest first, walks the PROBES newest
occurrences of that n-gram and measures (vectorised) how far back each really matches, up to
`max_depth` tokens: the deepest node a suffix tree would reach. The occurrences whose match is in
the best one's power-of-two class stand for that node's subtree, newest first; the draft follows
their most frequent continuation token by token, and its probability is the product of the branch
frequencies, the sequences that end there counted in the denominator (as in Arctic).

Memory is fixed by the capacity: 4 bytes a slot for the ring and 8 per level for chains and tables,
29 bytes per cached token in all (bench/suffix_cache.py: 55 MiB for the default 2 M). 2 M tokens
are some 15k requests of typical length; a lookup costs ~30 µs there (a CPU target step costs
milliseconds), adding a 1k-token output ~0.25 ms.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import threading
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sidecar.engine.adaptive import NGRAM_N_MAX
from sidecar.engine.drafters import Proposal, Support, match_class
from sidecar.engine.grammar import Grammar
from sidecar.engine.sampling import Sampler

log = logging.getLogger("sidecar.engine")

LEVELS = (2, 8, 32)
"""N-gram lengths indexed. A match shorter than 2 is noise across requests; each level costs 8 bytes
per cached token, and a level finds the matches at least as long as it among its n-gram's newest
PROBES occurrences, so the longer levels keep a frequent short n-gram from hiding a long match."""
PROBES = 16  # occurrences examined per lookup: the frequency estimate's sample, and its cost
FORMAT_VERSION = 1
_SEP = -1
_M64 = (1 << 64) - 1
_BASE = 0x9F3A5C7B1D2E4F61  # odd: the polynomial hash of an n-gram (token ids are < 2^31)
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: the table index is the top bits of hash * _MIX
_INVERSE = pow(_BASE, -1, 1 << 64)
_POWERS = [pow(_BASE, j, 1 << 64) for j in range(max(LEVELS))]


@dataclass(frozen=True)
class Continuation:
    """What the cache proposes after a context: its tail matched `match` tokens of earlier
    sequences at `occurrences` places (the sample behind the estimate), and `agreeing` of them went
    on with tokens[0]. probs[i] estimates the chance that the path holds up to tokens[i]; votes[i]
    is (rows that go on with tokens[i], rows still on the path there)."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match: int = 0
    occurrences: int = 0
    agreeing: int = 0
    votes: list[tuple[int, int]] = field(default_factory=list)


class SuffixCache:
    """Finished sequences of tokens, bounded to `capacity` slots (each sequence takes its length plus
    one), oldest whole sequences evicted first. Thread-safe; one lock, held for array reads and
    writes only (hashing and choosing the path run outside it).

    `vocab` names the vocabulary the token ids belong to: a saved file made under another one is
    ignored on load."""

    _POS_LIMIT = 2**31 - 1  # positions are int32; past this they are shifted down (_rebase)

    def __init__(self, capacity: int = 2_000_000, max_depth: int = 64, vocab: str = "") -> None:
        if capacity < 2 * max(LEVELS):
            raise ValueError(f"a suffix cache needs a capacity of at least {2 * max(LEVELS)} tokens")
        if max_depth < max(LEVELS):
            raise ValueError(f"max_depth must be at least {max(LEVELS)}")
        self.capacity = capacity
        self.max_depth = max_depth
        self.vocab = vocab
        self._bits = max(6, (capacity - 1).bit_length())  # a table slot per cached token, or more
        self._tokens = np.zeros(capacity, np.int32)
        self._prevs = [np.zeros(capacity, np.int32) for _ in LEVELS]
        self._heads = [np.zeros(1 << self._bits, np.int32) for _ in LEVELS]
        # Every page written now, where the cache is made (a pair's load, off the step thread): the
        # hashed index scatters even one request's writes over every table, and the OS maps a
        # table's pages (numpy asks for 2 MB huge pages) as they are first written, so the first
        # request learnt into a fresh default cache took 3-150 ms (the most where the kernel had to
        # compact memory to find huge pages), a stall of the whole batch at its end. Writing all
        # 58 MB here takes 0.02-0.3 s once (bench/suffix_cache.py times both).
        for table in (self._tokens, *self._prevs, *self._heads):
            table.fill(0)
        # A separator before the first sequence: then the slot before the oldest live sequence always
        # holds one (an evicted sequence's, or the newest's when the ring is exactly full), so a
        # match never runs back out of its sequence.
        self._tokens[0] = _SEP
        self._start = self._next = 1  # live positions are [start, next); 0 in a table means empty
        self._ends: deque[int] = deque()  # where each live sequence ends (after its separator)
        self._offsets = np.zeros(0, np.int64)  # _gather's, from a candidate's slot
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        """Slots in use: cached tokens plus one separator per sequence."""
        return self._next - self._start

    @property
    def sequences(self) -> int:
        return len(self._ends)

    def add(self, tokens: Sequence[int]) -> None:
        """Learn one finished sequence (a sequence longer than the cache keeps its end)."""
        arr = np.asarray(tokens, dtype=np.int64)[-(self.capacity - 1) :]
        if len(arr) < LEVELS[0]:
            return  # nothing in it could ever be matched
        if int(arr.min()) < 0 or int(arr.max()) >= 2**31:
            raise ValueError("token ids are 0 to 2^31 - 1")
        self._ingest(np.append(arr, _SEP), [len(arr) + 1])

    def lookup(self, context: Sequence[int], max_tokens: int, factor: float = 1.0,
               min_prob: float = 0.1) -> Continuation:
        """The most frequent continuation after the longest match of `context`'s tail.

        The draft holds at most `factor` tokens per matched token (a short match is weak evidence,
        so it gets a short draft) and stops where its estimated probability falls below `min_prob`;
        Arctic's defaults."""
        tail = list(context[-self.max_depth :])
        n = len(tail)
        if n < LEVELS[0] or max_tokens <= 0:
            return Continuation()
        # The tail newest first, padded with a sentinel no token equals: the first mismatch in a row
        # is the match length, even where all n tokens match.
        want = np.array([*tail[::-1], *[_SEP - 1] * (self.max_depth + 1 - n)], dtype=np.int32)
        buckets = self._tail_buckets(tail)
        rows: list[list[int]] = []
        match = 0
        with self._lock:
            for li in range(len(buckets) - 1, -1, -1):
                slots = self._chain(li, buckets[li])
                if slots:
                    rows, match = self._gather(slots, want, n, LEVELS[li], max_tokens, factor)
                    if rows:
                        break
        return self._path(rows, match, min_prob) if rows else Continuation()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the live sequences, oldest first, atomically (a crash leaves the old file)."""
        with self._lock:
            live = self._tokens[np.arange(self._start, self._next) % self.capacity]
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                np.savez(f, version=np.int32(FORMAT_VERSION), vocab=np.str_(self.vocab), tokens=live)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def load(self, path: str | os.PathLike[str]) -> bool:
        """Replace the contents with a saved file's; False (and a warning, unless the file does not
        exist) when it cannot be used. Newer sequences are kept first if it holds more than fits."""
        path = Path(path)
        if not path.exists():
            return False
        try:
            with np.load(path, allow_pickle=False) as z:
                version, vocab, tokens = int(z["version"]), str(z["vocab"]), z["tokens"]
            problem = self._unusable(version, vocab, tokens)
        except Exception as e:  # whatever is wrong with a cache file, serving goes on without it
            problem = f"unreadable ({e!r})"
        if problem:
            log.warning("suffix cache %s ignored: %s", path, problem)
            return False
        ends = (np.flatnonzero(tokens == _SEP) + 1).tolist()
        # The newest whole sequences that fit.
        cut = next((c for c in (0, *ends) if len(tokens) - c <= self.capacity), len(tokens))
        with self._lock:
            self._start = self._next
            self._ends.clear()
        if cut < len(tokens):
            self._ingest(tokens[cut:].astype(np.int64), [e - cut for e in ends if e > cut])
        return True

    def _unusable(self, version: int, vocab: str, tokens: np.ndarray) -> str | None:
        if version != FORMAT_VERSION:
            return f"format version {version}, this build reads {FORMAT_VERSION}"
        if vocab != self.vocab:
            return f"made for vocabulary {vocab!r}, not {self.vocab!r}"
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            return "no token array"
        if len(tokens) and (int(tokens.min()) < _SEP or int(tokens.max()) >= 2**31 or tokens[-1] != _SEP):
            return "token ids out of range, or the last sequence is cut off"
        return None

    # -- internals ------------------------------------------------------------------------------

    def _tail_buckets(self, tail: list[int]) -> list[int]:
        """Table index of the tail's last L tokens, per level L the tail is long enough for.

        The hash is sum(t[p - 1 - j] * _BASE^j) mod 2^64 over the L tokens before p, as _ingest
        computes it; for a few dozen tokens Python's integers beat numpy's per-call cost."""
        out: list[int] = []
        h = done = 0
        newest_first = tail[::-1]
        for level in LEVELS:
            if level > len(tail):
                break
            h += sum(map(operator.mul, newest_first[done:level], _POWERS[done:level]))
            done = level
            out.append((((h & _M64) * _MIX) & _M64) >> (64 - self._bits))
        return out

    def _ingest(self, block: np.ndarray, ends: list[int]) -> None:
        """Store sequences (each ending with its separator; `ends` are offsets after each) and index
        every n-gram inside one sequence by the position that follows it (the separator: an end)."""
        size = len(block)
        idx = np.arange(size, dtype=np.int64)
        # run[i]: tokens of block[i]'s sequence up to and including block[i]; an n-gram of length L
        # ending at i lies in one sequence iff run[i] >= L.
        run = idx + 1 - np.maximum.accumulate(np.where(block == _SEP, idx + 1, 0))
        # Every level's hashes from one prefix sum (uint64 arithmetic wraps mod 2^64, as the hash
        # does): with S[i] = sum(t[k] * B^-k, k < i), the L tokens before p hash to
        # B^(p - 1) * (S[p] - S[p - L]).
        inverse = np.full(size, _INVERSE, np.uint64)
        inverse[0] = 1
        prefix = np.zeros(size + 1, np.uint64)
        np.cumsum(block.astype(np.uint64) * np.cumprod(inverse), out=prefix[1:])
        powers = np.full(size, _BASE, np.uint64)
        powers[0] = 1
        powers = np.cumprod(powers)
        linked: list[tuple[np.ndarray, np.ndarray]] = []
        shift = np.uint64(64 - self._bits)
        for n in LEVELS:
            offs = np.flatnonzero(run[n - 1 :] >= n) + n  # the offset after each n-gram
            h = powers[offs - 1] * (prefix[offs] - prefix[offs - n])
            linked.append((offs, ((h * np.uint64(_MIX)) >> shift).astype(np.int64)))
        with self._lock:
            if self._next + size > self._POS_LIMIT:
                self._rebase()
            while self._next + size - self._start > self.capacity:
                self._start = self._ends.popleft() if self._ends else self._next
            base = self._next
            self._tokens[(base + idx) % self.capacity] = block
            for li, (offs, buckets) in enumerate(linked):
                self._link(li, base + offs, buckets)
            self._next = base + size
            self._ends.extend(base + e for e in ends)

    def _link(self, li: int, pos: np.ndarray, buckets: np.ndarray) -> None:
        """Push positions (ascending) onto their buckets' chains, as one-by-one inserts would."""
        head, prev = self._heads[li], self._prevs[li]
        order = np.argsort(buckets, kind="stable")
        sb, sp = buckets[order], pos[order]
        first = np.ones(len(sb), bool)
        first[1:] = sb[1:] != sb[:-1]
        last = np.ones(len(sb), bool)
        last[:-1] = first[1:]
        older = np.empty_like(sp)
        older[1:] = sp[:-1]
        older[first] = head[sb[first]]
        prev[sp % self.capacity] = older
        head[sb[last]] = sp[last]

    def _rebase(self) -> None:
        """Shift every position down by whole rings (slots stay put) before int32 runs out."""
        shift = (self._start - 1) // self.capacity * self.capacity
        for arr in (*self._heads, *self._prevs):
            arr[:] = np.where(arr >= self._start, arr - shift, 0)
        self._start -= shift
        self._next -= shift
        self._ends = deque(e - shift for e in self._ends)

    def _chain(self, li: int, bucket: int) -> list[int]:
        """The ring slots of the newest live positions on a bucket's chain, up to PROBES."""
        start, cap, prev = self._start, self.capacity, self._prevs[li]
        out: list[int] = []
        p = self._heads[li].item(bucket)
        while p >= start and len(out) < PROBES:
            out.append(p % cap)
            p = prev.item(out[-1])
        return out

    def _gather(self, slots: list[int], want: np.ndarray, n: int, level: int, max_tokens: int,
                factor: float) -> tuple[list[list[int]], int]:
        """The continuations of the candidates in the best match's class (longest match first,
        then newest), and that match's length; no rows if no candidate really matches `level`."""
        back = len(want)
        limit = min(max_tokens, max(1, int(n * factor + 1e-6)))  # the most any match here allows
        if len(self._offsets) < back + limit:
            self._offsets = np.array([*range(-1, -back - 1, -1), *range(2 * (back + limit))], np.int64)
        # One gather (numpy's wrap mode is the ring's): the slots before each candidate, newest first
        # as in `want`, then the `limit` from it on.
        window = np.take(self._tokens, np.add.outer(slots, self._offsets[: back + limit]), mode="wrap")
        match = (window[:, :back] == want).argmin(axis=1).tolist()
        best = max(match)
        if best < level:  # hash collisions only
            return [], 0
        floor = 1 << (best.bit_length() - 1)
        order = sorted((-m, i) for i, m in enumerate(match) if m >= floor)  # longest, then newest
        ahead = window[:, back : back + min(limit, max(1, int(best * factor + 1e-6)))].tolist()
        return [ahead[i] for _, i in order], best

    @staticmethod
    def _path(rows: list[list[int]], match: int, min_prob: float) -> Continuation:
        """Follow the most frequent next token (ties: the earlier row), narrowing to the rows that
        agree; rows are cut at their sequence's end, which counts against every branch.

        The rows have one length (`_gather` cuts them alike). Where every row still alive agrees
        (the usual case: a repeated answer) the columns are taken a run at a time in numpy; only a
        branch is counted in Python. Token by token, a lookup cost ~1 ms a sequence a step (64
        candidates of 64 tokens), on a step that a GPU decodes in a few."""
        tokens: list[int] = []
        probs: list[float] = []
        votes: list[tuple[int, int]] = []
        agreeing, p = 0, 1.0
        alive = np.asarray(rows, dtype=np.int64)
        width, j = alive.shape[1], 0
        while j < width:
            n = len(alive)
            if n == 1:  # one row left: it goes on, at the same probability, to its end
                rest = alive[0, j:].tolist()
                rest = rest[: rest.index(_SEP)] if _SEP in rest else rest
                tokens += rest
                probs += [p] * len(rest)
                votes += [(1, 1)] * len(rest)
                agreeing = agreeing or (1 if rest else 0)
                break
            head = alive[0, j:]
            same = (alive[:, j:] == head).all(axis=0) & (head != _SEP)  # no branch in these columns
            run = len(same) if same.all() else int(same.argmin())
            if run:
                tokens += head[:run].tolist()
                probs += [p] * run
                votes += [(n, n)] * run
                agreeing = agreeing or n
                j += run
                if j >= width:
                    break
            counts = Counter(alive[:, j].tolist())
            counts.pop(_SEP, None)
            if not counts:
                break
            tok, got = counts.most_common(1)[0]  # the first of equals: the earlier row's
            p *= got / n
            if p < min_prob:
                break
            agreeing = agreeing or got
            tokens.append(tok)
            probs.append(p)
            votes.append((got, n))
            alive = alive[alive[:, j] == tok]
            j += 1
        return Continuation(tokens, probs, match, len(rows), agreeing, votes)


class SuffixDrafter:
    """Drafts from a SuffixCache; teaches it each finished request (`finish`).

    Support classes 10 * c + f (10..62): c is the match's class as in NgramDrafter
    (drafters.match_class: m = 2^c to 2m - 1 tokens, c = 1..6, capped at 64), f how the earlier
    sequences behind it agree on the first drafted token, by the rule of succession
    p = (agreeing + 1) / (occurrences + 2):
    f = 0 split (p < 0.6), 1 one occurrence or a weak majority (0.6 <= p < 0.8: one of one, two of
    two), 2 established (p >= 0.8: three of three or more). Priors start from NgramDrafter's
    m / (m + 2) for a verbatim copy: f = 1 takes it as it is, f = 2 halves the doubt (several
    outputs said the same), f = 0 halves the prior (earlier outputs went different ways).
    A draft's later tokens are classed alike (`Support.along`): token j by its match, j tokens
    longer, and its own vote, so a draft is priced to hold through the keys a JSON skeleton
    repeats and not through the value after one, where earlier outputs split; past the
    continuation's end (class PAST_END) nothing is expected.

    One drafter per decoding slot (its lookup is remembered per request); the slots share a cache.
    Like NgramDrafter it ignores a grammar: the verifier's masked p rejects what the grammar forbids.

    `lead` tokens of the prompt's end are learned with the output (None: the whole prompt, 0: none).
    Without them the first tokens of an answer have no context to be matched by (the chat template's
    `assistant` turn and the question before it); whole prompts mostly repeat what NgramDrafter
    already sees in the request itself, and would crowd outputs out of the cache."""

    name = "suffix"
    has_cost = False
    PAST_END = -1

    def __init__(self, cache: SuffixCache, lead: int | None = 64, max_draft: int = NGRAM_N_MAX, factor: float = 1.0,
                 min_prob: float = 0.1) -> None:
        self.cache = cache
        self.lead = lead
        self.max_draft = max_draft  # the longest draft (an n-gram pair's n_max: a repeated answer runs long)
        self.factor = factor
        self.min_prob = min_prob
        self._found: tuple[int, int, Continuation] = (-1, -1, Continuation())

    def begin(self, sampler: Sampler | None) -> None:
        self._found = (-1, -1, Continuation())

    def finish(self, prompt: Sequence[int], output: Sequence[int], done_reason: str) -> None:
        """Teach the cache a finished request (decoder.Result's tokens and done_reason).

        A cancelled request is not learned: a client that hangs up often did not want the output
        (a runaway answer), and its cut-off end would count as an end of that answer."""
        if done_reason == "cancel" or not output:
            return
        lead = prompt if self.lead is None else prompt[max(0, len(prompt) - self.lead) :]
        self.cache.add([*lead, *output])

    def _lookup(self, context: Sequence[int]) -> Continuation:
        n_ctx = len(context)
        last = context[-1] if n_ctx else -1
        # As in NgramDrafter: the context only grows within a request, so the schedule's look and
        # the draft of one round share a lookup (and see the same cache, whatever other threads add).
        if self._found[:2] != (n_ctx, last):
            self._found = (n_ctx, last, self.cache.lookup(context, self.max_draft, self.factor, self.min_prob))
        return self._found[2]

    def _support(self, cont: Continuation) -> Support:
        first = self.classify(cont.match, cont.occurrences, cont.agreeing)

        def along(j: int) -> Support:
            """Token j's class: its match j tokens longer, its own vote (where earlier outputs went
            different ways: a JSON value after a key they all share), and none past the path's end."""
            if j == 0:
                return first
            if j >= len(cont.tokens):
                return Support(cls=self.PAST_END, prior=0.0)
            agreeing, alive = cont.votes[j]
            return self.classify(cont.match + j, alive, agreeing)

        return Support(cls=first.cls, prior=first.prior, along=along, under=first.under)

    @staticmethod
    @functools.lru_cache(maxsize=4096)  # the schedule prices up to 64 tokens along each draft, every step
    def classify(match: int, occurrences: int, agreeing: int) -> Support:
        """The support class of a continuation (see the class docstring)."""
        c = match_class(match, 64)[0]
        p = (agreeing + 1) / (occurrences + 2)
        return SuffixDrafter._class(c, 2 if p >= 0.8 else 1 if p >= 0.6 else 0)

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def _class(c: int, f: int) -> Support:
        """Class 10 * c + f; under it, one match class shorter and one agreement level lower."""
        copy = match_class(1 << c, 64)[1]
        under = tuple(SuffixDrafter._class(c1, f1) for c1, f1 in ((c - 1, f), (c, f - 1)) if c1 >= 0 and f1 >= 0)
        return Support(cls=10 * c + f, prior=(copy / 2, copy, (1 + copy) / 2)[f], under=under)

    def propose(self, context: Sequence[int], max_tokens: int, grammar: Grammar | None = None) -> Proposal:
        cont = self._lookup(context)
        if not cont.tokens:
            return Proposal()
        return Proposal(list(cont.tokens[:max_tokens]), self._support(cont))

    def shift(self, context: Sequence[int], keep: int, discard: int) -> None:
        # A lookup reads only the context's end, which a shift keeps; forget the remembered one,
        # whose key (length, last token) described the longer context.
        self._found = (-1, -1, Continuation())
