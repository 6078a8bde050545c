"""Loading pairs.yaml into the runtime, and reloading it while the daemon serves.

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
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sidecar.config.loader import ConfigError, parse
from sidecar.config.schema import Config
from sidecar.models.resolve import Stores
from sidecar.runtime.manager import Changes, PairEntry, Runtime, build_entry

log = logging.getLogger("sidecar.config")

DEBOUNCE_S = 0.3  # quiet time after the last trigger before a reload starts
MAX_DELAY_S = 2.0  # ...but a stream of events never postpones it longer than this
WATCH_RETRY_S = 2.0  # when the watched directory is missing


@dataclass
class Prepared:
    """A config file read, validated and resolved, not yet applied."""

    config: Config
    hash: str
    entries: dict[str, PairEntry] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # pair name -> why it could not be resolved


def config_hash(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: the file is missing") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None


def _key_line(text: str, keys: tuple[str, ...]) -> int:
    """The line a nested mapping key is written on (1 if it cannot be found)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return 1
    line = 1
    for key in keys:
        if not isinstance(node, yaml.MappingNode):
            break
        match = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None)
        if match is None:
            break
        line, node = match[0].start_mark.line + 1, match[1]
    return line


def stores_of(config: Config, text: str, path: Path) -> Stores:
    """The `models:` store locations, with schema-style errors (file:line: key: message)."""
    try:
        return Stores.from_config(config.models, base=path.parent)
    except ValueError as e:
        key = str(e).split(":", 1)[0]
        raise ConfigError(f"{path}:{_key_line(text, tuple(key.split('.')))}: {e}") from None


def build_entries(config: Config, base: Path, stores: Stores | None = None
                  ) -> tuple[dict[str, PairEntry], dict[str, str]]:
    """Resolve every pair's models; a pair that fails is reported, the others still build."""
    entries: dict[str, PairEntry] = {}
    errors: dict[str, str] = {}
    for name, pair in config.pairs.items():
        try:
            entries[name] = build_entry(name, pair, base, stores)
        except Exception as e:  # ModelNotFound, GGUFError, OSError: each names its file
            errors[name] = str(e)
    return entries, errors


def prepare(data: bytes, path: Path) -> Prepared:
    """Parse, validate and resolve a config's bytes; raises ConfigError when the file is unusable.

    Blocking (file system, GGUF headers): run it in a thread when the event loop is serving."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    config = parse(text, str(path))
    stores = stores_of(config, text, path)
    entries, errors = build_entries(config, path.parent, stores)
    return Prepared(config, config_hash(data), entries, errors)


def load_file(path: Path) -> Prepared:
    return prepare(read_bytes(path), path)


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
        prepared = load_file(self.path)
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
            prepared = await asyncio.to_thread(prepare, data, self.path)
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
