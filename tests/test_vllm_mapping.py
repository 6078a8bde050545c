"""A vLLM pair's declaration in vLLM's terms, without a server: pairs.yaml errors, the server's
command line, speculative_config, the sampling parameters and the counters read back.

Pure mapping, so no vLLM is needed; tests/test_vllm.py runs the same pairs on a real server."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from sidecar.config.entries import build_entry
from sidecar.config.loader import ConfigError, parse
from sidecar.engine.sampling import SamplingParams
from sidecar.models.resolve import ModelNotFound
from sidecar.runtime.contract import Generation
from sidecar.runtime.options import Effective
from sidecar.runtime.vllm import command
from sidecar.runtime.vllm.client import parse_spec_counters
from sidecar.runtime.vllm.engine import request_body

pytestmark = pytest.mark.model

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A model folder as transformers writes one (no weights: nothing here loads them)."""
    d = tmp_path / "smol"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 8192,
                                               "num_hidden_layers": 30, "vocab_size": 49152}))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}}))
    (d / "model.safetensors").write_bytes(b"\0" * 1000)
    return d


def entry_of(text: str, base: Path, name: str = "smol:vllm"):
    return build_entry(name, parse(text).pairs[name], base)


def test_a_folder_reads_as_gguf_metadata(folder: Path) -> None:
    e = entry_of(f"pairs:\n  smol:vllm:\n    from: {folder}\n    engine: vllm\n", folder.parent)
    assert e.metadata["general.architecture"] == "llama"
    assert e.metadata["llama.context_length"] == 8192
    assert e.metadata["tokenizer.chat_template"] == TEMPLATE
    assert e.metadata["tokenizer.eos_token"] == "<|im_end|>"
    assert e.size == 1000
    assert e.num_ctx(None) == 4096  # the daemon's default window, within the model's training


def test_a_folder_on_llama_cpp_says_what_loads_it(folder: Path) -> None:
    with pytest.raises(ModelNotFound, match="only `engine: vllm` pairs load"):
        entry_of(f"pairs:\n  smol:vllm:\n    from: {folder}\n", folder.parent)


