"""pairs.yaml: what parses into which types, and errors that point at file:line and the dotted key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from sidecar.config.loader import BUNDLED, ConfigError, default_path, load, parse
from sidecar.config.schema import Config, ModelDraft, NgramDraft
from sidecar.engine.adaptive import NGRAM_N_MAX, SpeculativeConfig

pytestmark = pytest.mark.model

HEAD = "pairs:\n  a:b:\n    from: t.gguf\n"  # lines 1-3 of most examples


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pairs.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def load_text(tmp_path: Path, text: str) -> Config:
    return load(write(tmp_path, text))


def error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load(path)
    message = str(e.value)
    assert message.startswith(f"{path}:")
    return message.removeprefix(f"{path}:")


# -- what parses -----------------------------------------------------------------------------------


def test_bundled_pairs_yaml_parses() -> None:
    config = load(BUNDLED)
    pair = config.pairs["smollm2:135m"]
    assert pair.from_.endswith(".gguf")
    assert isinstance(pair.draft, NgramDraft)
    assert pair.parameters.temperature == 0.7
    assert pair.parameters.num_ctx == 4096


def test_default_path_prefers_explicit_then_local_then_bundled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert default_path() == BUNDLED
    assert default_path("other.yaml") == Path("other.yaml")
    (tmp_path / "pairs.yaml").write_text("pairs: {}\n")
    assert default_path() == Path("pairs.yaml")


def test_a_minimal_pair_gets_defaults(tmp_path: Path) -> None:
    config = load_text(tmp_path, """
        pairs:
          llama3.1:8b-spec:
            from: llama3.1:8b
    """)
    pair = config.pairs["llama3.1:8b-spec"]
    assert pair.from_ == "llama3.1:8b"  # not a YAML 1.1 sexagesimal number
    assert pair.draft is None
    assert pair.speculative.engine() == SpeculativeConfig()
    assert pair.runtime.num_gpu == -1 and pair.runtime.num_batch == 512
    assert pair.messages == [] and pair.template is None


def test_an_ngram_pair_drafts_longer_by_default(tmp_path: Path) -> None:
    """Copied stretches run long and n-gram drafts cost nothing: n_max defaults to NGRAM_N_MAX."""
    pair = load_text(tmp_path, "pairs:\n  a:b:\n    from: x.gguf\n    draft: ngram\n").pairs["a:b"]
    assert pair.speculative.engine(ngram=True).n_max == NGRAM_N_MAX > SpeculativeConfig.n_max
    pair = load_text(tmp_path, "pairs:\n  a:b:\n    from: x.gguf\n    speculative: {n_max: 5}\n").pairs["a:b"]
    assert pair.speculative.engine(ngram=True).n_max == 5


def test_n_min_is_checked_against_the_n_max_the_pair_gets(tmp_path: Path) -> None:
    """Without n_max, n_min may go up to the draft kind's default n_max (8, or NGRAM_N_MAX for n-gram)."""
    ok = load_text(tmp_path, "pairs:\n  a:b:\n    from: x.gguf\n    draft: ngram\n    speculative: {n_min: 10}\n")
    assert ok.pairs["a:b"].speculative.engine(ngram=True).n_min == 10
    msg = error(tmp_path, "pairs:\n  a:b:\n    from: x.gguf\n    draft: y.gguf\n    speculative: {n_min: 10}\n")
    assert "n_min 10 exceeds the default n_max 8" in msg


def test_an_empty_file_has_no_pairs(tmp_path: Path) -> None:
    assert load_text(tmp_path, "# nothing yet\n").pairs == {}


@pytest.mark.parametrize("draft", ["ngram", "{type: ngram}"])
def test_draft_ngram(tmp_path: Path, draft: str) -> None:
    config = load_text(tmp_path, HEAD + f"    draft: {draft}\n")
    d = config.pairs["a:b"].draft
    assert isinstance(d, NgramDraft) and (d.min_n, d.max_n) == (2, 4)


@pytest.mark.parametrize("draft", ["none", "null", "~"])
def test_draft_none(tmp_path: Path, draft: str) -> None:
    config = load_text(tmp_path, HEAD + f"    draft: {draft}\n")
    assert config.pairs["a:b"].draft is None


def test_draft_path(tmp_path: Path) -> None:
    config = load_text(tmp_path, HEAD + "    draft: models/d.gguf\n")
    d = config.pairs["a:b"].draft
    assert isinstance(d, ModelDraft)
    assert d.from_ == "models/d.gguf" and d.num_gpu == -1


def test_draft_ngram_with_sizes(tmp_path: Path) -> None:
    config = load_text(tmp_path, """
        pairs:
          a:b:
            from: t.gguf
            draft: {type: ngram, min_n: 2, max_n: 5}
    """)
    d = config.pairs["a:b"].draft
    assert isinstance(d, NgramDraft) and (d.min_n, d.max_n) == (2, 5)


