"""Model references against model stores built on disk: Ollama manifests and blobs, LM Studio
folders, plain paths, pkg: resources. Every GGUF here is a real (tiny) model llama.cpp loads."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sidecar.config.loader import ConfigError, load_file
from sidecar.models.resolve import ModelNotFound, Stores, parse_ollama_name, resolve
from sidecar.templates.chat import GoChatTemplate
from tests.conftest import SMOLLM2_REF, Daemon
from tests.models import write_tiny_llama
from tests.stores import add_ollama_model

pytestmark = pytest.mark.daemon

GO_TEMPLATE = "{{ if .System }}<<SYS>>{{ .System }}<</SYS>>{{ end }}{{ .Prompt }} =>"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf", seed=5)


# -- Ollama names ------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "parts"), [
    ("llama3.2", ("registry.ollama.ai", "library", "llama3.2", "latest")),
    ("llama3.1:8b", ("registry.ollama.ai", "library", "llama3.1", "8b")),
    ("user/model:tag", ("registry.ollama.ai", "user", "model", "tag")),
    ("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
     ("hf.co", "bartowski", "Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")),
    ("localhost:5000/team/model", ("localhost:5000", "team", "model", "latest")),  # a port is no tag
    ("https://hf.co/org/repo:Q8_0", ("hf.co", "org", "repo", "Q8_0")),
])
def test_ollama_names_parse_as_ollama_parses_them(name: str, parts: tuple[str, ...]) -> None:
    assert parse_ollama_name(name) == parts


@pytest.mark.parametrize("name", ["a/b/c/d", "has space", "ns.dot/model", ":tag", "model:", "-x", "m:t/x:"])
def test_invalid_ollama_names_are_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="not a valid Ollama model name"):
        resolve(name, ollama_root=tmp_path)


def test_a_library_model_with_the_default_tag(tmp_path: Path, gguf: Path) -> None:
    add_ollama_model(tmp_path, "registry.ollama.ai/library/tiny/latest", gguf)
    m = resolve("tiny", ollama_root=tmp_path)
    assert m.path.parent == tmp_path / "blobs" and m.path.name.startswith("sha256-")
    assert m.path.read_bytes() == gguf.read_bytes()
    assert m.digest and m.template is None and m.params == {} and m.messages == []
    assert resolve("tiny:latest", ollama_root=tmp_path).path == m.path


def test_names_match_case_insensitively(tmp_path: Path, gguf: Path) -> None:
    add_ollama_model(tmp_path, "registry.ollama.ai/library/TinyChat/Q4_K_M", gguf)
    assert resolve("tinychat:q4_k_m", ollama_root=tmp_path).path.is_file()
    assert resolve("TINYCHAT:Q4_K_M", ollama_root=tmp_path).path.is_file()


def test_hf_co_and_user_namespaces(tmp_path: Path, gguf: Path) -> None:
    add_ollama_model(tmp_path, "hf.co/bartowski/Tiny-GGUF/Q4_K_M", gguf, system="from hf")
    add_ollama_model(tmp_path, "registry.ollama.ai/someone/tiny/v2", gguf, system="from a user")
    assert resolve("hf.co/bartowski/Tiny-GGUF:Q4_K_M", ollama_root=tmp_path).system == "from hf"
    assert resolve("someone/tiny:v2", ollama_root=tmp_path).system == "from a user"
    with pytest.raises(ModelNotFound, match="someone/tiny/latest"):
        resolve("someone/tiny", ollama_root=tmp_path)


def test_layers_become_the_models_defaults(tmp_path: Path, gguf: Path) -> None:
    msgs = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
    add_ollama_model(tmp_path, "registry.ollama.ai/library/chat/latest", gguf, template=GO_TEMPLATE,
                     system="You are terse.", params={"temperature": 0.3, "stop": ["</s>"]}, messages=msgs,
                     extra=[("license", b"MIT"), ("projector", b"not used")])
    m = resolve("chat", ollama_root=tmp_path)
    assert (m.template, m.system, m.messages) == (GO_TEMPLATE, "You are terse.", msgs)
    assert m.params == {"temperature": 0.3, "stop": ["</s>"]}


def test_a_missing_model_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound) as e:
        resolve("llama3.1:70b", ollama_root=tmp_path)
    msg = str(e.value)
    assert str(tmp_path) in msg and "registry.ollama.ai/library/llama3.1/70b" in msg and "ollama pull" in msg


def test_a_missing_blob_and_a_non_gguf_model_layer(tmp_path: Path, gguf: Path) -> None:
    manifest = add_ollama_model(tmp_path, "registry.ollama.ai/library/gone/latest", gguf)
    digest = json.loads(manifest.read_text())["layers"][0]["digest"]
    (tmp_path / "blobs" / digest.replace(":", "-")).unlink()
    with pytest.raises(ModelNotFound, match=r"blob .* is missing"):
        resolve("gone", ollama_root=tmp_path)
    add_ollama_model(tmp_path, "registry.ollama.ai/library/mlx/latest", b'{"safetensors": true}')
    with pytest.raises(ModelNotFound, match="not a GGUF file"):
        resolve("mlx", ollama_root=tmp_path)


def test_an_adapter_layer_is_refused(tmp_path: Path, gguf: Path) -> None:
    add_ollama_model(tmp_path, "registry.ollama.ai/library/lora/latest", gguf, extra=[("adapter", b"GGUF")])
    with pytest.raises(ModelNotFound, match="ADAPTER"):
        resolve("lora", ollama_root=tmp_path)


def test_store_locations_config_then_env_then_home(tmp_path: Path, gguf: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    add_ollama_model(tmp_path / "env", "registry.ollama.ai/library/m/latest", gguf, system="env")
    add_ollama_model(tmp_path / "cfg", "registry.ollama.ai/library/m/latest", gguf, system="cfg")
    add_ollama_model(tmp_path / ".ollama" / "models", "registry.ollama.ai/library/m/latest", gguf, system="home")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    assert resolve("m").system == "home"
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "env"))
    assert resolve("m").system == "env"
    stores = Stores.from_config({"ollama": "cfg"}, base=tmp_path)  # relative to the config file
    assert resolve("m", stores=stores).system == "cfg"


def test_models_setting_in_pairs_yaml(tmp_path: Path, gguf: Path) -> None:
    add_ollama_model(tmp_path / "store", "registry.ollama.ai/library/m/latest", gguf, system="cfg")
    lm = tmp_path / "lms" / "pub" / "repo"
    lm.mkdir(parents=True)
    (lm / "x.gguf").write_bytes(gguf.read_bytes())
    cfg = tmp_path / "pairs.yaml"
    cfg.write_text("models:\n  ollama: store\n  lmstudio: lms\npairs:\n"
                   "  a:1:\n    from: m\n  b:1:\n    from: lmstudio:pub/repo\n")
    prepared = load_file(cfg)
    assert prepared.errors == {}
    assert prepared.entries["a:1"].target.system == "cfg"
    assert prepared.entries["b:1"].target.path == lm / "x.gguf"


def test_an_unknown_store_kind_is_a_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "pairs.yaml"
    cfg.write_text("pairs: {}\nmodels:\n  ollama: a\n  olama: b\n")
    with pytest.raises(ConfigError, match=re.escape(f"{cfg}:4: models.olama: unknown model store")):
        load_file(cfg)


# -- LM Studio, paths, pkg: ---------------------------------------------------------------------
def test_lmstudio_references(tmp_path: Path, gguf: Path) -> None:
    root = tmp_path / "models"
    one = root / "lmstudio-community" / "Tiny-GGUF"
    one.mkdir(parents=True)
    (one / "Tiny-Q4_K_M.gguf").write_bytes(gguf.read_bytes())
    (one / "mmproj-Tiny-F16.gguf").write_bytes(gguf.read_bytes())  # a vision projector is not a choice
    assert resolve("lmstudio:lmstudio-community/Tiny-GGUF", lmstudio_roots=[root]).path == one / "Tiny-Q4_K_M.gguf"
    (one / "Tiny-Q8_0.gguf").write_bytes(gguf.read_bytes())
    with pytest.raises(ModelNotFound, match="several GGUF files"):
        resolve("lmstudio:lmstudio-community/Tiny-GGUF", lmstudio_roots=[root])
    assert resolve("lmstudio:lmstudio-community/Tiny-GGUF/Tiny-Q8_0.gguf",
                   lmstudio_roots=[root]).path == one / "Tiny-Q8_0.gguf"
    shards = root / "pub" / "Big-GGUF"
    shards.mkdir(parents=True)
    for i in (1, 2):
        (shards / f"Big-Q4_K_M-0000{i}-of-00002.gguf").write_bytes(gguf.read_bytes())
    assert resolve("lmstudio:pub/Big-GGUF", lmstudio_roots=[root]).path.name == "Big-Q4_K_M-00001-of-00002.gguf"
    with pytest.raises(ModelNotFound, match=r"looked in .*models/pub/nothing"):
        resolve("lmstudio:pub/nothing", lmstudio_roots=[root])
    with pytest.raises(ModelNotFound, match="expected lmstudio:publisher/repo"):
        resolve("lmstudio:justone", lmstudio_roots=[root])


def test_lmstudio_default_folders(tmp_path: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    old = tmp_path / ".cache" / "lm-studio" / "models" / "pub" / "repo"  # before LM Studio 0.3.8
    old.mkdir(parents=True)
    (old / "m.gguf").write_bytes(gguf.read_bytes())
    assert resolve("lmstudio:pub/repo").path == old / "m.gguf"
    new = tmp_path / ".lmstudio" / "models" / "pub" / "repo"
    new.mkdir(parents=True)
    (new / "m.gguf").write_bytes(gguf.read_bytes())
    assert resolve("lmstudio:pub/repo").path == new / "m.gguf"  # the current folder comes first


def test_paths_and_pkg_resources(tmp_path: Path, gguf: Path) -> None:
    assert resolve(str(gguf)).path == gguf
    assert resolve(f"./{gguf.name}", base=gguf.parent).path == gguf
    (tmp_path / "fake.gguf").write_bytes(b"not a model")
    with pytest.raises(ModelNotFound, match="not a GGUF file"):
        resolve("fake.gguf", base=tmp_path)
    with pytest.raises(ModelNotFound, match="no such file"):
        resolve("absent.gguf", base=tmp_path)
    assert resolve(SMOLLM2_REF).path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(ModelNotFound, match="not installed"):
        resolve("pkg:no_such_package_here/x.gguf")


# -- through the daemon --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store_daemon(tmp_path_factory: pytest.TempPathFactory, gguf: Path) -> Iterator[Daemon]:
    d = tmp_path_factory.mktemp("stores")
    add_ollama_model(d / "store", "registry.ollama.ai/library/tinychat/latest", gguf, template=GO_TEMPLATE,
                     system="You are terse.", params={"temperature": 0, "num_predict": 4, "num_ctx": 256})
    add_ollama_model(d / "envstore", "hf.co/org/Tiny-GGUF/Q4_K_M", gguf, params={"num_predict": 3})
    cfg = d / "pairs.yaml"
    cfg.write_text("""
