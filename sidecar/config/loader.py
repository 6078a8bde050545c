"""Reading pairs.yaml with errors that point at file:line and the offending key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from sidecar.config.schema import Config

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
