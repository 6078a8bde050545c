"""`sidecar serve | check | bench`."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
from pathlib import Path

from sidecar import __version__
from sidecar.config.loader import ConfigError, default_path, load
from sidecar.config.schema import Config
from sidecar.observability.logs import setup_logging

log = logging.getLogger("sidecar")


def parse_ollama_host(value: str | None) -> tuple[str, int]:
    """OLLAMA_HOST as Ollama's envconfig.Host() reads it: [scheme://]host[:port][/path]."""
    s = (value or "").strip().strip("\"'").strip()
    default_port = 11434
    scheme, sep, hostport = s.partition("://")
    if not sep:
        hostport = s
    elif scheme == "http":
        default_port = 80
    elif scheme == "https":
        default_port = 443
    hostport = hostport.split("/", 1)[0]
    host, port = "127.0.0.1", str(default_port)
    if hostport.startswith("["):  # [::1]:port or [::1]
        end = hostport.find("]")
        h, rest = hostport[1:end], hostport[end + 1 :]
        host = h
        if rest.startswith(":"):
            port = rest[1:]
    elif hostport.count(":") == 1:
        host, port = hostport.split(":")
    elif hostport:
        try:
            host = str(ipaddress.ip_address(hostport))
        except ValueError:
            host = hostport
    try:
        p = int(port)
    except ValueError:
        return "127.0.0.1", 11434
    if not 0 <= p <= 65535:
        return "127.0.0.1", 11434
    return host, p  # host "" means every interface, as Ollama binds for ":1234"


def keep_alive_default() -> float:
    from sidecar.api.wire import ApiError, parse_duration

    raw = os.environ.get("OLLAMA_KEEP_ALIVE", "").strip()
    if not raw:
        return 300.0
    try:
        return float(int(raw))  # that variable also takes plain integer seconds
    except ValueError:
        pass
    try:
        return parse_duration(raw)
    except ApiError:
        log.warning("OLLAMA_KEEP_ALIVE=%r is not a duration; using 5m", raw)
        return 300.0


def build_entries(config: Config, base: Path) -> tuple[dict, list[str]]:
    from sidecar.runtime.manager import build_entry

    entries, errors = {}, []
    for name, pair in config.pairs.items():
        try:
            entries[name] = build_entry(name, pair, base)
        except Exception as e:
            errors.append(f"{name}: {e}")
    return entries, errors


def cmd_serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from sidecar.api.app import create_app
    from sidecar.runtime.manager import Runtime

    path = default_path(args.config)
    try:
        config = load(path)
    except ConfigError as e:
        print(f"sidecar: {e}", file=sys.stderr)
        return 2
    host, port = parse_ollama_host(os.environ.get("OLLAMA_HOST") or config.listen)
    host = args.host if args.host is not None else host
    port = args.port if args.port is not None else port
    runtime = Runtime(keep_alive=keep_alive_default(), max_queue=int(os.environ.get("OLLAMA_MAX_QUEUE") or 512))
    entries, errors = build_entries(config, path.parent)
    for err in errors:
        log.error("pair not served: %s", err)
    runtime.set_entries(entries)
    app = create_app(runtime)
    log.info("spec-sidecar %s serving %d pair(s) from %s on %s:%d", __version__, len(entries), path,
             host or "*", port)

    async def main() -> None:
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host or None, port, reuse_address=True)
        await site.start()
        print(f"listening on {host or '*'}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down")
        await runner.cleanup()

    asyncio.run(main())
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    path = default_path(args.config)
    try:
        config = load(path)
    except ConfigError as e:
        print(f"{e}", file=sys.stderr)
        return 1
    entries, errors = build_entries(config, path.parent)
    ok = not errors
    rows = [("PAIR", "TARGET", "DRAFT", "STATUS")]
    for name, e in entries.items():
        draft = e.config.draft
        dname = "none" if draft is None else ("ngram" if getattr(draft, "type", "") == "ngram" else str(e.draft.path))
        status = "ok"
        if e.draft is not None:
            status = _check_draft(e)
            ok = ok and status == "ok"
        rows.append((name, str(e.target.path), dname, status))
    for err in errors:
        name, _, msg = err.partition(": ")
        rows.append((name, "-", "-", f"error: {msg}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=False)) + "  " + r[3])
    print(f"{path}: {'ok' if ok else 'problems found'}")
    return 0 if ok else 1


def _check_draft(entry) -> str:  # type: ignore[no-untyped-def]
    from sidecar.engine.llama import Weights
    from sidecar.engine.pairing import IncompatibleDraft, check_pair

    target = Weights(entry.target.path, n_gpu_layers=0)
    draft = Weights(entry.draft.path, n_gpu_layers=0)
    try:
        check_pair(target, draft)
        return "ok"
    except IncompatibleDraft as e:
        return f"error: {e}"
    finally:
        draft.close()
        target.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sidecar", description="Speculative decoding behind Ollama's API")
    parser.add_argument("--version", action="version", version=f"spec-sidecar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", help="pairs.yaml (default: ./pairs.yaml, else the bundled demo)")
    s.add_argument("--host", help="listen address (default: from OLLAMA_HOST, else 127.0.0.1)")
    s.add_argument("--port", type=int, help="listen port (default: from OLLAMA_HOST, else 11434)")
    c = sub.add_parser("check", help="validate pairs.yaml, resolve models, check draft pairing")
    c.add_argument("--config")
    b = sub.add_parser("bench", help="side-by-side speculative vs target-only benchmark")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    setup_logging()
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "check":
        return cmd_check(args)
    import runpy

    sys.argv = ["bench_spec.py", *args.rest]
    runpy.run_path(str(Path(__file__).resolve().parent.parent / "bench" / "bench_spec.py"), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
