"""Tiny llama-architecture GGUF models for the test-suite.

Real llama.cpp (through llama-cpp-python) loads these files and decodes a token in
well under a millisecond, so tests can exercise the real engine -- tokenizer, chat
template, KV cache, speculative decoding -- without downloading a model.

Design choices (and why):

* **Byte-level SPM vocabulary.** ``<unk> <s> </s>``, the 256 byte tokens
  ``<0x00>``..``<0xFF>`` (ids 3..258), a normal ``▁`` token (SPM's escaped space),
  then the ChatML control tokens ``<|im_start|>`` / ``<|im_end|>``. Every string
  tokenizes by byte fallback, so any UTF-8 text round-trips through
  tokenize -> token_to_piece. The ``▁`` token is required: llama.cpp's SPM tokenizer
  rewrites ``" "`` to ``"▁"`` and only *normal* tokens get ``"▁"`` turned back into a
  space when detokenizing (a byte-fallback ``"▁"`` would come back as ``"▁"``).
* **EOS is ``<|im_end|>``** (as in SmolLM2), so llama.cpp reports it as
  end-of-generation and chat replies stop on it; BOS ``<s>`` is prepended
  (``add_bos_token`` true).
* **By default only "text" tokens can win the argmax.** The output-head rows of the
  control tokens, ``<unk>`` and all non-printable bytes are zero while the others
  have logits with a std of about ``out_std`` (~6), so greedy (and, in practice,
  temperature-1) generation emits printable ASCII, ``\\n``, ``▁`` and -- now and
  then -- ``<|im_end|>``: generated text is valid UTF-8 and
  ``tokenize(detokenize(ids)) == ids``. ``emit="bytes"`` lets every byte through
  (arbitrary, often invalid UTF-8); ``end_bias`` scales the ``<|im_end|>`` row
  (0 makes it unreachable).
* **Weights are drawn per tensor** from ``(seed, tensor name)``, so models that only
  differ in ``n_layer`` share their common tensors (a fewer-layer model is a true
  truncation) and ``perturb_from`` can add noise tensor by tensor.

The module only depends on numpy and ``gguf`` and uses absolute imports, so both
``from tests.models import ...`` and ``from models import ...`` work.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "CHATML_TEMPLATE",
    "EMITS",
    "VOCABS",
    "greedy_agreement",
    "last_argmax",
    "tiny_vocab",
    "write_tiny_llama",
    "write_tiny_pair",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML template (SmolLM2's, minus its default system prompt, to keep prompts short)."""

VOCABS = ("bytes", "shifted")
"""``bytes``: the canonical layout. ``shifted``: same size and special ids but the
byte tokens rotated by one (id 3 is ``<0x01>``, ..., id 258 is ``<0x00>``), so the
token texts differ from ``bytes`` at every byte id, including ids >= 5 (what
llama.cpp's draft/target compatibility check compares)."""

UNK_ID, BOS_ID, EOS_TEXT_ID = 0, 1, 2  # <unk>, <s>, </s>
BYTE0_ID = 3  # id of the first byte token
SPACE_TEXT = "\u2581"  # SPM's escaped space "▁"
# llama.cpp GGUF token types (gguf.TokenType values), spelled out to keep this module
# readable next to llama.cpp's own sources.
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6


