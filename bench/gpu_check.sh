#!/usr/bin/env bash
# Issue #54's GPU check, for a session lent a GPU: the CUDA build, the lossless tests, host time per
# step, and the concurrency table (plain, n-gram, the padded pair's draft) against llama-server at
# N = 1, 4, 8. Its record: bench/results/2026-12-07-host-time.md (the GPU part is unmeasured there).
#
# Needs on the device machine (it reaches no network): the project's Python environment at $PY,
# nvcc and ninja, and llama-cpp-python 0.3.36's source at $SDIST_DIR (the sdist unpacked, as
# bench/llama_server.py --build-only leaves it; the tarball alone is 73 MiB, over a run's carry).
# About 10 minutes on 16 cores: two CUDA builds (~3 min each), tests ~2 min, benches ~4 min.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/out/gpu}
SDIST_DIR=${SDIST_DIR:-bench/out/llama.cpp/llama_cpp_python-0.3.36}
SRC=$SDIST_DIR/vendor/llama.cpp
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

# 1. The binding with CUDA, and llama-server from the same vendored llama.cpp (where
#    bench/llama_server.py's build() looks for it, so concurrency.py takes this one).
CMAKE_ARGS="-DGGML_CUDA=on" CMAKE_BUILD_PARALLEL_LEVEL=16 \
    "$PY" -m pip install --no-deps --no-build-isolation --force-reinstall "$SDIST_DIR" 2>&1 | tail -2
cmake -S "$SRC" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=on \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF > /dev/null
cmake --build "$SRC/build" -j16 --target llama-server 2>&1 | tail -1

# 2. Losslessness: greedy output identical to target-only, alone and in a batch.
PYTHONPATH=$PWD "$PY" -m pytest tests/test_lossless.py tests/test_batch.py -x -q 2>&1 | tail -3 | tee "$OUT/tests.txt"

# 3. Host time per step, in-process at fixed prices, both vocabularies, against the landed revision.
PYTHONPATH=$PWD "$PY" bench/step_python.py --old-rev 044a37f --n 1,8 --reps 1 --tokens 64 --models smollm2,gemma --overlap \
    | tee "$OUT/step_python.md"

# 4. The daemon against llama-server, every layer on the GPU (BENCH_NGL), 1 rep to fit the budget.
BENCH_NGL=99 PYTHONPATH=$PWD "$PY" bench/concurrency.py --n 1,4,8 --reps 1 --threads 8 --padded \
    --configs batched,batched+ngram,llama-server-none,llama-server-ngram-mod --json "$OUT/concurrency.json" \
    | tee "$OUT/concurrency.md"
