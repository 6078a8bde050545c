"""What an Ollama manifest's config blob names: a built-in parser, a renderer, capabilities.

The daemon honours the parsers it implements (qwen3, harmony for gpt-oss), and for a built-in
renderer it does not implement it renders with the GGUF's own chat template and says so by name
in `sidecar check`, the load log and /sidecar/status."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sidecar.cli import cmd_check
from tests.conftest import Daemon, write_config
from tests.models import write_tiny_llama
from tests.stores import add_ollama_model

pytestmark = pytest.mark.daemon

T = 120
CHAT = [{"role": "user", "content": "hi"}]
HARMONY = ("{{- range .Messages }}<|start|>{{ .Role }}<|message|>{{ .Content }}<|end|>{{ end }}"
           "<|start|>assistant")
GO_LAYER = "{{ range .Messages }}[{{ .Role }}] {{ .Content }}\n{{ end }}[assistant] "


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    d = tmp_path_factory.mktemp("manifest")
    gguf = write_tiny_llama(d / "endless.gguf", seed=1, end_bias=0.0)
    store = d / "store"
    add_ollama_model(store, "registry.ollama.ai/library/qwen3x/test", gguf, template=GO_LAYER,
                     config={"model_family": "qwen3", "parser": "qwen3-thinking"})
    add_ollama_model(store, "registry.ollama.ai/library/coderx/test", gguf, template=GO_LAYER,
                     config={"renderer": "qwen3-coder", "parser": "qwen3-coder"})
    add_ollama_model(store, "registry.ollama.ai/library/ossx/test", gguf, template=HARMONY,
                     config={"model_family": "gptoss"})
    params = "{temperature: 0, num_ctx: 256, num_predict: 24}"
    cfg = write_config(d / "pairs.yaml", f"""
models: {{ollama: store}}
pairs:
  qwen3x:test: {{from: "qwen3x:test", parameters: {params}, runtime: {{num_thread: 1}}}}
  coderx:test: {{from: "coderx:test", parameters: {params}, runtime: {{num_thread: 1}}}}
  ossx:test: {{from: "ossx:test", parameters: {params}, runtime: {{num_thread: 1}}}}
""")
    daemon = Daemon(cfg)
    yield daemon, cfg
    daemon.stop()


def chat(d: Daemon, model: str, **body: object) -> dict:
    r = httpx.post(d.url + "/api/chat", timeout=T, json={"model": model, "messages": CHAT, "stream": False, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_named_parser_does_the_parsing(setup: tuple[Daemon, Path]) -> None:
    d, _ = setup
    show = httpx.post(d.url + "/api/show", timeout=T, json={"model": "qwen3x:test"}).json()
    assert "thinking" in show["capabilities"] and "tools" in show["capabilities"] and show["parser"] == "qwen3-thinking"
    body = chat(d, "qwen3x:test")
    assert body["message"]["thinking"] and body["message"]["content"] == ""  # qwen3 starts inside the thinking
    off = chat(d, "qwen3x:test", think=False)
    assert "thinking" not in off["message"] and off["message"]["content"]


def test_gpt_oss_gets_harmony(setup: tuple[Daemon, Path]) -> None:
    d, _ = setup
    show = httpx.post(d.url + "/api/show", timeout=T, json={"model": "ossx:test"}).json()
    assert "thinking" in show["capabilities"]
    chat(d, "ossx:test")  # random bytes are no harmony: the parser must not choke on them
    chat(d, "ossx:test", think="max")  # harmony knows low/medium/high; max is sent as high


def test_an_unimplemented_renderer_is_named_everywhere(setup: tuple[Daemon, Path],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    d, cfg = setup
    rendered = httpx.post(d.url + "/api/chat", timeout=T, json={
        "model": "coderx:test", "messages": CHAT, "_debug_render_only": True}).json()["_debug_info"]
    assert rendered["rendered_template"].startswith("<|im_start|>user\nhi")  # the GGUF's ChatML, not the layer
    chat(d, "coderx:test")
    status = httpx.get(d.url + "/sidecar/status", timeout=T).json()
    notes = next(p for p in status["pairs"] if p["name"] == "coderx:test")["notes"]
    assert any("renderer 'qwen3-coder' is not implemented" in n for n in notes)
    assert any("parser 'qwen3-coder' is not implemented" in n for n in notes)
    assert "renderer 'qwen3-coder' is not implemented" in d.log()
    assert cmd_check(argparse.Namespace(config=str(cfg))) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("coderx:test"))
    assert "renderer 'qwen3-coder' is not implemented" in row
    assert json.dumps(status)  # the notes are plain JSON


def test_qwen3_history_loses_its_think_blocks(setup: tuple[Daemon, Path]) -> None:
    """routes.go filterThinkTags: earlier assistant turns of qwen3 and deepseek-r1 drop <think>...</think>."""
    d, _ = setup
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>hmm</think>the answer"},
               {"role": "user", "content": "b"}]
    for model, kept in (("qwen3x:test", False), ("coderx:test", True)):
        rendered = httpx.post(d.url + "/api/chat", timeout=T, json={
            "model": model, "messages": history, "_debug_render_only": True}).json()["_debug_info"]
        assert ("<think>hmm</think>" in rendered["rendered_template"]) is kept
        assert "the answer" in rendered["rendered_template"]
