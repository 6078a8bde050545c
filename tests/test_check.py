"""`sidecar check`: validate, resolve, check pairings, print a table; never serve. And the worked
examples in modelfiles/, which must stay valid pairs.yaml."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.cli import cmd_check
from sidecar.config.loader import load, load_file
from sidecar.templates.chat import GoChatTemplate
from tests.conftest import REPO
from tests.models import write_tiny_llama, write_tiny_pair
from tests.stores import add_ollama_model

pytestmark = pytest.mark.model

MODELFILES = sorted((REPO / "modelfiles").glob("*.yaml"))


@pytest.mark.parametrize("path", MODELFILES, ids=lambda p: p.name)
def test_every_modelfile_is_valid_pairs_yaml(path: Path) -> None:
    config = load(path)
    assert config.pairs, f"{path.name} declares no pair"
    prepared = load_file(path)  # store locations too; the models themselves need not be here
    assert set(prepared.entries) | set(prepared.errors) == set(config.pairs)
    for pair in config.pairs.values():
        if pair.template:
            GoChatTemplate(pair.template)  # parses as an Ollama Go template


def test_the_worked_examples_are_there() -> None:
    names = {p.name for p in MODELFILES}
    assert {"llama3.1-70b-spec.yaml", "lmstudio-qwen-coder.yaml", "ngram-editing.yaml"} <= names


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("check")
    write_tiny_pair(d, seed=7)
    write_tiny_llama(d / "shifted.gguf", seed=8, vocab="shifted")  # same size, other token texts
    add_ollama_model(d / "store", "registry.ollama.ai/library/tiny/7b", d / "tiny-target-s7.gguf")
    return d


def check(cfg: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cmd_check(argparse.Namespace(config=str(cfg)))
    out, err = capsys.readouterr()
    return rc, out, err


def write(models: Path, name: str, text: str) -> Path:
    cfg = models / name
    cfg.write_text(text)
    return cfg


def test_a_good_config_passes(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(models, "good.yaml", """
models: {ollama: store}
pairs:
  spec:test:
    from: tiny-target-s7.gguf
    draft: tiny-draft-s7-e0.01.gguf
  store:test:
    from: tiny:7b
    draft: {type: ngram, max_n: 3}
  plain:test:
    from: tiny:7b
""")
    rc, out, _ = check(cfg, capsys)
    assert rc == 0, out
    rows = out.splitlines()
    assert rows[0].split() == ["PAIR", "TARGET", "DRAFT", "STATUS"]
    assert rows[1].split() == ["spec:test", str(models / "tiny-target-s7.gguf"),
                               str(models / "tiny-draft-s7-e0.01.gguf"), "ok"]
    assert rows[2].split()[0] == "store:test" and rows[2].split()[2:] == ["ngram", "ok"]
    assert "/blobs/sha256-" in rows[2]
    assert rows[3].split()[2:] == ["none", "ok"]
    assert rows[-1] == f"{cfg}: ok"


def test_schema_errors_name_file_line_and_key(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(models, "typo.yaml", "pairs:\n  a:1:\n    from: x.gguf\n    paramters: {}\n")
    rc, out, err = check(cfg, capsys)
    assert rc == 1 and out == ""
    assert f"{cfg}:4: pairs.a:1.paramters: unknown key" in err


def test_a_missing_model_fails_but_the_others_are_listed(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(models, "missing.yaml", """
models: {ollama: store}
pairs:
  ok:test:
    from: tiny:7b
  gone:test:
    from: llama3.1:70b
""")
    rc, out, _ = check(cfg, capsys)
    assert rc == 1
    ok_row = next(r for r in out.splitlines() if r.startswith("ok:test"))
    gone_row = next(r for r in out.splitlines() if r.startswith("gone:test"))
    assert ok_row.endswith("ok")
    assert "error: model 'llama3.1:70b' not found in the Ollama store" in gone_row and str(models / "store") in gone_row
    assert out.splitlines()[-1] == f"{cfg}: problems found"


def test_an_incompatible_draft_fails(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(models, "mismatch.yaml", "pairs:\n  bad:test:\n    from: tiny-target-s7.gguf\n"
                                         "    draft: shifted.gguf\n")
    rc, out, _ = check(cfg, capsys)
    assert rc == 1
    assert "error: draft shifted.gguf cannot speculate for target tiny-target-s7.gguf: token 5 differs" in out


def test_check_never_starts_the_server(models: Path) -> None:
    cfg = write(models, "cli.yaml", "pairs:\n  t:1:\n    from: tiny-target-s7.gguf\n")
    r = subprocess.run([sys.executable, "-m", "sidecar.cli", "check", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == f"{cfg}: ok"
    assert "listening" not in r.stdout + r.stderr