def tiny_vocab(vocab: str = "bytes", n_extra_tokens: int = 0) -> tuple[list[str], list[int]]:
    """Return ``(token texts, token types)`` of a tiny vocabulary.

    Ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>``, 3..258 byte tokens, 259 ``▁``,
    260 ``<|im_start|>``, 261 ``<|im_end|>``, then ``n_extra_tokens`` unreachable
    normal tokens ``<extra_N>`` (to get a different vocabulary size while all
    shared ids keep their text).
    """
    if vocab not in VOCABS:
        raise ValueError(f"vocab must be one of {VOCABS}, got {vocab!r}")
    shift = 1 if vocab == "shifted" else 0
    texts = ["<unk>", "<s>", "</s>"]
    texts += [f"<0x{(b + shift) % 256:02X}>" for b in range(256)]
    texts += [SPACE_TEXT, "<|im_start|>", "<|im_end|>"]
    texts += [f"<extra_{i}>" for i in range(n_extra_tokens)]
    types = [_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256 + [_NORMAL, _CONTROL, _CONTROL]
    types += [_NORMAL] * n_extra_tokens
    return texts, types


EMITS = ("text", "bytes")
"""What the output head can produce. ``text``: printable ASCII, ``\\n`` and ``▁``
(valid, canonical UTF-8). ``bytes``: additionally every other byte except NUL and
the space byte, i.e. arbitrary, often invalid UTF-8 -- for streaming/decoding tests."""


def _emittable_ids(texts: Sequence[str], emit: str) -> list[int]:
    """Ids of the tokens the output head may produce (see :data:`EMITS`). The space
    byte is never emitted: ``▁`` is the canonical space token, so the generated ids
    are what tokenizing their text gives back."""
    if emit not in EMITS:
        raise ValueError(f"emit must be one of {EMITS}, got {emit!r}")
    ids = []
    for i, text in enumerate(texts):
        if text.startswith("<0x") and len(text) == 6:
            b = int(text[3:5], 16)
            if 0x21 <= b <= 0x7E or b == 0x0A or (emit == "bytes" and b not in (0x00, 0x20)):
                ids.append(i)
        elif text == SPACE_TEXT:
            ids.append(i)
    return ids


def _rng(seed: int, name: str, salt: int = 0) -> np.random.Generator:
    """Independent deterministic stream per (seed, tensor name, purpose)."""
    return np.random.default_rng([seed, zlib.crc32(name.encode()), salt])


def _tensor_specs(
    n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, n_vocab: int
) -> dict[str, tuple[tuple[int, ...], float]]:
    """Name -> (numpy shape, init std); std 0 marks an RMS-norm weight (all ones).

    numpy shapes are ``(out, in)``; GGUF stores them reversed, as llama.cpp expects.
    The stds keep every sub-layer at roughly unit gain, with a stronger q/k so
    attention is not uniform, which makes the continuation depend on context instead
    of only on the last token.
    """
    head_dim = n_embd // n_head
    kv = n_head_kv * head_dim
    e, f = n_embd**-0.5, n_ff**-0.5
    specs: dict[str, tuple[tuple[int, ...], float]] = {
        "token_embd.weight": ((n_vocab, n_embd), 1.0),
        "output_norm.weight": ((n_embd,), 0.0),
        "output.weight": ((n_vocab, n_embd), e),
    }
    for i in range(n_layer):
        p = f"blk.{i}."
        specs |= {
            p + "attn_norm.weight": ((n_embd,), 0.0),
            p + "attn_q.weight": ((n_embd, n_embd), 4.0 * e),
            p + "attn_k.weight": ((kv, n_embd), 4.0 * e),
            p + "attn_v.weight": ((kv, n_embd), e),
            p + "attn_output.weight": ((n_embd, n_embd), e),
            p + "ffn_norm.weight": ((n_embd,), 0.0),
            p + "ffn_gate.weight": ((n_ff, n_embd), e),
            p + "ffn_up.weight": ((n_ff, n_embd), e),
            p + "ffn_down.weight": ((n_embd, n_ff), f),
        }
    return specs


def _draw(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    if std == 0.0:
        return np.ones(shape, dtype=np.float32)
    return (_rng(seed, name).standard_normal(shape) * std).astype(np.float32)


def write_tiny_llama(
    path: Path,
    *,
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 2048,
    chat_template: str | None = CHATML_TEMPLATE,
    name: str = "tiny",
    perturb_from: tuple[int, float] | None = None,
    vocab: str = "bytes",
    n_extra_tokens: int = 0,
    out_std: float = 6.0,
    end_bias: float = 1.0,
    n_identity_layers: int = 0,
    emit: str = "text",
) -> Path:
    """Write a tiny random-weight llama GGUF (F32 tensors) to ``path`` and return it.

    ``seed`` picks the weights. ``perturb_from=(base_seed, eps)`` instead takes the
    weights of model ``base_seed`` and adds ``eps * std * noise(seed)`` to every
    matrix (norms stay 1), giving a draft whose greedy choices mostly agree with the
    base model. Random models have small argmax margins, so eps must be small:
    eps 0.01 agrees on ~80-85% of positions, 0.02 ~75%, 0.05 ~55%, 0.3 ~10%.
    ``n_identity_layers`` appends that many layers whose ``attn_output`` and
    ``ffn_down`` are zero: they cost compute but leave the function unchanged (a
    costlier target computing exactly the same logits).
    ``vocab``/``n_extra_tokens``: see :data:`VOCABS` and :func:`tiny_vocab`.
    ``out_std`` is the logit std of text tokens (large -> confident, non-degenerate
    greedy output); ``end_bias`` scales the ``<|im_end|>`` output row (0: never
    emitted, 1: as likely as any text token). ``emit``: see :data:`EMITS`.
    """
    import gguf  # imported here so collecting tests does not require gguf

    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must be divisible by n_head, n_head by n_head_kv")
    texts, types = tiny_vocab(vocab, n_extra_tokens)
    n_vocab = len(texts)
    im_end = texts.index("<|im_end|>")

    n_total = n_layer + n_identity_layers
    specs = _tensor_specs(n_total, n_embd, n_head, n_head_kv, n_ff, n_vocab)
    base_seed = perturb_from[0] if perturb_from else seed
    tensors: dict[str, np.ndarray] = {}
    for tname, (shape, std) in specs.items():
        # Draw shared-vocab rows with the base vocab size so n_extra_tokens does not
        # change the weights of the common tokens.
        per_token = tname in ("token_embd.weight", "output.weight")
        draw_shape = (n_vocab - n_extra_tokens, shape[1]) if per_token else shape
        w = _draw(base_seed, tname, draw_shape, std)
        if perturb_from and std:
            w += perturb_from[1] * std * _rng(seed, tname, salt=1).standard_normal(draw_shape).astype(np.float32)
        if draw_shape != shape:
            w = np.concatenate([w, np.zeros((n_extra_tokens, *shape[1:]), np.float32)])
        tensors[tname] = w

    for i in range(n_layer, n_total):
        tensors[f"blk.{i}.attn_output.weight"][:] = 0.0
        tensors[f"blk.{i}.ffn_down.weight"][:] = 0.0

    keep = np.zeros(n_vocab, dtype=np.float32)
    keep[_emittable_ids(texts, emit)] = 1.0
    keep[im_end] = end_bias
    tensors["output.weight"] *= (out_std * keep)[:, None]

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_total)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(texts)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types)
    w.add_unk_token_id(UNK_ID)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(im_end)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for tname, arr in tensors.items():
        w.add_tensor(tname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_pair(
    dir: Path,
    *,
    seed: int = 0,
    draft_eps: float = 0.01,
    target_identity_layers: int = 2,
    **kwargs: object,
) -> tuple[Path, Path]:
    """Write an aligned (target, draft) pair into ``dir`` and return their paths.

    The draft is model ``seed`` with ``draft_eps``-scaled noise on every matrix
    (same vocabulary), so its greedy choices agree with the target's most of the
    time but not always (~80-85% at the default eps) -- speculative decoding then
    both accepts and rejects drafted tokens. The target is model ``seed`` itself plus
    ``target_identity_layers`` zero-output layers, so it has more layers and costs
    more per token than the draft, like a real pair. ``kwargs`` (e.g. ``end_bias``,
    ``n_layer``) go to both :func:`write_tiny_llama` calls.
    """
    dir = Path(dir)
    target = write_tiny_llama(
        dir / f"tiny-target-s{seed}.gguf",
        seed=seed,
        name="tiny-target",
        n_identity_layers=target_identity_layers,
        **kwargs,  # type: ignore[arg-type]
    )
    draft = write_tiny_llama(
        dir / f"tiny-draft-s{seed}-e{draft_eps:g}.gguf",
        seed=seed + 1000,
        perturb_from=(seed, draft_eps),
        name="tiny-draft",
        **kwargs,  # type: ignore[arg-type]
    )
    return target, draft


def last_argmax(llm: object) -> int:
    """Argmax of the logits of the last token evaluated by ``Llama.eval``.

    Reads llama.cpp's output buffer directly: llama-cpp-python 0.3.x only fills
    ``Llama.scores`` when the model was loaded with ``logits_all=True``."""
    import llama_cpp

    n_vocab = llm.n_vocab()  # type: ignore[attr-defined]
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # type: ignore[attr-defined]
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))


