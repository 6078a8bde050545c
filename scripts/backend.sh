#!/bin/sh
# The llama.cpp backend this machine can build for, as CMake arguments for llama-cpp-python.
# Like Ollama, find the GPU without being told: CUDA when a toolkit (nvcc) is found and a GPU
# answers nvidia-smi (built for that GPU's architecture), Metal on Apple silicon, else the CPU.
# A toolkit without a GPU builds for the CPU: a CUDA build there takes most of an hour on two
# cores, and nothing would run on it. The CPU build turns llamafile's sgemm off (README,
# "Losslessness"); so does the CUDA build, whose CPU layers the exact-equality tests use.
# Prints "<backend>|<cmake args>|<why>".
set -u
cpu="-DGGML_LLAMAFILE=OFF"
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
