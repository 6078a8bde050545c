"""The GPUs llama.cpp can use and their free memory, from ggml's device API in the wheel's own libraries.

llama-cpp-python binds llama.h only; the device registry is ggml's (ggml-backend.h:
`ggml_backend_dev_count`, `ggml_backend_dev_get`, `ggml_backend_dev_type`, `ggml_backend_dev_name`,
`ggml_backend_dev_description`, `ggml_backend_dev_memory`), in the libggml*.so files beside
libllama.so. Reached through ctypes, they tell the plan (runtime.memory) what each GPU has free
right now, which counts what every other process (the upstream Ollama included) holds there.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from sidecar.engine.backend import gpu_offload_supported

# enum ggml_backend_dev_type (ggml-backend.h)
_CPU, _GPU, _IGPU, _ACCEL = 0, 1, 2, 3


@functools.cache
def _ggml() -> ctypes.CDLL | None:
    """libggml (the registry, which pulls in libggml-base) from llama_cpp's lib folder, or None."""
    import llama_cpp

    folder = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml.so", "libggml.dylib", "ggml.dll", "libggml-base.so"):
        path = folder / name
        if not path.exists():
            continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            continue
        try:
            lib.ggml_backend_dev_count.restype = ctypes.c_size_t
            lib.ggml_backend_dev_get.restype = ctypes.c_void_p
            lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
            lib.ggml_backend_dev_type.restype = ctypes.c_int
            lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
            for fn in (lib.ggml_backend_dev_name, lib.ggml_backend_dev_description):
                fn.restype = ctypes.c_char_p
                fn.argtypes = [ctypes.c_void_p]
            lib.ggml_backend_dev_memory.restype = None
            lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                                    ctypes.POINTER(ctypes.c_size_t)]
        except AttributeError:  # a build without the device API
            continue
        return lib
    return None


def list_devices() -> list[tuple[str, str, str, int, int]]:
    """Every ggml device: (kind "cpu"/"gpu"/"igpu"/"accel", name, description, free, total) bytes."""
    gpu_offload_supported()  # initialises llama.cpp's backends, which registers the devices
    lib = _ggml()
    if lib is None:
        return []
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = {_CPU: "cpu", _GPU: "gpu", _IGPU: "igpu", _ACCEL: "accel"}.get(lib.ggml_backend_dev_type(dev), "?")
        name = (lib.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace")
        desc = (lib.ggml_backend_dev_description(dev) or b"").decode("utf-8", "replace")
        out.append((kind, name, desc, int(free.value), int(total.value)))
    return out


def gpus() -> list[tuple[str, str, int, int]]:
    """The GPUs llama.cpp offloads to: (name, description, free, total)."""
    return [(name, desc, free, total) for kind, name, desc, free, total in list_devices() if kind in ("gpu", "igpu")]
