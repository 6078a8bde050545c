#!/bin/sh
# The llama.cpp backend this machine can build for, as CMake arguments for llama-cpp-python.
# Like Ollama, find the GPU without being told: CUDA when a toolkit (nvcc) is found and a GPU
# answers nvidia-smi (built for that GPU's architecture), Metal on Apple silicon, else the CPU.
# A toolkit without a GPU builds for the CPU: a CUDA build there takes most of an hour on two
# cores, and nothing would run on it. The CPU build turns llamafile's sgemm off (README,
# "Losslessness"); so does the CUDA build, whose CPU layers the exact-equality tests use.
# On x86 both also build without AMX: ggml's native build takes AMX-INT8 from -march=native on
# CPUs that have it (Sapphire Rapids and later), and its AMX matmul, like llamafile's, runs only
# for batches, so a token scored alone and inside a batch would part; in llama-cpp-python 0.3.36
# it also crashes on Q4_1 weights (SmolLM2's) at the first prompt of more than a few tokens.
# -mno-amx-int8 holds against a later -march=native (gcc and clang keep explicit ISA choices).
# Prints "<backend>|<cmake args>|<why>"; with --cpu, only the CPU kernels' arguments (what
# bench/llama_server.py builds its llama-server with, so both leave out the same kernels).
set -u
cpu="-DGGML_LLAMAFILE=OFF"
case "$(uname -m)" in
    x86_64|amd64|i?86) cpu="$cpu -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8" ;;
esac
if [ "${1:-}" = "--cpu" ]; then
    echo "$cpu"
    exit 0
fi
nvcc=$(command -v nvcc 2>/dev/null || true)
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
case "$cap" in *[!0-9]*) cap="" ;; esac
if [ -n "$nvcc" ] && [ -n "$cap" ]; then
    echo "cuda|-DGGML_CUDA=on $cpu -DCMAKE_CUDA_COMPILER=$nvcc -DCMAKE_CUDA_ARCHITECTURES=$cap|nvcc $nvcc, GPU compute capability $cap"
elif [ "$(uname -s)" = Darwin ] && [ "$(uname -m)" = arm64 ]; then
    echo "metal|-DGGML_METAL=on|Apple silicon"
elif [ -n "$nvcc" ]; then
    echo "cpu|$cpu|nvcc found but no GPU answers nvidia-smi"
else
    echo "cpu|$cpu|no CUDA toolkit, not Apple silicon"
fi
