"""The vLLM engine: pairs whose target runs on a vLLM server, managed by the daemon or remote."""

from sidecar.runtime.vllm.engine import VllmEngine

__all__ = ["VllmEngine"]
