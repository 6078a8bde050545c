"""Reading pairs.yaml with errors that point at file:line and the offending key.

`parse` validates the text; `prepare` / `load_file` also resolve every pair's models (a
`Prepared` config, not applied), which is what start-up, reloads and `sidecar check` share.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from sidecar.config.entries import PairEntry, build_entries
from sidecar.config.schema import Config
from sidecar.models.resolve import Stores

BUNDLED = Path(__file__).resolve().parent.parent / "pairs.yaml"


class ConfigError(ValueError):
    """A config file that cannot be used; str() is ready for a log line or a terminal."""


def default_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """--config FILE, else ./pairs.yaml, else the bundled default (the demo model)."""
    if explicit:
        return Path(explicit)
    local = Path("pairs.yaml")
    return local if local.exists() else BUNDLED


def _to_python(node: yaml.Node, path: tuple[Any, ...], lines: dict[tuple[Any, ...], int]) -> Any:
    lines.setdefault(path, node.start_mark.line + 1)  # a key's own line wins over its value's
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for k, v in node.value:
            # Keys are taken as written: `llama3:8b` must not become a YAML 1.1 sexagesimal number.
            key = k.value if isinstance(k, yaml.ScalarNode) else yaml.serialize(k).strip()
            if key in out:
                raise ConfigError(f"{{file}}:{k.start_mark.line + 1}: duplicate key {key!r}")
            lines[(*path, key)] = k.start_mark.line + 1
            out[key] = _to_python(v, (*path, key), lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(v, (*path, i), lines) for i, v in enumerate(node.value)]
    return yaml.safe_load(yaml.serialize(node))


def parse(text: str, source: str = "<string>") -> Config:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ConfigError(f"{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    lines: dict[tuple[Any, ...], int] = {}
    try:
        data = _to_python(node, (), lines) if node is not None else {}
    except ConfigError as e:
        raise ConfigError(str(e).replace("{file}", source)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}:1: the file must be a mapping with a 'pairs:' key")
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError("\n".join(_explain(err, source, lines) for err in e.errors())) from None


def _explain(err: Any, source: str, lines: dict[tuple[Any, ...], int]) -> str:
    loc = tuple(str(p) if not isinstance(p, int) else p for p in err["loc"])
    # pydantic adds the union member's tag and validator names to the path; users never wrote them.
    loc = tuple(p for p in loc if p not in ("ngram", "model") and "[" not in str(p))
    loc = tuple("from" if p == "from_" else p for p in loc)
    probe = loc
    while probe and probe not in lines:
        probe = probe[:-1]
    line = lines.get(probe, 1)
    key = ".".join(str(p) for p in loc) or "(top level)"
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    return f"{source}:{line}: {key}: {msg}"


def load(path: str | os.PathLike[str]) -> Config:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror or e}") from None
    return parse(text, str(p))


@dataclass
class Prepared:
    """A config file read, validated and resolved, not yet applied."""

    config: Config
    hash: str
    stores: Stores
    base: Path  # what relative paths in the file are relative to
    entries: dict[str, PairEntry] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # pair name -> why it could not be resolved


def config_hash(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: the file is missing") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None


def _key_line(text: str, keys: tuple[str, ...]) -> int:
    """The line a nested mapping key is written on (1 if it cannot be found)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return 1
    line = 1
    for key in keys:
        if not isinstance(node, yaml.MappingNode):
            break
        match = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None)
        if match is None:
            break
        line, node = match[0].start_mark.line + 1, match[1]
    return line


def stores_of(config: Config, text: str, path: Path) -> Stores:
    """The `models:` store locations, with schema-style errors (file:line: key: message)."""
    try:
        return Stores.from_config(config.models, base=path.parent)
    except ValueError as e:
        key = str(e).split(":", 1)[0]
        raise ConfigError(f"{path}:{_key_line(text, tuple(key.split('.')))}: {e}") from None


def prepare(data: bytes, path: Path) -> Prepared:
    """Parse, validate and resolve a config's bytes; raises ConfigError when the file is unusable.

    Blocking (file system, GGUF headers): run it in a thread when the event loop is serving."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    config = parse(text, str(path))
    stores = stores_of(config, text, path)
    entries, errors = build_entries(config, path.parent, stores)
    return Prepared(config, config_hash(data), stores, path.parent, entries, errors)


def load_file(path: Path) -> Prepared:
    return prepare(read_bytes(path), path)
