"""HTTP to one vLLM server: its tokenizer, its completions stream, its speculation counters.

Failures become the daemon's own errors, so the API answers in Ollama's shape: a server that
cannot be reached or breaks off is a `BadGateway` (502), one that says it is overloaded (503,
429) is `Unavailable` (503), and a request it refuses (400) is the client's `ClientError`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from sidecar.errors import BadGateway, ClientError, Unavailable

SPEC_PREFIX = "vllm:spec_decode_num_"
# Only these samples: prometheus_client's own app, which vLLM mounts under /metrics/ (its /metrics
# route is the instrumentator's, which takes no filter), serves a `name[]`-filtered page of 1 kB
# instead of the 50 kB registry. A server without that mount gets the whole page, which parses the same.
SPEC_QUERY = "&".join(f"name[]={SPEC_PREFIX}{n}_total"
                      for n in ("drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos"))


class Refused(ClientError):
    """vLLM refused the request as invalid; the message is vLLM's."""


class Overloaded(Unavailable):
    """vLLM answered 503 or 429."""


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters for one model: drafts, drafted and accepted tokens, by position."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    per_pos: dict[int, float] = field(default_factory=dict)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted_tokens - other.accepted_tokens,
                            {p: v - other.per_pos.get(p, 0.0) for p, v in self.per_pos.items()})


def _labels(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        if k:
            out[k.strip()] = v.strip().strip('"')
    return out


def parse_spec_counters(metrics: str, model: str) -> SpecCounters:
    """The spec-decode counters of `model` in a Prometheus text page (summed over vLLM's engines)."""
    c = SpecCounters()
    for line in metrics.splitlines():
        if not line.startswith(SPEC_PREFIX):
            continue
        name, _, rest = line.partition("{")
        labels_text, _, value = rest.rpartition("}")
        labels = _labels(labels_text)
        if labels.get("model_name", model) != model:
            continue
        try:
            v = float(value.split()[0])
        except (ValueError, IndexError):
            continue
        kind = name.removeprefix(SPEC_PREFIX)
        if kind == "drafts_total":
            c.drafts += v
        elif kind == "draft_tokens_total":
            c.draft_tokens += v
        elif kind == "accepted_tokens_total":
            c.accepted_tokens += v
        elif kind == "accepted_tokens_per_pos_total" and labels.get("position", "").isdigit():
            pos = int(labels["position"])
            c.per_pos[pos] = c.per_pos.get(pos, 0.0) + v
    return c


def _message(status: int, body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip() or f"HTTP {status}"
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def _raise_for(status: int, body: bytes, url: str) -> None:
    if status < 400:
        return
    msg = _message(status, body)
    if status in (429, 503):
        raise Overloaded(f"vLLM at {url} is overloaded: {msg}")
    if 400 <= status < 500:
        raise Refused(msg)
    raise BadGateway(f"vLLM at {url} failed: HTTP {status}: {msg}")


class VllmClient:
    def __init__(self, url: str, model: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.model = model  # the name the server knows the model by
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._filtered = True  # whether the server serves the filtered counters page (spec_counters)

    # -- blocking calls: the tokenizer runs off the event loop (runtime.render.prepare) ---------
    def _post_sync(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(f"{self.url}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            _raise_for(e.code, e.read(), self.url)
            raise
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise BadGateway(f"vLLM at {self.url} is unreachable: {getattr(e, 'reason', e)}") from None

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        out = self._post_sync("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": add_special})
        return [int(t) for t in out["tokens"]]

    def detokenize(self, tokens: list[int]) -> str:
        return str(self._post_sync("/detokenize", {"model": self.model, "tokens": tokens})["prompt"])

    # -- async calls ---------------------------------------------------------------------------
    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No total timeout: a long generation streams for minutes; connecting must be quick.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self.timeout, sock_read=None))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _get(self, path: str) -> bytes:
        try:
            async with self._http().get(f"{self.url}{path}",
                                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                body = await r.read()
                _raise_for(r.status, body, self.url)
                return body
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise BadGateway(f"vLLM at {self.url} is unreachable: {e}") from None

    async def models(self) -> list[dict[str, Any]]:
        return list(json.loads(await self._get("/v1/models")).get("data", []))

    async def spec_counters(self) -> SpecCounters:
        if self._filtered:
            try:
                page = await self._get(f"/metrics/?{SPEC_QUERY}")
            except Refused:  # no such mount (a 404): the whole page from now on
                self._filtered = False
        if not self._filtered:
            page = await self._get("/metrics")
        return parse_spec_counters(page.decode(errors="replace"), self.model)

    async def complete(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST /v1/completions with stream: the chunks as dicts. Leaving early closes the
        connection, which vLLM takes as an abort of the request."""
        try:
            async with self._http().post(f"{self.url}/v1/completions", json=body) as r:
                if r.status >= 400:
                    _raise_for(r.status, await r.read(), self.url)
                done = False
                try:
                    async for raw in r.content:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                            return
                        chunk = json.loads(data)
                        if "error" in chunk:  # vLLM reports a failure inside the stream
                            raise BadGateway(f"vLLM at {self.url} failed: {_message(500, data)}")
                        yield chunk
                finally:
                    if not done:
                        r.close()  # drop the connection instead of reading the rest: vLLM aborts
                raise BadGateway(f"vLLM at {self.url} broke off the stream")
        except (aiohttp.ClientError, OSError) as e:
            raise BadGateway(f"vLLM at {self.url} is unreachable or broke off: {e}") from None
