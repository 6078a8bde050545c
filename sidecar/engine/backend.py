"""llama.cpp's backends, initialised once per process, and what they say of this machine."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import threading

import llama_cpp as C

_backend_lock = threading.Lock()
_backend_ready = False
_log_callback: object = None  # keeps the ctypes callback alive


def init_backend() -> None:
    global _backend_ready, _log_callback
    with _backend_lock:
        if _backend_ready:
            return
        C.llama_backend_init()
        # llama.cpp logs every tensor at load; keep warnings and errors only (level 3 = WARN, 4 = ERROR).
        log = logging.getLogger("llama.cpp")

        @C.llama_log_callback
        def _cb(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
            if level in (3, 4) and text:
                log.warning(text.decode("utf-8", "replace").rstrip())

        _log_callback = _cb
        C.llama_log_set(_cb, ctypes.c_void_p(0))
        _backend_ready = True


def default_threads() -> int:
    """CPUs this process may run on (respects taskset/cgroup affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def gpu_offload_supported() -> bool:
    init_backend()
    return bool(C.llama_supports_gpu_offload())


def system_info() -> str:
    init_backend()
    return C.llama_print_system_info().decode("utf-8", "replace").strip()


@functools.cache
def backend_id() -> str:
    """A short hash of system_info(): the build and the backends (CPU features, GPUs) it runs on, which
    every timing kept between runs (cost curves, probes) is measured under."""
    return hashlib.sha256(system_info().encode()).hexdigest()[:12]
