"""`sidecar serve | check`."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, get_args

from sidecar import __version__
from sidecar.config.loader import ConfigError, default_path
from sidecar.config.schema import UpstreamKind
from sidecar.observability.logs import setup_logging

if TYPE_CHECKING:
    from sidecar.config.entries import PairEntry

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


NUM_PARALLEL = 2  # the conversation that matters and one side request (a title, tags) beside it


def num_parallel_default() -> int:
    """OLLAMA_NUM_PARALLEL, as Ollama reads it; unset, empty or not a positive integer: NUM_PARALLEL
    (each costs a KV stream of num_ctx positions: README, Concurrency)."""
    raw = os.environ.get("OLLAMA_NUM_PARALLEL", "").strip()
    try:
        n = int(raw)
    except ValueError:
        if raw:
            log.warning("OLLAMA_NUM_PARALLEL=%r is not an integer; using %d", raw, NUM_PARALLEL)
        return NUM_PARALLEL
    return n if n >= 1 else NUM_PARALLEL


DRAIN_TIMEOUT = 30.0  # below systemd's TimeoutStopSec (120 s in our units), with room for unloading
CUT_GRACE = 5.0  # after the deadline: how long cut streams get to write their last line


def drain_timeout(flag: float | None, env: str | None, config: float | None) -> float:
    """Seconds running requests may take to finish on SIGTERM: --drain-timeout, SIDECAR_DRAIN_TIMEOUT,
    the config's drain_timeout, else 30."""
    if flag is not None:
        return max(0.0, flag)
    if env and env.strip():
        try:
            return max(0.0, float(env))
        except ValueError:
            log.warning("SIDECAR_DRAIN_TIMEOUT=%r is not a number of seconds; ignoring it", env)
    return DRAIN_TIMEOUT if config is None else config