def test_draft_model_with_runtime_settings(tmp_path: Path) -> None:
    config = load_text(tmp_path, """
        pairs:
          a:b:
            from: t.gguf
            draft: {from: x.gguf, num_gpu: 0}
    """)
    d = config.pairs["a:b"].draft
    assert isinstance(d, ModelDraft)
    assert d.from_ == "x.gguf" and d.num_gpu == 0


@pytest.mark.parametrize(("stop", "expected"), [
    ('"<|im_end|>"', ["<|im_end|>"]),
    ('["\\n\\n", "User:"]', ["\n\n", "User:"]),
    ("\n        - a\n        - b", ["a", "b"]),
])
def test_parameters_stop_accepts_a_string_or_a_list(tmp_path: Path, stop: str, expected: list[str]) -> None:
    config = load_text(tmp_path, HEAD + f"    parameters:\n      stop: {stop}\n")
    assert config.pairs["a:b"].parameters.stop == expected


def test_a_full_pair(tmp_path: Path) -> None:
    config = load_text(tmp_path, """
        listen: 127.0.0.1:11435
        upstream: http://127.0.0.1:11434
        models: {ollama: ~/.ollama/models}
        pairs:
          qwen2.5:7b-spec:
            from: qwen2.5:7b
            draft: qwen2.5:0.5b
            system: Be brief.
            template: "{{ .Prompt }}"
            messages:
              - {role: user, content: hi}
              - {role: assistant, content: hello}
            parameters: {temperature: 0.2, top_k: 20, seed: 3}
            speculative: {n_max: 12, p_min: 0.3, fallback_margin: 1.0}
            runtime: {num_thread: 2, kv_cache_type: q8_0, flash_attn: true}
    """)
    pair = config.pairs["qwen2.5:7b-spec"]
    assert isinstance(pair.draft, ModelDraft) and pair.draft.from_ == "qwen2.5:0.5b"
    assert [m.role for m in pair.messages] == ["user", "assistant"]
    assert pair.speculative.engine().n_max == 12
    assert pair.runtime.kv_cache_type == "q8_0"
    assert config.listen == "127.0.0.1:11435"
    assert config.models == {"ollama": "~/.ollama/models"}


# -- what does not, and where it says so -----------------------------------------------------------


def test_a_pair_name_needs_a_tag(tmp_path: Path) -> None:
    msg = error(tmp_path, "pairs:\n  llama3:\n    from: t.gguf\n")
    assert msg.startswith("2: pairs.llama3:")
    assert "'llama3'" in msg and "explicit tag" in msg


def test_a_bad_pair_name_points_at_its_own_line(tmp_path: Path) -> None:
    """The second pair's name is wrong: the error must name line 4, not the first pair's line 2."""
    msg = error(tmp_path, """
        pairs:
          good:1b:
            from: t.gguf
          llama3:
            from: t.gguf
    """)
    assert "'llama3'" in msg
    assert msg.startswith("4:"), msg


@pytest.mark.parametrize(("text", "line", "key"), [
    ("listen2: x\n", 1, "listen2"),
    (HEAD + "    temprature: 3\n", 4, "pairs.a:b.temprature"),
    (HEAD + "    parameters:\n      top_kk: 3\n", 5, "pairs.a:b.parameters.top_kk"),
    (HEAD + "    speculative: {n_max: 3, nmin: 1}\n", 4, "pairs.a:b.speculative.nmin"),
    (HEAD + "    draft:\n      from: d.gguf\n      num_gpuu: 0\n", 6, "pairs.a:b.draft.num_gpuu"),
    (HEAD + "    draft: {type: ngram, max: 3}\n", 4, "pairs.a:b.draft.max"),
])
def test_unknown_keys_name_the_line_and_the_dotted_key(
    tmp_path: Path, text: str, line: int, key: str
) -> None:
    assert error(tmp_path, text) == f"{line}: {key}: unknown key"


def test_an_unknown_key_holding_a_mapping_points_at_the_key(tmp_path: Path) -> None:
    """`speculativ:` (a typo) is on line 4; its mapping starts on line 5. The key's line is wanted."""
    msg = error(tmp_path, """
        pairs:
          a:b:
            from: t.gguf
            speculativ:
              n_max: 3
    """)
    assert msg == "4: pairs.a:b.speculativ: unknown key"


def test_a_missing_from_names_the_pair(tmp_path: Path) -> None:
    msg = error(tmp_path, "pairs:\n  a:b:\n    draft: ngram\n")
    assert "pairs.a:b.from: Field required" in msg
    assert msg.split(":")[0] in ("2", "3")


