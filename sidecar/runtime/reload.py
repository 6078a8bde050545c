"""Applying pairs.yaml to the runtime, and reloading it while the daemon serves.

One path for every way a config arrives: at start-up, on a file change, on SIGHUP. Each read
parses and validates the whole file, resolves every model (Ollama store, LM Studio, paths), then
hands the runtime the new pairs, which it applies pair by pair (Runtime.apply).

Why it is built this way:

- The config's *directory* is watched, not the file: editors and `sed -i` save by writing a
  temporary file and renaming it over the old one, after which a watch on the file itself would
  never fire again. Deleting and re-creating the file works the same way.
- File events and SIGHUP only set a flag; one task debounces them and runs one reload at a time.
  A trigger that arrives during a reload causes exactly one more pass afterwards, so a burst of
  saves never runs overlapping reloads and the last state of the file always wins.
- A file that does not parse or validate (half-written, a typo, deleted) changes nothing: the last
  good config keeps serving and the error is logged and kept for /sidecar/status. A pair whose
  model cannot be found keeps its previous, working declaration; a new one is not served yet.
- File events whose bytes hash to what is already applied are ignored (touch, a save without
  edits); SIGHUP always reloads, since it is also how to pick up a re-pulled Ollama model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar.config.entries import Changes, PairEntry
from sidecar.config.loader import ConfigError, Prepared, config_hash, load_file, prepare, read_bytes
from sidecar.config.schema import Config
from sidecar.pairing import auto
from sidecar.runtime.manager import Runtime

log = logging.getLogger("sidecar.config")

DEBOUNCE_S = 0.3  # quiet time after the last trigger before a reload starts
MAX_DELAY_S = 2.0  # ...but a stream of events never postpones it longer than this
WATCH_RETRY_S = 2.0  # when the watched directory is missing


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


class Reloader:
    """Owns the config file for a running daemon: first load, watching, SIGHUP, status."""

    def __init__(self, path: Path, runtime: Runtime, *, debounce: float = DEBOUNCE_S, watch: bool = True) -> None:
        self.path = Path(path).absolute()
        self.runtime = runtime
        self.debounce = debounce
        self.watch_enabled = watch
        self.config: Config | None = None
        self.config_hash: str | None = None
        self.loaded_at: float | None = None  # time.time() of the last successful load
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.pair_errors: dict[str, str] = {}
        self.last_changes: Changes | None = None
        self.reloads: Counter[str] = Counter()  # attempted, applied, failed, unchanged
        self.triggers: Counter[str] = Counter()  # file, signal
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._sources: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self.reloading = False
        # Hooks around every reload pass (systemd's RELOADING=1/READY=1, metrics); a failing hook
        # is logged and never stops a reload.
        self.on_reloading: list[Callable[[], None]] = []
        self.on_reloaded: list[Callable[[bool], None]] = []

    # -- loading -----------------------------------------------------------------------------
    def load_initial(self) -> Prepared:
        """The start-up load: a broken file is fatal (ConfigError); a missing model is not."""
        prepared = auto.expand(load_file(self.path))
        self._commit(prepared, self.runtime.apply(prepared.entries))
        for name, err in prepared.errors.items():
            log.error("pair not served: %s: %s", name, err)
        return prepared

    async def reload(self, source: str = "signal") -> bool:
        """Read the file again and apply it; False (and the old config kept) when it is unusable."""
        self.reloads["attempted"] += 1
        self.reloading = True
        self._call(self.on_reloading)
        ok = False
        try:
            ok = await self._reload(source)
            return ok
        finally:
            self.reloading = False
            self._call(self.on_reloaded, ok)

    async def _reload(self, source: str) -> bool:
        try:
            data = await asyncio.to_thread(read_bytes, self.path)
        except ConfigError as e:
            return self._fail(str(e))
        if source == "file" and config_hash(data) == self.config_hash and self.last_error is None:
            self.reloads["unchanged"] += 1
            return True
        try:
            prepared = await asyncio.to_thread(lambda: auto.expand(prepare(data, self.path)))
        except ConfigError as e:
            return self._fail(str(e))
        entries = self._keep_previous_on_error(prepared)
        if self.config is not None and prepared.config.listen != self.config.listen:
            log.warning("config: `listen` changed; it takes effect at the next restart")
        changes = self.runtime.apply(entries)
        self._commit(prepared, changes)
        self.reloads["applied"] += 1
        log.info("config reloaded from %s (%s): %s", self.path, source, changes)
        for name, err in prepared.errors.items():
            log.error("config reload: pair %s: %s", name, err)
        return True

    def _keep_previous_on_error(self, prepared: Prepared) -> dict[str, PairEntry]:
        """A pair whose models no longer resolve keeps serving its last working declaration."""
        entries = dict(prepared.entries)
        for name, err in list(prepared.errors.items()):
            prev = self.runtime.entries.get(name.lower())
            if prev is not None and prev.name == name:
                entries[name] = prev
                prepared.errors[name] = f"{err} (still serving the previous declaration)"
        return entries

    def _commit(self, prepared: Prepared, changes: Changes) -> None:
        self.config = prepared.config
        self.config_hash = prepared.hash
        self.loaded_at = time.time()
        self.pair_errors = dict(prepared.errors)
        self.last_changes = changes
        if prepared.errors:
            self.last_error = "; ".join(f"{k}: {v}" for k, v in prepared.errors.items())
            self.last_error_at = self.loaded_at
        else:
            self.last_error = self.last_error_at = None

    def _fail(self, error: str) -> bool:
        self.reloads["failed"] += 1
        self.last_error, self.last_error_at = error, time.time()
        log.error("config reload failed, keeping the last good config: %s", error)
        return False

    @staticmethod
    def _call(hooks: list[Callable[..., None]], *args: Any) -> None:
        for hook in hooks:
            try:
                hook(*args)
            except Exception:
                log.exception("reload hook failed")

    def summary(self) -> str:
        """One line for `systemctl status`: what is served, and the last error if there is one."""
        line = f"{len(self.runtime.entries)} pair(s) from {self.path}"
        return f"{line}; last reload failed: {self.last_error}" if self.last_error else line

    # -- triggers ----------------------------------------------------------------------------
    def trigger(self, source: str) -> None:
        """Ask for a reload (event loop thread only: signal handlers and the watcher run there)."""
        self.triggers[source] += 1
        self._sources.add(source)
        self._wake.set()

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._run(), name="config-reload"))
        if self.watch_enabled:
            self._tasks.append(asyncio.create_task(self._watch(), name="config-watch"))

    async def stop(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()

    async def _run(self) -> None:
        """The single-flight loop: debounce triggers, then one reload at a time."""
        while True:
            await self._wake.wait()
            await self._quiet()
            sources, self._sources = self._sources, set()
            source = "signal" if "signal" in sources else "file"
            try:
                await self.reload(source)
            except Exception as e:  # a bug must not end reloading for the daemon's lifetime
                log.exception("config reload crashed")
                self._fail(f"internal error: {e}")

    async def _quiet(self) -> None:
        """Wait until triggers stop for `debounce` seconds (at most MAX_DELAY_S in all)."""
        deadline = time.monotonic() + MAX_DELAY_S
        while True:
            self._wake.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self._wake.wait(), min(self.debounce, left))
            except TimeoutError:
                return

    def _watch_targets(self) -> tuple[set[Path], set[str]]:
        """Directories to watch and file names that matter there (a symlinked config counts both
        the link and its target; `..data` is how Kubernetes swaps ConfigMap contents)."""
        real = self.path.resolve()
        return {self.path.parent, real.parent}, {self.path.name, real.name, "..data"}

    async def _watch(self) -> None:
        from watchfiles import awatch

        logging.getLogger("watchfiles").setLevel(logging.WARNING)  # our own reload line says it all
        while not self._stop.is_set():
            dirs, names = self._watch_targets()

            def ours(_change: object, p: str, names: set[str] = names) -> bool:
                return Path(p).name in names

            try:
                async for _ in awatch(*dirs, watch_filter=ours, recursive=False,
                                      stop_event=self._stop, debounce=400, step=50):
                    self.trigger("file")
            except Exception as e:  # a missing directory, an inotify limit: SIGHUP still works meanwhile
                log.warning("cannot watch %s (%s); retrying", ", ".join(map(str, dirs)), e)
            if not self._stop.is_set():
                await asyncio.sleep(WATCH_RETRY_S)

    # -- reporting ---------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """The config half of /sidecar/status."""
        return {
            "config": str(self.path),
            "config_hash": self.config_hash,
            "loaded_at": _iso(self.loaded_at),
            "last_error": self.last_error,
            "last_error_at": _iso(self.last_error_at),
            "reloading": self.reloading,
            "watching": self.watch_enabled and any(t.get_name() == "config-watch" and not t.done()
                                                   for t in self._tasks),
            "reloads": {k: self.reloads[k] for k in ("attempted", "applied", "failed", "unchanged")},
            "triggers": {k: self.triggers[k] for k in ("file", "signal")},
            "last_changes": vars(self.last_changes) if self.last_changes else None,
        }
