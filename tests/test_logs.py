"""Logs: a JSON line per record, tracebacks included as data (journald and files read these), and
no local variables in them unless SIDECAR_LOG_LOCALS asks (they hold prompts)."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from sidecar.observability.logs import LOCALS_ENV, setup_logging

pytestmark = pytest.mark.pure


def serve(prompt: str) -> None:
    """A frame whose locals hold a prompt, as those of a request being served do."""
    raise ValueError("the bad thing")


def logged_exception(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """The JSON line of an exception raised while serving a prompt."""
    setup_logging()  # stderr is not a terminal under pytest: JSON lines
    try:
        try:
            serve("the user's prompt")
        except ValueError:
            logging.getLogger("sidecar.test").exception("it failed")
        line = capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        logging.getLogger().handlers.clear()
    assert "traceback object" not in line
    record: dict[str, Any] = json.loads(line)
    return record


def test_an_exception_reaches_the_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    record = logged_exception(capsys)
    assert record["event"] == "it failed" and record["level"] == "error"
    frames = record["exception"][0]
    assert frames["exc_type"] == "ValueError" and frames["exc_value"] == "the bad thing"
    assert [f["name"] for f in frames["frames"]][-2:] == ["logged_exception", "serve"]


def test_tracebacks_show_no_locals_by_default(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOCALS_ENV, raising=False)
    record = logged_exception(capsys)
    assert not any("locals" in f for f in record["exception"][0]["frames"])
    assert "the user's prompt" not in json.dumps(record)


def test_sidecar_log_locals_shows_them(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOCALS_ENV, "1")
    record = logged_exception(capsys)
    frame = next(f for f in record["exception"][0]["frames"] if f["name"] == "serve")
    assert "the user's prompt" in frame["locals"]["prompt"]
