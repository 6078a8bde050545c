"""A thin, typed layer over llama-cpp-python's low-level ctypes API.

Why not `llama_cpp.Llama`: it keeps an `n_ctx x n_vocab` score buffer, samples inside C where the
speculative verifier cannot see p, and its `detokenize` drops pieces longer than 32 bytes. Here a
`Weights` is one loaded GGUF (shared, memory-mapped) and a `Context` is one KV cache over it with a
reusable `llama_batch` whose per-row logits flags we set ourselves.

Nothing here is thread-safe: one worker thread owns each Context (see runtime.llamacpp.worker).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp as C
import numpy as np

from sidecar.engine.backend import default_threads, gpu_offload_supported, init_backend
from sidecar.engine.hosttime import on_device
from sidecar.engine.kernels import file_type, repack_is_exact


class EngineError(RuntimeError):
    """llama.cpp refused to do something; the message says what and why."""


class ContextFull(EngineError):
    """The KV cache has no room for the batch (llama_decode returned 1)."""


@dataclass(frozen=True)
class VocabInfo:
    """What llama.cpp's draft compatibility check compares (pairing.rules), and the one type for these facts."""

    type: int
    n_tokens: int
    bos: int
    eos: int
    add_bos: bool
    add_eos: bool


class Weights:
    """One GGUF loaded once (mmap) and shared by every Context and pair that uses it. On the CPU a file
    whose `file_type` has repacked kernels that are not exact loads without them."""

    def __init__(self, path: str | Path, *, n_gpu_layers: int = -1, use_mmap: bool = True,
                 vocab_only: bool = False) -> None:
        init_backend()
        self.path = Path(path)
        params = C.llama_model_default_params()
        params.vocab_only = vocab_only  # the vocabulary and hyperparameters only: no tensor is touched
        params.n_gpu_layers = min(n_gpu_layers, 0x7FFFFFFF) if n_gpu_layers >= 0 else 0x7FFFFFFF  # a C int32
        params.use_extra_bufts = (n_gpu_layers != 0 and gpu_offload_supported()) or repack_is_exact(file_type(path))
        if not use_mmap:
            params.load_mode = C.LLAMA_LOAD_MODE_NONE
        model = C.llama_model_load_from_file(str(self.path).encode(), params)
        if not model:
            raise EngineError(f"llama.cpp could not load {self.path} (not a GGUF it understands?)")
        self.model = model
        self.vocab = C.llama_model_get_vocab(model)
        self.n_vocab = int(C.llama_vocab_n_tokens(self.vocab))
        self.n_layer = int(C.llama_model_n_layer(model))
        self.n_ctx_train = int(C.llama_model_n_ctx_train(model))
        self.gpu_layers = min(self.n_layer + 1, n_gpu_layers if n_gpu_layers >= 0 else self.n_layer + 1)
        if not gpu_offload_supported():
            self.gpu_layers = 0
        self.size = int(C.llama_model_size(model))
        self._pieces: dict[int, bytes] = {}
        self._special_pieces: dict[int, bytes] = {}
        self._closed = False

    # -- vocabulary -------------------------------------------------------------------------
    def vocab_info(self) -> VocabInfo:
        v = self.vocab
        return VocabInfo(
            type=int(C.llama_vocab_type(v)),
            n_tokens=self.n_vocab,
            bos=int(C.llama_vocab_bos(v)),
            eos=int(C.llama_vocab_eos(v)),
            add_bos=bool(C.llama_vocab_get_add_bos(v)),
            add_eos=bool(C.llama_vocab_get_add_eos(v)),
        )

    def token_text(self, token: int) -> bytes:
        return C.llama_vocab_get_text(self.vocab, token) or b""

    def starts_with_bos(self, text: str) -> bool:
        """Whether a rendered prompt already begins with the BOS token's text."""
        bos = self.vocab_info().bos
        prefix = self.token_text(bos).decode("utf-8", "replace") if bos >= 0 else ""
        return bool(prefix) and text.startswith(prefix)

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self.vocab, token))

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (C.llama_token * n_max)()
        n = C.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (C.llama_token * n_max)()
            n = C.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            raise EngineError("tokenization failed")
        return list(buf[:n])

    def special_ids(self, texts: Iterable[str]) -> list[int]:
        """The ids of the tokens spelled by `texts` (`<|channel|>`); texts that are not one token are
        skipped, as llama-server does with a request's preserved_tokens."""
        ids = [self.tokenize(t, add_special=False, parse_special=True) for t in texts if t]
        return [one[0] for one in ids if len(one) == 1]

    def piece(self, token: int) -> bytes:
        """The bytes a token stands for; control tokens render as nothing. Pieces can exceed any
        fixed buffer and need not be valid UTF-8: callers feed them to engine.text's decoder."""
        return self._piece(token, False)

    def special_piece(self, token: int) -> bytes:
        """The bytes a token stands for with control tokens rendered as their text (`<|channel|>`).

        Output parsers (harmony, qwen3) need some control tokens as text; `piece` hides them because
        most (an end-of-turn, a BOS) are not part of what a model says."""
        return self._piece(token, True)

    def _piece(self, token: int, special: bool) -> bytes:
        cache = self._special_pieces if special else self._pieces
        cached = cache.get(token)
        if cached is not None:
            return cached
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = C.llama_token_to_piece(self.vocab, token, buf, size, 0, special)
            if n >= 0:
                out = buf.raw[:n]
                break
            size = -n
        cache[token] = out
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            C.llama_model_free(self.model)


