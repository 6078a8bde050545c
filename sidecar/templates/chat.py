"""Turning messages into the prompt text a model expects.

Go templates (Ollama's TEMPLATE) render exactly as Ollama renders them (templates.gotemplate);
jinja templates (a GGUF's `tokenizer.chat_template`) render the way llama.cpp's server and
transformers do. Which one a pair uses is decided in runtime.render.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sidecar.templates.gotemplate import GoTemplate, TemplateError
from sidecar.templates.ollama import render_ollama

__all__ = ["FALLBACK_TEMPLATE", "ChatTemplate", "GoChatTemplate", "JinjaChatTemplate", "TemplateError"]

# Used when a model ships no template at all (what Ollama's `{{ .Prompt }}` default amounts to).
FALLBACK_TEMPLATE = "{{- if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}"


Think = bool | str | None  # Ollama's `think`: unset, on/off, or a level ("low" ... "max")


class ChatTemplate(Protocol):
    source: str

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               think: Think = None) -> str: ...


class GoChatTemplate:
    def __init__(self, source: str) -> None:
        self.source = source
        self._tmpl = GoTemplate(source)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               think: Think = None) -> str:
        return render_ollama(self._tmpl, messages, tools=tools or None, think=think)

    def render_fim(self, prompt: str, suffix: str, think: Think = None) -> str:
        """Fill in the middle: the template gets `.Prompt` and `.Suffix`, no system, no messages."""
        return render_ollama(self._tmpl, prompt=prompt, suffix=suffix, think=think)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class JinjaChatTemplate:
    """A GGUF `tokenizer.chat_template`, rendered like transformers' apply_chat_template."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._tmpl = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise TemplateError(f"chat template: {e.message} (line {e.lineno})") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               think: Think = None) -> str:
        # What llama.cpp's server passes a thinking template (common/chat.cpp): `enable_thinking`,
        # and for gpt-oss style templates `reasoning_effort` (low/medium/high; "max" is "high").
        extra: dict[str, Any] = {}
        if think is not None:
            extra["enable_thinking"] = think is True or isinstance(think, str)
            if isinstance(think, str):
                extra["reasoning_effort"] = "high" if think == "max" else think
        try:
            return self._tmpl.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"chat template: {e}") from None
