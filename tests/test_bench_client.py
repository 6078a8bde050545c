"""bench/concurrency.py's lean client: it must read exactly what httpx reads, on a real server.

The client stamps each arrival and parses the HTTP afterwards (bench/concurrency.py, "The lean
client"), so the de-chunking is checked at every split an arrival can make, and the whole reader
against a real aiohttp server that streams NDJSON as the daemon does."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import concurrency as cc

pytestmark = pytest.mark.pure

BODY = b"5\r\nhello\r\n3;ext=1\r\n\n{}\r\n0\r\n\r\n"


def test_dechunking_is_the_same_at_every_split_of_the_arrivals() -> None:
    for i in range(len(BODY) + 1):
        for j in range(i, len(BODY) + 1):
            parts = [(1.0, BODY[:i]), (2.0, BODY[i:j]), (3.0, BODY[j:])]
            got = list(cc._dechunk(parts))
            assert b"".join(d for _, d in got) == b"hello\n{}"
            # each payload byte is credited to the arrival that completed it
            stamps = [t for t, d in got for _ in d]
            assert stamps == sorted(stamps)


def test_a_response_head_split_over_arrivals_is_read_whole() -> None:
    response = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + BODY
    for i in range(1, len(response)):
        end, lines = cc._response_lines("/p", [(1.0, response[:i]), (2.0, response[i:])])
        assert end == 2.0 and [text for _, text in lines] == ["hello", "{}"]
    with pytest.raises(RuntimeError, match="whole response head"):
        cc._response_lines("/p", [(1.0, b"HTTP/1.1 200 OK\r\n")])


def test_the_lean_client_reads_a_streamed_response_line_by_line_as_it_arrived() -> None:
    lines = [{"response": f"t{i}", "done": False} for i in range(5)] + [{"response": "", "done": True,
                                                                         "eval_count": 5}]

    async def handler(request: web.Request) -> web.StreamResponse:
        assert (await request.json())["model"] == "m"
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for c in lines:
            await resp.write((json.dumps(c) + "\n").encode())
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    async def missing(request: web.Request) -> web.Response:
        return web.json_response({"error": "model 'x' not found"}, status=404)

    async def run() -> tuple[float, list[tuple[float, str]]]:
        app = web.Application()
        app.router.add_post("/api/generate", handler)
        app.router.add_post("/api/missing", missing)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            with pytest.raises(RuntimeError, match=r"404.*not found"):
                await cc.raw_post(f"http://127.0.0.1:{port}", "/api/missing", {"model": "x"})
            s = await cc.daemon_stream_raw(f"http://127.0.0.1:{port}", "/api/generate", {"model": "m"})
            assert s.text == "t0t1t2t3t4" and s.tokens == 5
            assert len(s.stamps) == 5 and s.stamps == sorted(s.stamps) and s.end >= s.stamps[-1]
            return await cc.raw_post(f"http://127.0.0.1:{port}", "/api/generate", {"model": "m"})
        finally:
            await runner.cleanup()

    end, got = asyncio.run(run())
    assert [json.loads(text) for _, text in got] == lines
    assert [t for t, _ in got] == sorted(t for t, _ in got) and end >= got[-1][0]