models:
  ollama: ./store
pairs:
  chat:ollama:
    from: TinyChat          # case-insensitive, default tag latest
    runtime: {num_thread: 1}
  chat:override:
    from: tinychat:latest
    template: "{{ .Prompt }} ->"   # the pair's template beats the store's
    runtime: {num_thread: 1}
""")
    env_cfg = d / "env" / "pairs.yaml"
    env_cfg.parent.mkdir()
    env_cfg.write_text("pairs:\n  hf:tiny:\n    from: hf.co/org/Tiny-GGUF:Q4_K_M\n    runtime: {num_thread: 1}\n")
    daemon = Daemon(cfg)
    env_daemon = Daemon(env_cfg, env={"OLLAMA_MODELS": str(d / "envstore")})
    yield daemon, env_daemon  # type: ignore[misc]
    daemon.stop()
    env_daemon.stop()


def test_store_layers_reach_show_and_the_prompt(store_daemon: tuple[Daemon, Daemon]) -> None:
    daemon, _ = store_daemon
    show = httpx.post(daemon.url + "/api/show", json={"model": "chat:ollama"}).json()
    assert show["template"] == GO_TEMPLATE and show["system"] == "You are terse."
    lines = dict(line.split(None, 1) for line in show["parameters"].splitlines())
    assert lines == {"temperature": "0", "num_predict": "4", "num_ctx": "256"}
    r = httpx.post(daemon.url + "/api/chat", json={
        "model": "chat:ollama", "messages": [{"role": "user", "content": "hi"}], "_debug_render_only": True})
    rendered = r.json()["_debug_info"]["rendered_template"]
    assert rendered == "<<SYS>>You are terse.<</SYS>>hi =>"
    expected = GoChatTemplate(GO_TEMPLATE).render(
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}])
    assert rendered == expected  # what Ollama renders for this TEMPLATE layer
    # The params layer is the request's defaults: num_predict 4.
    out = httpx.post(daemon.url + "/api/generate", json={"model": "chat:ollama", "prompt": "x", "stream": False},
                     timeout=60).json()
    assert out["eval_count"] == 4


def test_a_pair_template_beats_the_store_template(store_daemon: tuple[Daemon, Daemon]) -> None:
    daemon, _ = store_daemon
    r = httpx.post(daemon.url + "/api/chat", json={
        "model": "chat:override", "messages": [{"role": "user", "content": "hi"}], "_debug_render_only": True})
    assert r.json()["_debug_info"]["rendered_template"] == "hi ->"


def test_ollama_models_env_and_an_hf_name(store_daemon: tuple[Daemon, Daemon]) -> None:
    _, env_daemon = store_daemon
    names = [m["name"] for m in httpx.get(env_daemon.url + "/api/tags").json()["models"]]
    assert names == ["hf:tiny"]
    out = httpx.post(env_daemon.url + "/api/generate", json={"model": "hf:tiny", "prompt": "x", "stream": False},
                     timeout=60).json()
    assert out["eval_count"] == 3
