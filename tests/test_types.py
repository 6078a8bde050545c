"""The package's type hints hold: mypy checks `sidecar` clean (pyproject.toml's [tool.mypy]).

Hints that nothing checks drift into claims (an Optional read as a value, a variable reused with
another type), so the check runs with the suite, as `make lint` runs it."""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_type_checks(tmp_path: Path) -> None:
    out, err, status = api.run([str(ROOT / "sidecar"), "--config-file", str(ROOT / "pyproject.toml"),
                                "--cache-dir", str(tmp_path / "cache"), "--no-error-summary"])
    assert status == 0, out + err
