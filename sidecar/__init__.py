"""spec-sidecar: speculative decoding behind Ollama's API."""

__version__ = "0.1.0"