def cmd_serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from sidecar.api import admin, lifecycle, proxy
    from sidecar.api.app import create_app
    from sidecar.observability import metrics
    from sidecar.observability.notify import ServiceNotifier
    from sidecar.runtime.engines import Engines
    from sidecar.runtime.llamacpp import LlamaEngine
    from sidecar.runtime.manager import Runtime
    from sidecar.runtime.reload import Reloader
    from sidecar.runtime.vllm import VllmEngine

    path = default_path(args.config)
    engines = Engines({"llama.cpp": LlamaEngine(), "vllm": VllmEngine()})
    runtime = Runtime(engines, keep_alive=keep_alive_default(),
                      max_queue=int(os.environ.get("OLLAMA_MAX_QUEUE") or 512), num_parallel=num_parallel_default())
    reloader = Reloader(path, runtime, watch=not args.no_watch)
    try:
        config = reloader.load_initial().config  # a missing model is logged; a broken file is fatal
    except ConfigError as e:
        print(f"sidecar: {e}", file=sys.stderr)
        return 2
    host, port = parse_ollama_host(os.environ.get("OLLAMA_HOST") or config.listen)
    host = args.host if args.host is not None else host
    port = args.port if args.port is not None else port
    try:  # the upstream: --upstream, else SIDECAR_UPSTREAM, else the config's upstream:
        upstream = proxy.resolve_upstream(args.upstream, None, config.upstream)
        upstream_kind = proxy.resolve_kind(args.upstream_kind, None, config.upstream_kind)
        proxy.check_not_self(upstream, host, port)
    except ValueError as e:
        print(f"sidecar: {e}", file=sys.stderr)
        return 2
    drain_s = drain_timeout(args.drain_timeout, os.environ.get("SIDECAR_DRAIN_TIMEOUT"), config.drain_timeout)
    app = create_app(runtime, bind_host=host, upstream=upstream, upstream_kind=upstream_kind)
    drain = app[lifecycle.DRAIN]
    app[admin.RELOADER] = reloader  # GET /sidecar/status reports the config through it
    reloader.on_reloaded.append(lambda ok: metrics.observe_config_reload(app, ok))
    # Under systemd (Type=notify, ExecReload=kill -HUP): RELOADING=1 while a reload runs, then
    # READY=1 whether or not it worked, so `systemctl reload` always returns. No-ops elsewhere.
    notifier = ServiceNotifier()

    def serving() -> str:
        return f"serving {reloader.summary()} on {host or '*'}:{port}"

    def reloaded(_ok: bool) -> None:
        notifier.ready()
        notifier.status(serving())

    def reloading() -> None:
        notifier.reloading()

    reloader.on_reloading.append(reloading)
    reloader.on_reloaded.append(reloaded)
    log.info("spec-sidecar %s serving %d pair(s) from %s on %s:%d", __version__, len(runtime.entries), path,
             host or "*", port)

    async def main() -> None:
        # Handlers still running when cleanup starts were already given the drain (and cut): no long wait.
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=CUT_GRACE)
        await runner.setup()
        site = web.TCPSite(runner, host or None, port, reuse_address=True)
        await site.start()
        print(f"listening on {host or '*'}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_stop_signal() -> None:
            if stop.is_set():  # a second SIGTERM/Ctrl-C: do not wait for the deadline
                log.warning("second stop signal: cutting running generations now")
                runtime.halt.set()
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_stop_signal)
        # SIGHUP and file events feed the same single-flight reload.
        loop.add_signal_handler(signal.SIGHUP, reloader.trigger, "signal")
        await reloader.start()
        notifier.ready(serving())
        notifier.start_watchdog()
        await stop.wait()
        # New requests get 503 from here on; running ones may finish until the deadline, then
        # every generation stops at its next step and its stream ends with an error line.
        drain.close()
        notifier.stopping()
        log.info("shutting down: %d request(s) running, waiting up to %gs for them", drain.active, drain_s)
        await reloader.stop()
        if not await drain.wait(drain_s):
            log.warning("drain deadline passed with %d request(s) running; stopping their generation",
                        drain.active)
            runtime.halt.set()
            await drain.wait(CUT_GRACE)
        runtime.halt.set()  # anything still queued on a model stops at once
        await notifier.stop_watchdog()
        await runner.cleanup()
        log.info("stopped")

    asyncio.run(main())
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Validate, resolve every model and check every draft against its target; never serves.

    Prints one row per pair and exits 1 on any problem, so it can gate a deploy or a reload."""
    from sidecar.config.loader import load_file
    from sidecar.pairing import auto
    from sidecar.runtime.format import resolve as resolve_format

    path = default_path(args.config)
    try:
        prepared = auto.expand(load_file(path))
    except ConfigError as e:
        print(f"{e}", file=sys.stderr)
        return 1
    ok = True
    rows = [("PAIR", "TARGET", "DRAFT", "STATUS")]
    auto_pairs = {n: e.config for n, e in prepared.entries.items() if e.auto}  # `auto: true` adds these
    for name, pair in {**prepared.config.pairs, **auto_pairs}.items():
        entry = prepared.entries.get(name)
        dname = pair.draft_label or "none"
        if entry is None:
            ok = False
            rows.append((name, pair.from_, dname, f"error: {prepared.errors.get(name, 'not resolved')}"))
            continue
        if entry.config.engine == "vllm":
            status = _check_vllm(entry)
        else:
            status = _check_draft(entry) if entry.draft is not None else "ok"
        ok = ok and status == "ok"
        status = "; ".join([status, *([entry.chosen] if entry.chosen else []), *resolve_format(entry).notes])
        rows.append((name, str(entry.target.path), str(entry.draft.path) if entry.draft else
                     entry.draft_label or "none", status))
    as_json = getattr(args, "json", False)  # a Namespace made by hand (a script, a test) may lack them
    fits, memory = _memory_plans(prepared.entries, getattr(args, "gpu_memory", None), as_json)
    if as_json:
        print(memory)
        return 0 if ok and fits else 1
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=False)) + "  " + r[3])
    _print_backend()
    print(memory)
    ok = ok and fits
    _print_vllm([e for e in prepared.entries.values() if e.config.engine == "vllm"])
    print(f"{path}: {'ok' if ok else 'problems found'}")
    return 0 if ok else 1


def _print_backend() -> None:
    """The backend this build runs on (where the layers go: the memory plan below it)."""
    from sidecar.engine.backend import gpu_offload_supported, system_info
    from sidecar.engine.kernels import build_warnings

    gpu = gpu_offload_supported()
    # system_info() reads "CUDA : ARCHS = 900 | ... | CPU : SSE3 = 1 | ...": a backend opens each group.
    names = [part.split(" : ")[0].strip() for part in system_info().split("|") if " : " in part]
    print(f"llama.cpp backend: {' + '.join(names) or 'CPU'} ({'GPU offload' if gpu else 'CPU only'})")
    for warning in build_warnings(system_info()):
        print(f"  warning: {warning}")


def _memory_plans(entries: dict[str, PairEntry], gpu_memory: str | None, as_json: bool) -> tuple[bool, str]:
    """Each pair's memory plan (runtime.memory) on this machine's GPUs, or on one GPU of
    `gpu_memory` bytes; whether all fit, and the report (text, or JSON per pair)."""
    import json

    from sidecar.runtime.memory import Device, parse_size, ram_available
    from sidecar.runtime.room import detect_gpus, plan_entry, report

    gpus = [Device("GPU0", parse_size(gpu_memory), parse_size(gpu_memory))] if gpu_memory else detect_gpus()
    ram = ram_available()
    plans = {}
    for name, e in entries.items():
        parallel = e.config.runtime.num_parallel or num_parallel_default()
        try:
            plans[name] = (e, plan_entry(e, e.num_ctx(None), parallel, gpus, ram))
        except (OSError, ValueError) as err:  # an unreadable header: the rows above say more
            log.warning("%s: no memory plan: %s", name, err)
            plans[name] = (e, None)
    fits = all(p is None or p.fits for _, p in plans.values())
    if as_json:
        return fits, json.dumps({name: p.to_json() if p else None for name, (_, p) in plans.items()}, indent=2)
    return fits, report(plans, gpus, ram, " (--gpu-memory)" if gpu_memory else "")


def _check_vllm(entry: PairEntry) -> str:
    """A managed vLLM pair needs vLLM importable by the interpreter that starts it."""
    from sidecar.runtime.vllm import command

    s = command.settings(entry)
    if s.url is not None:
        return "ok"
    python = command.python(entry)
    return "ok" if command.installed(python) else f"error: vLLM is not installed for {python}"


def _print_vllm(entries: list[PairEntry]) -> None:
    """The exact server command of each vLLM pair: what the daemon runs (managed), or what to run
    where the server lives (remote; its port and host are then the user's)."""
    from urllib.parse import urlsplit

    from sidecar.runtime.vllm import command

    for e in entries:
        s = command.settings(e)
        python = command.python(e)
        version = command.installed(python)
        where = f"remote at {s.url}, started as" if s.url else "managed, started as"
        print(f"vLLM pair {e.name} ({where}; vLLM {version or 'not installed'}):")
        port = s.port or (urlsplit(s.url).port if s.url else None) or 8000  # vLLM's default port
        print("  " + command.command_line(e, e.num_ctx(None), port, command.has_suffix(python)))


def _check_draft(entry: PairEntry) -> str:
    """llama.cpp's draft/target vocabulary rules, on the real files' vocabularies (llama.cpp's
    vocab-only load: a 70B target is checked in a second, whatever memory it would need)."""
    from sidecar.engine.llama import Weights
    from sidecar.pairing.rules import check_pair

    assert entry.draft is not None
    loaded: list[Weights] = []
    try:
        for p in (entry.target.path, entry.draft.path):
            loaded.append(Weights(p, n_gpu_layers=0, vocab_only=True))
        check_pair(*loaded)
        return "ok"
    except Exception as e:  # IncompatibleDraft, or llama.cpp cannot load one of them
        return f"error: {e}"
    finally:
        for w in loaded:
            w.close()


def cmd_suggest(args: argparse.Namespace) -> int:
    """Which model in the configured stores can draft for which, best first, plus a pairs.yaml
    snippet; --probe measures the top candidates on this machine (cached, so a rerun is instant)."""
    import json

    from sidecar.pairing.suggest import configured_stores, format_table, pairs_snippet, suggest

    try:
        stores = configured_stores(default_path(args.config))
    except ConfigError as e:
        print(f"{e}", file=sys.stderr)
        return 1
    # Without --probe the results already cached still show: measuring is what --probe adds.
    results = suggest(stores, probe=args.probe, cached=True,
                      progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
    else:
        print(format_table(results) + "\n\n" + pairs_snippet(results), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sidecar", description="Speculative decoding behind Ollama's API")
    parser.add_argument("--version", action="version", version=f"spec-sidecar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", help="pairs.yaml (default: ./pairs.yaml, else the bundled demo)")
    s.add_argument("--host", help="listen address (default: from OLLAMA_HOST, else 127.0.0.1)")
    s.add_argument("--port", type=int, help="listen port (default: from OLLAMA_HOST, else 11434)")
    s.add_argument("--upstream", help="the real Ollama for everything that is not a pair, e.g. "
                   "http://127.0.0.1:11435 (default: SIDECAR_UPSTREAM, else upstream: in the config)")
    s.add_argument("--upstream-kind", choices=get_args(UpstreamKind),
                   help="ollama, or lmstudio (serves /v1 only); default: detected")
    s.add_argument("--drain-timeout", type=float, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long running requests may take to finish before their "
                   "generation is stopped (default: SIDECAR_DRAIN_TIMEOUT, else drain_timeout: in the config, "
                   "else 30)")
    s.add_argument("--no-watch", action="store_true",
                   help="do not watch the config file (SIGHUP still reloads it)")
    c = sub.add_parser("check", help="validate pairs.yaml, resolve models, check draft pairing")
    c.add_argument("--config")
    c.add_argument("--gpu-memory", metavar="SIZE", help="plan each pair for one GPU of this size, e.g. 24GiB")
    c.add_argument("--json", action="store_true", help="print each pair's memory plan as JSON")
    g = sub.add_parser("suggest", help="list which models can draft for which, and suggest pairs")
    g.add_argument("--config", help="pairs.yaml whose models: names the stores (default: as for serve)")
    g.add_argument("--probe", action="store_true",
                   help="measure agreement and predicted speed-up of each target's top 3 drafts (cached)")
    g.add_argument("--json", action="store_true", help="print the suggestions as JSON")
    t = sub.add_parser("top", help="a live view of a running daemon: speculation, batching, queue, memory")
    t.add_argument("--host", help="the daemon's address, in OLLAMA_HOST syntax (default: OLLAMA_HOST)")
    t.add_argument("--once", action="store_true", help="print one frame and exit")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between reads (default 1)")
    args = parser.parse_args(argv)
    if args.command == "top":  # no logging setup: the screen is its output
        from sidecar.observability import top
        return top.run(top.base_url(args.host or os.environ.get("OLLAMA_HOST"), parse_ollama_host), args.once,
                       args.interval)
    setup_logging()
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "suggest":
        return cmd_suggest(args)
    return cmd_check(args)


if __name__ == "__main__":
    sys.exit(main())
