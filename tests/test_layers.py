"""The packages depend on each other one way: the API on the runtime, the runtime on the engine.

Read from the source's import statements, so a shortcut (the API catching an engine exception, the
config reaching into the runtime) fails here before it becomes a habit."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SIDECAR = Path(__file__).resolve().parents[1] / "sidecar"

# package -> packages of sidecar it must never import
FORBIDDEN = {
    "api": {"engine"},
    "config": {"runtime", "api"},
    "engine": {"api", "runtime", "config", "models", "templates", "observability"},
    "templates": {"api", "runtime", "config"},
    "models": {"api", "runtime", "config"},
    "runtime": {"api"},
    "observability": {"api", "runtime", "config", "engine"},
}


def imports_of(package: str) -> dict[str, set[str]]:
    """For each module of the package, the sidecar packages it imports."""
    out: dict[str, set[str]] = {}
    for f in (SIDECAR / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sidecar."):
                names.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("sidecar.")}
        out[str(f.relative_to(SIDECAR))] = names
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    banned = FORBIDDEN[package]
    wrong = {mod: names & banned for mod, names in imports_of(package).items() if names & banned}
    assert not wrong, f"{package} must not import {banned}: {wrong}"


def test_no_module_is_too_large() -> None:
    """Apart from the Go template engine's pieces, a module that grows past 500 lines holds two jobs."""
    big = {str(f.relative_to(SIDECAR)): n for f in SIDECAR.rglob("*.py")
           if (n := len(f.read_text(encoding="utf-8").splitlines())) > 500 and "gotemplate" not in f.parts}
    assert not big, big