def test_adapter_is_a_clear_error(tmp_path: Path) -> None:
    msg = error(tmp_path, HEAD + "    adapter: lora.gguf\n")
    assert msg.startswith("4: pairs.a:b.adapter:")
    assert "ADAPTER (LoRA) is not supported" in msg


def test_invalid_yaml_reports_a_line(tmp_path: Path) -> None:
    msg = error(tmp_path, HEAD + "    draft: [ngram\n    x: 1\n")
    assert msg.split(":")[0].isdigit()
    assert "not valid YAML" in msg
    msg = error(tmp_path, HEAD + "   bad: 1\n")
    assert msg.startswith("4: not valid YAML")


def test_duplicate_keys_are_reported(tmp_path: Path) -> None:
    assert error(tmp_path, HEAD + "    from: u.gguf\n") == "4: duplicate key 'from'"
    msg = error(tmp_path, "pairs:\n  a:b:\n    from: t.gguf\n  a:b:\n    from: u.gguf\n")
    assert msg == "4: duplicate key 'a:b'"


def test_the_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    assert error(tmp_path, "- a\n- b\n") == "1: the file must be a mapping with a 'pairs:' key"


def test_an_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.yaml")


@pytest.mark.parametrize(("setting", "line_key"), [
    ("n_max: 0", "pairs.a:b.speculative.n_max"),
    ("n_max: 65", "pairs.a:b.speculative.n_max"),
    ("n_min: 0", "pairs.a:b.speculative.n_min"),
    ("p_min: 1.5", "pairs.a:b.speculative.p_min"),
    ("min_predict: -1", "pairs.a:b.speculative.min_predict"),
    ("fallback_rounds: 0", "pairs.a:b.speculative.fallback_rounds"),
    ("fallback_margin: 0", "pairs.a:b.speculative.fallback_margin"),
    ("fallback_margin: 2.5", "pairs.a:b.speculative.fallback_margin"),
    ("probe_interval: 0", "pairs.a:b.speculative.probe_interval"),
])
def test_speculative_values_out_of_range_are_rejected(tmp_path: Path, setting: str, line_key: str) -> None:
    msg = error(tmp_path, HEAD + f"    speculative:\n      {setting}\n")
    assert msg.startswith(f"5: {line_key}: ")


def test_speculative_n_min_above_n_max_is_rejected(tmp_path: Path) -> None:
    """n_min > n_max leaves no allowed draft length, so speculation would silently never run
    (Plan.decide returns a plain round when min(n_max, ...) < n_min); like draft min_n/max_n, refuse it."""
    msg = error(tmp_path, HEAD + "    speculative: {n_min: 10, n_max: 4}\n")
    assert "pairs.a:b.speculative" in msg and "n_min" in msg


def test_ngram_sizes_out_of_order_are_rejected(tmp_path: Path) -> None:
    msg = error(tmp_path, HEAD + "    draft: {type: ngram, min_n: 5, max_n: 2}\n")
    assert msg.startswith("4: pairs.a:b.draft:") and "min_n must not exceed max_n" in msg


@pytest.mark.parametrize(("runtime", "key"), [
    ("num_batch: 8", "num_batch"), ("num_thread: -1", "num_thread"), ("kv_cache_type: q5_1", "kv_cache_type"),
])
def test_runtime_values_are_checked(tmp_path: Path, runtime: str, key: str) -> None:
    msg = error(tmp_path, HEAD + f"    runtime:\n      {runtime}\n")
    assert msg.startswith(f"5: pairs.a:b.runtime.{key}: ")


def test_several_errors_are_all_reported(tmp_path: Path) -> None:
    msg = error(tmp_path, """
        pairs:
          a:b:
            from: t.gguf
            parameters: {top_k: many}
            messages:
              - {role: robot, content: hi}
    """)
    lines = msg.split("\n")
    assert len(lines) == 2
    assert "4: pairs.a:b.parameters.top_k: " in msg
    assert ":6: pairs.a:b.messages.0.role: " in msg


def test_parse_names_its_source() -> None:
    with pytest.raises(ConfigError, match=r"^<string>:1: listen2: unknown key$"):
        parse("listen2: 1\n")
    with pytest.raises(ConfigError, match=r"^cfg\.yaml:1: listen2: unknown key$"):
        parse("listen2: 1\n", "cfg.yaml")


def test_flash_attention_defaults_on_only_where_layers_sit_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.config import schema

    monkeypatch.setattr(schema, "gpu_offload_supported", lambda: False)
    assert not schema.LoadSettings().flash  # a CPU build keeps exact equality
    assert schema.LoadSettings(flash_attn=True).flash  # unless asked for speed
    monkeypatch.setattr(schema, "gpu_offload_supported", lambda: True)
    assert schema.LoadSettings().flash
    assert not schema.LoadSettings(num_gpu=0).flash  # a GPU build with the model on the CPU
    assert not schema.LoadSettings(flash_attn=False).flash