def greedy_agreement(
    target: Path,
    draft: Path,
    prompts: Sequence[str],
    n_tokens: int = 32,
    n_ctx: int = 256,
    n_threads: int = 1,
) -> float:
    """Fraction of positions where the draft's argmax equals the target's along the
    target's greedy continuation of each prompt (what greedy speculative decoding
    would accept per drafted token). Needs llama_cpp; meant for tests and reports.
    One thread: on a busy 2-core machine, 2 spinning ggml threads per decode are
    ~50x slower than one for models this small."""
    import llama_cpp

    def load(p: Path) -> llama_cpp.Llama:
        return llama_cpp.Llama(str(p), n_ctx=n_ctx, n_threads=n_threads, n_batch=n_ctx, logits_all=True, verbose=True)

    tgt, drf = load(target), load(draft)
    hits = total = 0
    for prompt in prompts:
        toks = tgt.tokenize(prompt.encode(), add_bos=True, special=True)
        tgt.reset()
        tgt.eval(toks)
        cont: list[int] = []
        for _ in range(n_tokens):
            tok = last_argmax(tgt)
            cont.append(tok)
            tgt.eval([tok])
        drf.reset()
        drf.eval(toks + cont[:-1])
        rows = drf.scores[len(toks) - 1 : len(toks) - 1 + n_tokens]
        hits += int(np.sum(np.argmax(rows, axis=1) == np.array(cont)))
        total += n_tokens
    for m in (tgt, drf):
        m.close()
    return hits / total