@pytest.mark.parametrize(("body", "where", "says"), [
    ("    vllm: {tensor_parallel_size: 2}\n", "4: pairs.smol:vllm.vllm:", "need `engine: vllm`"),
    ("    engine: vllm\n    draft: auto\n", "5: pairs.smol:vllm.draft:", "auto has no vLLM counterpart"),
    ("    engine: vllm\n    draft: [ngram, ./d.gguf]\n", "5: pairs.smol:vllm.draft:", "no vLLM counterpart"),
    ("    engine: vllm\n    runtime: {num_gpu: 10}\n", "5: pairs.smol:vllm.runtime:", "num_gpu is a llama.cpp"),
    ("    engine: vllm\n    vllm: {url: 'http://h:8000', tensor_parallel_size: 2}\n", "5: pairs.smol:vllm.vllm:",
     "tensor_parallel_size: a remote server"),
    ("    engine: vllm\n    draft: ngram\n    vllm: {url: 'http://h:8000'}\n", "6: pairs.smol:vllm.vllm:",
     "speculates as it was started"),
    ("    engine: vllm\n    vllm: {tensor_parallel: 2}\n", "5: pairs.smol:vllm.vllm.tensor_parallel:", "unknown key"),
    ("    engine: sglang\n", "4: pairs.smol:vllm.engine:", "'llama.cpp' or 'vllm'"),
])
def test_wrong_settings_name_file_line_and_key(body: str, where: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse("pairs:\n  smol:vllm:\n    from: ./x\n" + body, "pairs.yaml")
    assert str(e.value).startswith(f"pairs.yaml:{where}") and says in str(e.value), str(e.value)


def test_the_server_command_carries_the_pair(folder: Path) -> None:
    e = entry_of(f"""pairs:
  smol:vllm:
    from: {folder}
    engine: vllm
    parameters: {{num_ctx: 2048}}
    runtime: {{num_parallel: 8}}
    vllm: {{tensor_parallel_size: 2, pipeline_parallel_size: 3, gpu_memory_utilization: 0.8, dtype: float32,
            enforce_eager: true, args: [--seed, '1']}}
""", folder.parent)
    args = command.serve_args(e, e.num_ctx(None), 8123, False)
    pairs = dict(itertools.pairwise(args))
    assert pairs["--model"] == str(folder)
    assert pairs["--served-model-name"] == "smol:vllm"
    assert pairs["--max-model-len"] == "2048"
    assert pairs["--max-num-seqs"] == "8"
    assert pairs["--tensor-parallel-size"] == "2"
    assert pairs["--pipeline-parallel-size"] == "3"
    assert pairs["--gpu-memory-utilization"] == "0.8"
    assert pairs["--dtype"] == "float32"
    assert "--enforce-eager" in args and "--speculative-config" not in args
    assert args[-2:] == ["--seed", "1"]
    assert pairs["--scheduling-policy"] == "priority" and command.by_priority(e)  # interactive first
    assert command.command_line(e, 2048, 8123, False).split()[1:3] == ["-m", command.MODULE]
    fcfs = entry_of(f"pairs:\n  smol:vllm:\n    from: {folder}\n    engine: vllm\n"
                    "    vllm: {args: [--scheduling-policy, fcfs]}\n", folder.parent)
    assert not command.by_priority(fcfs)  # the pair's own policy wins, and no priority is sent
    assert command.serve_args(fcfs, 2048, 1, False).count("--scheduling-policy") == 1


def test_drafts_become_speculative_config(folder: Path, tmp_path: Path) -> None:
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    base = f"pairs:\n  smol:vllm:\n    from: {folder}\n    engine: vllm\n"
    ngram = entry_of(base + "    draft: {type: ngram, min_n: 2, max_n: 5}\n    speculative: {n_max: 6}\n", tmp_path)
    assert command.speculative_config(ngram, suffix=False) == {
        "method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert command.speculative_config(ngram, suffix=True) == {"method": "suffix", "num_speculative_tokens": 6}
    off = entry_of(base + "    draft: ngram\n    speculative: {cache: off}\n", tmp_path)
    assert command.speculative_config(off, suffix=True)["method"] == "ngram"
    # Without n_max, vLLM (a fixed length every step) gets 12, not the planner's reach of 64.
    assert command.speculative_config(off, suffix=True)["num_speculative_tokens"] == command.VLLM_NGRAM_TOKENS == 12
    model = entry_of(base + f"    draft: {draft}\n    speculative: {{n_max: 4}}\n", tmp_path)
    assert command.speculative_config(model, suffix=True) == {"model": str(draft), "num_speculative_tokens": 4}
    spec = command.serve_args(model, 4096, 1, False)
    assert json.loads(spec[spec.index("--speculative-config") + 1])["model"] == str(draft)
    assert command.speculative_config(entry_of(base, tmp_path), suffix=True) is None


def test_options_become_sampling_parameters() -> None:
    opts = Effective(SamplingParams(temperature=0.0, top_k=0, top_p=0.5, min_p=0.1, repeat_penalty=1.2,
                                    presence_penalty=0.3, frequency_penalty=0.4, seed=7), stop=["\n\n"])
    body = request_body("m", Generation([1, 2], opts, 10, logprobs=3, format={"type": "object"}), [1, 2], 10)
    assert body["prompt"] == [1, 2] and body["max_tokens"] == 10 and body["stream"] is True
    assert body["temperature"] == 0.0 and body["top_k"] == -1 and body["top_p"] == 0.5 and body["min_p"] == 0.1
    assert body["repetition_penalty"] == 1.2 and body["presence_penalty"] == 0.3
    assert body["frequency_penalty"] == 0.4 and body["seed"] == 7 and body["stop"] == ["\n\n"]
    assert body["logprobs"] == 3 and body["structured_outputs"] == {"json": {"type": "object"}}
    plain = request_body("m", Generation([1], Effective(SamplingParams(repeat_last_n=0, repeat_penalty=1.5)), 5,
                                         format="json"), [1], 5)
    assert plain["repetition_penalty"] == 1.0  # repeat_last_n 0 switches Ollama's penalties off
    assert "seed" not in plain and "stop" not in plain and "logprobs" not in plain
    assert plain["structured_outputs"] == {"json_object": True}
    # On a server that schedules by priority, what nobody watches waits behind streamed requests.
    quiet = Generation([1], Effective(SamplingParams()), 5)
    watched = Generation([1], Effective(SamplingParams()), 5, interactive=True)
    assert request_body("m", quiet, [1], 5, by_priority=True)["priority"] == 1
    assert "priority" not in request_body("m", watched, [1], 5, by_priority=True)
    assert "priority" not in request_body("m", quiet, [1], 5)


def test_counters_are_read_per_model() -> None:
    page = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="a:b"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="a:b"} 40.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="a:b"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="a:b",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="a:b",position="1"} 7.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="other"} 99.0
"""
    c = parse_spec_counters(page, "a:b")
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.per_pos) == (10, 40, 25, {0: 9, 1: 7})
    d = c - parse_spec_counters(page.replace("40.0", "30.0"), "a:b")
    assert d.draft_tokens == 10 and d.accepted_tokens == 0
