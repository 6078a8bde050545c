"""The packages depend on each other one way: the API on the runtime, the runtime on pairing and the
engine, pairing on the engine, models, config and templates; models and templates on no other layer.

Read from the source's import statements, so a shortcut (the API catching an engine exception, the
config reaching into the runtime, a model-store module borrowing an engine helper) fails here before
it becomes a habit."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

SIDECAR = Path(__file__).resolve().parents[1] / "sidecar"

# package -> packages of sidecar it must never import
FORBIDDEN = {
    "api": {"engine", "pairing"},
    "config": {"runtime", "api", "pairing"},
    "engine": {"api", "runtime", "config", "models", "templates", "observability", "pairing"},
    "templates": {"api", "runtime", "config", "engine", "models", "pairing"},
    "models": {"api", "runtime", "config", "engine", "templates", "pairing"},
    "pairing": {"api", "runtime", "observability"},
    "runtime": {"api"},
    "observability": {"api", "runtime", "config", "engine", "pairing"},
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


def test_the_packages_form_no_cycle() -> None:
    """Each package imports only packages below it, so every one can be read (and replaced) from the
    bottom up: a cycle would make two layers one."""
    packages = {f.name for f in SIDECAR.iterdir() if (f / "__init__.py").exists()}
    graph = {p: set().union(*imports_of(p).values()) & packages - {p} for p in packages}
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        pytest.fail(f"the packages import each other in a cycle: {e.args[1]}")


def test_no_module_is_too_large() -> None:
    """Apart from the Go template engine's pieces, a module that grows past 500 lines holds two jobs."""
    big = {str(f.relative_to(SIDECAR)): n for f in SIDECAR.rglob("*.py")
           if (n := len(f.read_text(encoding="utf-8").splitlines())) > 500 and "gotemplate" not in f.parts}
    assert not big, big