@dataclass(frozen=True)
class ContextParams:
    n_ctx: int = 4096  # the window of each sequence
    n_batch: int = 512
    n_threads: int = 0  # 0 = every CPU this process may use
    flash_attn: bool = False  # see README "Losslessness": FA breaks batch invariance on CPU
    type_k: int | None = None  # ggml type ids, None = f16
    type_v: int | None = None
    n_seq: int = 1  # sequences, each on a KV stream of n_ctx cells of its own (engine.step batches them)
    # One pool of n_seq x n_ctx cells for every sequence instead (llama-server's layout): a sequence's
    # logits then depend on where the others left room, so the engine never sets it; for
    # bench/stream_pass.py, which prices what the streams cost against it.
    kv_unified: bool = False


@dataclass
class _Held:
    """What one sequence's KV cache holds: `tokens[i]` sits at position i; the first `fresh` are what
    a prefill of them computes (see Context)."""

    tokens: list[int] = field(default_factory=list)
    fresh: int = 0


@dataclass(frozen=True, eq=False)
class Snapshot:
    """A sequence's KV cells in host memory (llama_state_seq_get_data) and the tokens they hold."""

    tokens: list[int]
    data: np.ndarray  # bytes (uint8)


class Context:
    """A KV pool over shared Weights, holding `n_seq` sequences (ids 0..n_seq-1) of up to `n_ctx`
    positions each, plus the tokens each holds.

    `held(s)[i]` is the token whose keys/values sit at sequence s's position i; `decode` appends,
    `truncate` rolls back, `shift` drops a stretch and moves what follows down, `copy` gives one
    sequence another's prefix (llama_memory_seq_cp). Every
    method names its sequence and defaults to 0, so a one-sequence context reads as before. Logits
    are copied out of llama.cpp right away because the next decode reuses its buffer.

    Each sequence has a KV stream of its own (`kv_unified` off), laid out as when it runs alone, so
    its logits do not depend on what the others hold (README, "Why one stream per sequence"). A
    batch of rows from many sequences is one llama_decode; llama.cpp splits it into passes of equal
    rows per stream (engine.layout prices that).

    `fresh(s)` counts the leading positions whose keys/values are what a prefill of
    `held(s)[:fresh]` would compute. A shift keeps the later tokens' entries, which were computed
    while the dropped stretch was still there, so they are not: a new prompt may reuse only the
    fresh prefix, or its output would depend on what earlier requests did to the cache."""

    def __init__(self, weights: Weights, params: ContextParams) -> None:
        self.weights, self.params = weights, params
        n_seq = max(1, params.n_seq)
        cp = C.llama_context_default_params()
        cp.n_ctx = params.n_ctx * n_seq
        cp.n_batch = cp.n_ubatch = params.n_batch
        cp.n_seq_max = n_seq
        cp.kv_unified = params.kv_unified  # off: a stream per sequence (engine.step, Losslessness)
        threads = params.n_threads or default_threads()
        cp.n_threads = cp.n_threads_batch = threads
        self.n_threads = threads
        cp.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_ENABLED if params.flash_attn else C.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if params.type_k is not None:
            cp.type_k = params.type_k
        if params.type_v is not None:
            cp.type_v = params.type_v
        cp.no_perf = True
        ctx = C.llama_init_from_model(weights.model, cp)
        if not ctx:
            raise EngineError(
                f"llama.cpp could not create a context of {params.n_ctx} tokens"
                f"{f' x {n_seq} sequences' if n_seq > 1 else ''} for {weights.path.name}"
            )
        self.ctx = ctx
        self.memory = C.llama_get_memory(ctx)
        self.n_seq = n_seq
        self.n_cells = int(C.llama_n_ctx(ctx))  # the pool (llama.cpp pads it: 300 asked gives 512)
        # Each sequence's window is what was asked for, not the padding: so a num_ctx of 300 is 300
        # everywhere (truncation, shifts, /api/ps, and the next request's num_ctx compared with it).
        self.n_ctx = min(params.n_ctx, self.n_cells // n_seq)
        self.n_batch = int(C.llama_n_batch(ctx))
        self.n_vocab = weights.n_vocab
        self._batch = C.llama_batch_init(self.n_batch, 0, 1)
        self._view_at, self._view = 0, np.empty((0, self.n_vocab), dtype=np.float32)  # `_logits`
        self._held = [_Held() for _ in range(n_seq)]
        # Whether positions can be moved in place (attention caches can; recurrent state cannot).
        self.can_shift = bool(C.llama_memory_can_shift(self.memory))
        self._closed = False

    @property
    def tokens(self) -> list[int]:
        """What sequence 0 holds (a one-sequence context's cache)."""
        return self._held[0].tokens

    @property
    def fresh(self) -> int:
        return self._held[0].fresh

    def held(self, seq: int = 0) -> list[int]:
        return self._held[seq].tokens

    def fresh_of(self, seq: int = 0) -> int:
        return self._held[seq].fresh

    def __len__(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int, seq: int = 0) -> None:
        """Forget every position of `seq` from n on (rejected draft tokens, a changed prompt)."""
        h = self._held[seq]
        if n >= len(h.tokens):
            return
        if not C.llama_memory_seq_rm(self.memory, seq, n, -1):
            # Recurrent/hybrid memory cannot drop a partial range; start that sequence over.
            C.llama_memory_seq_rm(self.memory, seq, -1, -1)
            n = 0
        del h.tokens[n:]
        h.fresh = min(h.fresh, n)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Make `dst` hold `src`'s first n positions (what it held is dropped): a copy of the cells,
        so the prefix costs no prefill."""
        s, d = self._held[src], self._held[dst]
        n = min(n, len(s.tokens))
        C.llama_memory_seq_rm(self.memory, dst, -1, -1)
        # Between two streams llama.cpp copies a whole stream (it asserts the range is all of it:
        # llama_kv_cache::seq_cp), at the next decode; the positions past n are dropped after.
        C.llama_memory_seq_cp(self.memory, src, dst, -1, -1)
        C.llama_memory_seq_rm(self.memory, dst, n, -1)
        d.tokens = s.tokens[:n]
        d.fresh = min(s.fresh, n)

    def save(self, seq: int) -> Snapshot:
        """Sequence `seq`'s fresh prefix and its cells, copied to host memory (engine.hostcache)."""
        self.truncate(self._held[seq].fresh, seq)  # a shifted tail's cells are not a prefill's
        data = np.empty(C.llama_state_seq_get_size(self.ctx, seq), dtype=np.uint8)  # not zeroed: ~GBs on a GPU
        got = C.llama_state_seq_get_data(self.ctx, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), data.size, seq)
        return Snapshot(list(self._held[seq].tokens), data[:got])

    def restore(self, seq: int, snap: Snapshot) -> bool:
        """Make `seq` hold what `snap` saved (what it held is dropped); False where llama.cpp
        could not place the cells, and then `seq` holds nothing."""
        C.llama_memory_seq_rm(self.memory, seq, -1, -1)  # empty: the cells go in from cell 0
        h = self._held[seq]
        h.tokens, h.fresh = [], 0
        src = snap.data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if not C.llama_state_seq_set_data(self.ctx, src, snap.data.size, seq):
            return False
        h.tokens, h.fresh = list(snap.tokens), len(snap.tokens)
        return True

    def set_threads(self, n: int) -> None:
        """Decode with n threads from now on (0: the count the context was made with)."""
        n = n or self.n_threads
        C.llama_set_n_threads(self.ctx, n, n)

    def clear(self) -> None:
        C.llama_memory_clear(self.memory, True)
        for h in self._held:
            h.tokens.clear()
            h.fresh = 0

    def shift(self, keep: int, discard: int, seq: int = 0) -> bool:
        """Forget positions [keep, keep + discard) of `seq` and move the rest down by `discard`
        (llama-server's context shift: llama_memory_seq_rm, then llama_memory_seq_add, which
        re-rotates the moved keys).

        Memory that cannot move positions (llama_memory_can_shift false) is rebuilt instead: the
        sequence is dropped and prefilled with the shifted tokens, which costs a prefill but gives
        the same tokens. Returns whether the shift happened in place."""
        h = self._held[seq]
        n = len(h.tokens)
        if keep < 0 or discard <= 0 or keep + discard > n:
            raise ValueError(f"cannot drop [{keep}, {keep + discard}) of {n} positions")
        if not self.can_shift or not C.llama_memory_seq_rm(self.memory, seq, keep, keep + discard):
            shifted = h.tokens[:keep] + h.tokens[keep + discard :]
            C.llama_memory_seq_rm(self.memory, seq, -1, -1)
            h.tokens.clear()
            h.fresh = 0
            self.prefill(shifted, seq)
            return False
        C.llama_memory_seq_add(self.memory, seq, keep + discard, n, -discard)
        del h.tokens[keep : keep + discard]
        h.fresh = min(h.fresh, keep)
        return True

    def _fill(self, parts: Sequence[tuple[int, Sequence[int], int]]) -> int:
        """Write the rows of `parts` ((seq, tokens, read)) into the batch, logits asked for the last
        `read` rows of each; returns the row count."""
        b = self._batch
        i = 0
        for seq, tokens, read in parts:
            start = len(self._held[seq].tokens)
            first_read = len(tokens) - read
            for j, tok in enumerate(tokens):
                b.token[i] = tok
                b.pos[i] = start + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = j >= first_read
                i += 1
        b.n_tokens = i
        return i

    def _run(self, parts: Sequence[tuple[int, Sequence[int], int]]) -> None:
        n = self._fill(parts)
        rc = on_device(C.llama_decode, self.ctx, self._batch)
        if rc == 1:
            raise ContextFull(f"no room in the context ({self.n_cells} cells) for {n} more")
        if rc != 0:
            # Whatever was written past each sequence's end is unreliable now.
            for seq, _, _ in parts:
                C.llama_memory_seq_rm(self.memory, seq, len(self._held[seq].tokens), -1)
            raise EngineError(f"llama_decode failed with code {rc}")
        for seq, tokens, _ in parts:
            self._extend(seq, tokens)

    def prefill(self, tokens: Sequence[int], seq: int = 0) -> None:
        """Append tokens to `seq` without asking for logits, in n_batch chunks.

        The chunking is a pure function of (len(held(seq)), tokens), so two paths that prefill
        the same prompt from the same state see bit-identical KV."""
        have = len(self._held[seq].tokens)
        if have + len(tokens) > self.n_ctx:
            raise ContextFull(f"{have + len(tokens)} tokens do not fit in {self.n_ctx}")
        for off in range(0, len(tokens), self.n_batch):
            self._run([(seq, tokens[off : off + self.n_batch], 0)])

    def decode(self, tokens: Sequence[int], rows: Sequence[int] | None = None, seq: int = 0) -> np.ndarray:
        """Append tokens to `seq` in ONE llama_decode and return the logits of `rows` (default: all).

        Returns a (len(rows), n_vocab) float32 copy, rows in batch order. Used for single steps and for verifying a
        draft, so len(tokens) must fit in n_batch."""
        n = len(tokens)
        if rows is None:
            return self.decode_many([(seq, tokens, n)])[0]  # type: ignore[return-value]
        if n > self.n_batch:
            raise EngineError(f"batch of {n} exceeds n_batch {self.n_batch}")
        have = len(self._held[seq].tokens)
        if have + n > self.n_ctx:
            raise ContextFull(f"{have + n} tokens do not fit in {self.n_ctx}")
        rows = sorted(rows)
        b = self._batch
        self._fill([(seq, tokens, 0)])
        for r in rows:
            b.logits[r] = True
        rc = on_device(C.llama_decode, self.ctx, b)
        if rc == 1:
            raise ContextFull(f"no room in the context ({self.n_cells} cells) for {n} more")
        if rc != 0:
            C.llama_memory_seq_rm(self.memory, seq, have, -1)
            raise EngineError(f"llama_decode failed with code {rc}")
        self._extend(seq, tokens)
        return self._logits(len(rows))

    def decode_many(self, parts: Sequence[tuple[int, Sequence[int], int]], copy: bool = True,
                    meanwhile: Callable[[], object] | None = None) -> list[np.ndarray | None]:
        """One llama_decode over several sequences' rows: `parts` is (seq, tokens, read) each, at
        most one part per sequence, appended after what that sequence holds, with logits for its
        last `read` rows (all of them for a round, none for a prefill chunk, the last one for the
        chunk that ends a prompt). Returns per part those rows' (read, n_vocab) logits, or None
        where none were asked for.

        copy=False returns views of llama.cpp's logits buffer, valid until the next decode: a
        65-row verification that reads up to its first rejection spares copying 12 MiB. `meanwhile`
        runs once the decode is launched, before its logits are read: on a GPU, where llama_decode
        returns before the device is done, the host work the decode does not need (engine.step).

        The batch goes to llama.cpp in sequence order: it splits a batch into passes of consecutive
        sequences as it holds them (engine.layout; sequences 1, 2, 3, 0 made two passes, 28.4 ms
        against 25.2 on SmolLM2)."""
        n = reads = 0
        for _, tokens, read in parts:  # loops, not sums over generators: ~8 us less a step after a decode
            n, reads = n + len(tokens), reads + read
        if n > self.n_batch:
            raise EngineError(f"batch of {n} exceeds n_batch {self.n_batch}")
        for seq, tokens, _ in parts:
            have = len(self._held[seq].tokens)
            if have + len(tokens) > self.n_ctx:
                raise ContextFull(f"{have + len(tokens)} tokens do not fit in {self.n_ctx}")
        order = sorted(range(len(parts)), key=lambda i: parts[i][0])
        self._run([parts[i] for i in order])
        if meanwhile is not None:
            meanwhile()
        out = self._logits(reads, copy)
        result: list[np.ndarray | None] = [None] * len(parts)
        at = 0
        for i in order:
            read = parts[i][2]
            result[i] = (out if read == reads else out[at : at + read]) if read else None
            at += read
        return result

    def _logits(self, rows: int, copy: bool = True) -> np.ndarray:
        ptr = on_device(C.llama_get_logits, self.ctx)  # waits for the device (a GPU's decode returns early)
        # The array is made again only where llama.cpp moved the buffer (as_array took ~50 us a step).
        at = ctypes.addressof(ptr.contents) if ptr else 0
        if at != self._view_at or rows > len(self._view):
            self._view, self._view_at = np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab)), at
        view = self._view if rows == len(self._view) else self._view[:rows]
        return view.copy() if copy else view

    def _extend(self, seq: int, tokens: Sequence[int]) -> None:
        h = self._held[seq]
        grows = h.fresh == len(h.tokens)  # entries after a shifted stretch stay unfresh
        h.tokens.extend(tokens)
        if grows:
            h.fresh = len(h.tokens)

    def synchronize(self) -> None:
        """Wait until queued work is done. On a GPU llama_decode can return before the device
        finishes, and only reading logits waits; a timing that ends after a prefill needs this."""
        on_device(C.llama_synchronize, self.ctx)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            C.llama_batch_free(self._batch)
            C.llama_free(self.ctx)

