"""Logs: a JSON line per record, tracebacks included as data (journald and files read these)."""

from __future__ import annotations

import json
import logging

import pytest

from sidecar.observability.logs import setup_logging


def test_an_exception_reaches_the_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging()  # stderr is not a terminal under pytest: JSON lines
    try:
        try:
            raise ValueError("the bad thing")
        except ValueError:
            logging.getLogger("sidecar.test").exception("it failed")
        line = capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        logging.getLogger().handlers.clear()
    record = json.loads(line)
    assert record["event"] == "it failed" and record["level"] == "error"
    frames = record["exception"][0]
    assert frames["exc_type"] == "ValueError" and frames["exc_value"] == "the bad thing"
    assert any(f["name"] == "test_an_exception_reaches_the_json_line" for f in frames["frames"])
    assert "traceback object" not in line
