"""Exit 1 when the installed llama-cpp-python has a batch-only kernel that CMAKE_ARGS leaves out.

pip reuses a wheel it cached from an earlier build of the same version, whatever arguments that
build had; the Makefile rebuilds when this says the one installed is not what CMAKE_ARGS asks for.
Only the kernels the arguments turn off are checked (a Metal build keeps llamafile, by its args).
"""

from __future__ import annotations

import os
import sys

from sidecar.engine.kernels import flags_on
from sidecar.engine.llama import system_info

# The CMake argument that leaves a kernel out, and the flag system_info() shows as "= 1" when it is in.
LEFT_OUT = {"-DGGML_LLAMAFILE=OFF": "LLAMAFILE", "-mno-amx-int8": "AMX_INT8"}

if __name__ == "__main__":
    args, on = os.environ.get("CMAKE_ARGS", ""), flags_on(system_info())
    stale = [flag for arg, flag in LEFT_OUT.items() if arg in args and flag in on]
    if stale:
        print(f"installed llama-cpp-python has {', '.join(stale)} though CMAKE_ARGS leaves it out: rebuilding")
    sys.exit(1 if stale else 0)
