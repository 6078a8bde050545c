"""The tiny GGUF factory (tests/models.py) produces models real llama.cpp can use.

Everything else in the suite trusts these models, so check the properties it relies
on: they load, text round-trips byte-exactly, chat templates render, chat turns end
on ``<|im_end|>``, greedy output is varied, and drafts agree as advertised.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from tests.models import (  # noqa: E402
    CHATML_TEMPLATE,
    greedy_agreement,
    last_argmax,
    tiny_vocab,
    write_tiny_llama,
    write_tiny_pair,
)

TEXT = "héllo ✓ 日本\n\ttabs  and  spaces <b>&</b> ~end"
IM_START, IM_END = 260, 261
CHAT_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def load(path: Path, n_ctx: int = 256) -> llama_cpp.Llama:
    # verbose=False is buggy in llama-cpp-python 0.3.x; one thread avoids spin-wait
    # slowdowns on a busy 2-core machine.
    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=1, verbose=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="module")
def tiny(model_dir: Path) -> Iterator[llama_cpp.Llama]:
    llm = load(write_tiny_llama(model_dir / "tiny.gguf"))
    yield llm
    llm.close()


def vocab_texts(llm: llama_cpp.Llama) -> list[bytes]:
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return [llama_cpp.llama_vocab_get_text(vocab, i) for i in range(llm.n_vocab())]


def piece(llm: llama_cpp.Llama, token: int) -> bytes:
    """llama.cpp's token_to_piece (llama-cpp-python's wrapper returns the whole buffer)."""
    buf = (ctypes.c_char * 64)()
    n = llama_cpp.llama_token_to_piece(llama_cpp.llama_model_get_vocab(llm.model), token, buf, len(buf), 0, False)
    return bytes(buf[:n])


def greedy(llm: llama_cpp.Llama, prompt: str, n: int) -> list[int]:
    llm.reset()
    llm.eval(llm.tokenize(prompt.encode(), add_bos=True, special=True))
    out: list[int] = []
    for _ in range(n):
        out.append(last_argmax(llm))
        llm.eval([out[-1]])
    return out


def test_layout_and_special_tokens(tiny: llama_cpp.Llama) -> None:
    texts, _ = tiny_vocab()
    assert tiny.n_vocab() == len(texts) == 262
    assert vocab_texts(tiny) == [t.encode() for t in texts]
    vocab = llama_cpp.llama_model_get_vocab(tiny.model)
    assert tiny.token_bos() == 1
    assert tiny.token_eos() == IM_END
    assert llama_cpp.llama_vocab_is_eog(vocab, IM_END)
    assert not llama_cpp.llama_vocab_is_eog(vocab, IM_START)
    toks = tiny.tokenize(b"<|im_start|>x<|im_end|>", add_bos=False, special=True)
    assert toks == [IM_START, 3 + ord("x"), IM_END]


def test_text_round_trips_bytewise(tiny: llama_cpp.Llama) -> None:
    data = TEXT.encode()
    toks = tiny.tokenize(data, add_bos=False)
    assert tiny.detokenize(toks) == data
    assert b"".join(piece(tiny, t) for t in toks) == data  # token by token too
    assert tiny.tokenize(data, add_bos=True)[0] == 1
    # Every byte value survives on its own.
    raw = bytes(range(1, 256))
    assert tiny.detokenize(tiny.tokenize(raw, add_bos=False)) == raw


def test_greedy_output_is_varied_printable_and_canonical(model_dir: Path) -> None:
    llm = load(write_tiny_llama(model_dir / "noend.gguf", end_bias=0.0))
    try:
        for prompt in ("Hello", "The quick brown fox", CHAT_PROMPT):
            out = greedy(llm, prompt, 64)
            assert IM_END not in out  # end_bias=0: never ends by itself
            assert len(set(out)) >= 12
            assert max(len(list(g)) for _, g in itertools.groupby(out)) <= 8
            text = llm.detokenize(out).decode()
            assert all(" " <= c <= "~" or c == "\n" for c in text), text  # printable ASCII
            assert llm.tokenize(text.encode(), add_bos=False) == out  # canonical tokens
    finally:
        llm.close()


def test_emit_bytes_produces_non_ascii(model_dir: Path) -> None:
    llm = load(write_tiny_llama(model_dir / "bytes.gguf", emit="bytes", end_bias=0.0))
    try:
        out = greedy(llm, "Hello", 48)
        assert any(3 + 0x80 <= t < 3 + 0x100 for t in out)  # bytes >= 0x80
        assert all(3 <= t < 3 + 256 or t == 259 for t in out)  # still never control tokens
    finally:
        llm.close()


def test_chat_template_renders_and_reply_ends(tiny: llama_cpp.Llama) -> None:
    assert tiny.metadata["tokenizer.chat_template"] == CHATML_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ✓<|im_end|>\n<|im_start|>assistant\n"
    fmt = llama_cpp.llama_chat_format.Jinja2ChatFormatter(CHATML_TEMPLATE, eos_token="<|im_end|>", bos_token="<s>")
    assert fmt(messages=messages).prompt == expected
    # llama.cpp's built-in renderer recognizes the template as ChatML.
    tmpl = llama_cpp.llama_model_chat_template(tiny.model, None)
    assert tmpl == CHATML_TEMPLATE.encode()
    msgs = (llama_cpp.llama_chat_message * 2)(
        *(llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages)
    )
    buf = bytes(1024)
    n = llama_cpp.llama_chat_apply_template(tmpl, msgs, 2, True, buf, len(buf))
    assert buf[:n].decode() == expected
    # With the default end_bias, chat replies end on <|im_end|> for most prompts.
    reasons = []
    for p in ("Hi", "Hello there", "What is 2+2?", "Tell me a story"):
        reply = tiny.create_chat_completion([{"role": "user", "content": p}], max_tokens=200, temperature=0)
        reasons.append(reply["choices"][0]["finish_reason"])
    assert reasons.count("stop") >= 2


def test_pair_agreement_is_high_but_imperfect(model_dir: Path) -> None:
    target, draft = write_tiny_pair(model_dir, seed=0)
    prompts = ["Hello", "The quick brown fox", "1 2 3", CHAT_PROMPT]
    rate = greedy_agreement(target, draft, prompts, n_tokens=32)
    assert 0.6 <= rate <= 0.97, rate
    other = write_tiny_llama(model_dir / "other.gguf", seed=7)
    assert greedy_agreement(target, other, prompts[:1], n_tokens=24) < 0.2
    # The target's extra layers are exact identities: it computes model 0's function.
    base = write_tiny_llama(model_dir / "base0.gguf", seed=0)
    assert greedy_agreement(target, base, prompts[:1], n_tokens=24) == 1.0
    t, d = load(target), load(draft)
    assert (t.metadata["llama.block_count"], d.metadata["llama.block_count"]) == ("4", "2")
    t.close()
    d.close()


def test_shifted_and_larger_vocabs(model_dir: Path, tiny: llama_cpp.Llama) -> None:
    base = vocab_texts(tiny)
    shifted = load(write_tiny_llama(model_dir / "shifted.gguf", vocab="shifted"))
    bigger = load(write_tiny_llama(model_dir / "bigger.gguf", n_extra_tokens=200))
    try:
        s_texts, b_texts = vocab_texts(shifted), vocab_texts(bigger)
        assert len(s_texts) == len(base) and s_texts[:3] == base[:3]
        assert any(a != b for a, b in zip(s_texts[5:], base[5:], strict=True))
        assert (shifted.token_bos(), shifted.token_eos()) == (tiny.token_bos(), tiny.token_eos())
        assert len(b_texts) == len(base) + 200 and b_texts[: len(base)] == base
        for llm in (shifted, bigger):  # still fully functional tokenizers
            assert llm.detokenize(llm.tokenize(TEXT.encode(), add_bos=False)) == TEXT.encode()
    finally:
        shifted.close()
        bigger.close()


def test_deterministic(model_dir: Path) -> None:
    a = write_tiny_llama(model_dir / "a.gguf", seed=3).read_bytes()
    assert a == write_tiny_llama(model_dir / "b.gguf", seed=3).read_bytes()
    assert a != write_tiny_llama(model_dir / "c.gguf", seed=4).read_bytes()
