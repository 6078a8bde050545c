"""Failures every layer can raise without knowing about HTTP.

The API maps them to status codes: a `ClientError` is the client's mistake (400), `Unavailable`
is the daemon refusing work for now (503). The engine, runtime and config raise their own
subclasses, so nothing below the API knows what a status code is, and the API needs no import
from the layers that raise them.
"""

from __future__ import annotations


class ClientError(ValueError):
    """The request cannot be served as asked; str() is what the client sees."""


class Unavailable(RuntimeError):
    """The daemon cannot take this work now (queue full, shutting down); str() is the message."""


class ServerError(RuntimeError):
    """The daemon could not do what a valid request asked (a pair's template failing on it); str()
    is the message, answered with Ollama's 500 and no prefix. `traced`: the log keeps its
    traceback; off where the message says all there is (a template that does not parse)."""

    traced = True


class BadGateway(RuntimeError):
    """A server the daemon relies on (a pair's vLLM) is down or broke off; str() is the message (502)."""
