"""The llama.cpp engine (llama-cpp-python's bindings): the one place the runtime meets llama.cpp."""

from sidecar.runtime.llamacpp.engine import LlamaEngine

__all__ = ["LlamaEngine"]
