"""Ollama's native API for pairs: /api/generate, /api/chat, /api/show, /api/tags, /api/ps, /api/version.

Everything here is translation: HTTP + JSON in, a prompt and options for the runtime, pieces and
an Outcome back out as Ollama's chunks. No llama.cpp in sight.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog
from aiohttp import web

from sidecar.api.wire import (
    NDJSON,
    ApiError,
    get,
    json_response,
    line,
    local_time,
    now_utc,
    ns,
    parse_duration,
    read_body,
)
from sidecar.engine.decoder import PromptTooLong
from sidecar.runtime.manager import Loaded, Outcome, PairEntry, Runtime, ServerBusy
from sidecar.runtime.options import OptionError, coerce, effective
from sidecar.templates.chat import TemplateError

log = logging.getLogger("sidecar.api")
requests_log = structlog.get_logger("sidecar.request")

OLLAMA_VERSION = "0.12.6"  # what /api/version answers when no upstream tells us better


def runtime_of(request: web.Request) -> Runtime:
    return request.app["runtime"]


# -- small read-only routes ---------------------------------------------------------------------
async def root(_: web.Request) -> web.Response:
    return web.Response(text="Ollama is running", content_type="text/plain")


async def version(_: web.Request) -> web.Response:
    return json_response({"version": OLLAMA_VERSION})


def details(entry: PairEntry) -> dict[str, Any]:
    meta = entry.metadata
    arch = str(meta.get("general.architecture", ""))
    d: dict[str, Any] = {
        "parent_model": "",
        "format": "gguf",
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": str(meta.get("general.size_label", "")),
        "quantization_level": _quant(meta.get("general.file_type")),
        "speculative": {
            "target": entry.config.from_,
            "draft": _draft_name(entry),
        },
    }
    return d


def _draft_name(entry: PairEntry) -> str | None:
    d = entry.config.draft
    if d is None:
        return None
    return "ngram" if getattr(d, "type", None) == "ngram" else d.from_  # type: ignore[union-attr]


_FTYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
           11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
           17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


def _quant(ftype: Any) -> str:
    return _FTYPES.get(ftype, "unknown") if isinstance(ftype, int) else ""


def model_listing(entry: PairEntry) -> dict[str, Any]:
    size = entry.target.path.stat().st_size
    digest = entry.target.digest or hashlib.sha256(f"{entry.name}|{entry.target.path}|{size}".encode()).hexdigest()
    return {
        "name": entry.name,
        "model": entry.name,
        "modified_at": local_time(entry.modified),
        "size": size,
        "digest": digest,
        "details": details(entry),
    }


async def tags(request: web.Request) -> web.Response:
    rt = runtime_of(request)
    return json_response({"models": [model_listing(e) for e in rt.entries.values()]})


async def ps(request: web.Request) -> web.Response:
    rt = runtime_of(request)
    models = []
    for entry, lm in rt.loaded_entries():
        item = model_listing(entry)
        del item["modified_at"]
        forever = "2318-08-27T00:00:00.000000+00:00"  # what "never" looks like: a far-away time
        item["expires_at"] = local_time(lm.expires_at) if lm.expires_at is not None else forever
        item["size_vram"] = item["size"] if lm.weights.gpu_layers else 0
        item["context_length"] = lm.ctx.n_ctx
        models.append(item)
    models.sort(key=lambda m: m["expires_at"], reverse=True)
    return json_response({"models": models})


async def show(request: web.Request) -> web.Response:
    body = await read_body(request)
    name = get(body, "model", str, "ShowRequest") or get(body, "name", str, "ShowRequest")
    if not name:
        raise ApiError(400, "model is required")
    rt = runtime_of(request)
    entry = rt.find(name)
    if entry is None:
        raise ApiError(404, f"model '{name}' not found")
    verbose = bool(body.get("verbose"))
    info: dict[str, Any] = {}
    for k, v in entry.metadata.items():
        if k in ("general.name", "tokenizer.chat_template") and not verbose:
            continue
        if isinstance(v, list | tuple) and len(v) > 5 and not verbose:
            v = []
        elif not isinstance(v, str | int | float | bool | list):
            v = []  # an array too long to keep in memory
        info[k] = v
    params = entry.params
    param_lines = []
    for k, v in params.items():
        for item in v if isinstance(v, list) else [v]:
            shown = f'"{item}"' if isinstance(item, str) else str(item)
            param_lines.append(f"{k:<30} {shown}")
    template = entry.config.template or entry.target.template or str(
        entry.metadata.get("tokenizer.chat_template") or "{{ .Prompt }}")
    system = entry.config.system or entry.target.system or ""
    modelfile = ['# Modelfile generated by "ollama show"', f"FROM {entry.target.path}"]
    if entry.config.draft is not None:
        modelfile.append(f"# DRAFT {_draft_name(entry)}")
    modelfile.append(f'TEMPLATE """{template}"""')
    if system:
        modelfile.append(f'SYSTEM """{system}"""')
    modelfile += [f"PARAMETER {p}" for p in param_lines]
    out = {
        "license": "",
        "modelfile": "\n".join(modelfile) + "\n",
        "parameters": "\n".join(param_lines),
        "template": template,
        "system": system,
        "details": details(entry),
        "model_info": info,
        "capabilities": ["completion"],
        "modified_at": local_time(entry.modified),
    }
    if entry.config.messages:
        out["messages"] = [m.model_dump() for m in entry.config.messages]
    return json_response(out)


# -- generation -----------------------------------------------------------------------------------
def _keep_alive(body: dict[str, Any]) -> float | None:
    return parse_duration(body["keep_alive"]) if body.get("keep_alive") is not None else None


def _stream(body: dict[str, Any], struct: str) -> bool:
    return bool(get(body, "stream", bool, struct, True))


def _check_format(body: dict[str, Any]) -> None:
    fmt = body.get("format")
    if fmt in (None, "", "json") or isinstance(fmt, dict):
        if fmt:
            raise ApiError(400, "format (structured output) is not supported for speculative pairs yet")
        return
    raise ApiError(400, f'invalid format: "{fmt}"; expected "json" or a valid JSON Schema object')


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = get(body, "messages", list, "ChatRequest", [])
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"json: cannot unmarshal {type(m).__name__} into Go struct field "
                                f"ChatRequest.messages of type api.Message (message {i})")
        role = get(m, "role", str, "Message", "").lower()
        content = get(m, "content", str, "Message", "")
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.get("tool_calls"):
            msg["tool_calls"] = get(m, "tool_calls", list, "Message")
        if m.get("tool_name"):
            msg["tool_name"] = get(m, "tool_name", str, "Message")
        out.append(msg)
    return out


async def generate(request: web.Request) -> web.StreamResponse:
    t_start = time.perf_counter()
    body = await read_body(request)
    S = "GenerateRequest"
    name = get(body, "model", str, S, "")
    rt = runtime_of(request)
    entry = rt.find(name) if name else None
    if entry is None:
        raise ApiError(404, f"model '{name}' not found")
    prompt = get(body, "prompt", str, S, "")
    system = get(body, "system", str, S)
    template = get(body, "template", str, S)
    raw = get(body, "raw", bool, S, False)
    context = get(body, "context", list, S)
    if context is not None and not all(isinstance(t, int) and not isinstance(t, bool) for t in context):
        raise ApiError(400, f"json: cannot unmarshal into Go struct field {S}.context of type int")
    if raw and (template or system or context):
        raise ApiError(400, "raw mode does not support template, system, or context")
    if get(body, "suffix", str, S):
        raise ApiError(400, f'"{entry.name}" does not support insert')
    if get(body, "images", list, S):
        raise ApiError(400, f'"{entry.name}" does not support images')
    _check_format(body)
    keep_alive = _keep_alive(body)
    stream = _stream(body, S)

    if not prompt and not context:
        return await _load_or_unload(request, rt, entry, keep_alive, chat=False)

    messages: list[dict[str, Any]] = []
    sys_text = system if system is not None else (entry.config.system or entry.target.system)
    if sys_text:
        messages.append({"role": "system", "content": sys_text})
    if context is None:
        messages += [m.model_dump() for m in entry.config.messages] or list(entry.target.messages)
    messages.append({"role": "user", "content": prompt})

    def render(lm: Loaded) -> tuple[str, list[int] | None]:
        if raw:
            return prompt, None
        return rt.template(entry, lm, template).render(messages), context

    return await _run(request, rt, entry, body, render, stream, keep_alive, t_start, chat=False,
                      with_context=not raw)


async def chat(request: web.Request) -> web.StreamResponse:
    t_start = time.perf_counter()
    body = await read_body(request)
    S = "ChatRequest"
    name = get(body, "model", str, S, "")
    if not name:
        raise ApiError(400, "model is required")
    rt = runtime_of(request)
    entry = rt.find(name)
    if entry is None:
        raise ApiError(404, f"model '{name}' not found")
    messages = _messages(body)
    tools = get(body, "tools", list, S)
    if tools:
        raise ApiError(400, f"{entry.name} does not support tools")
    think = body.get("think")
    if think not in (None, False):
        if think is True or think in ("low", "medium", "high", "max"):
            raise ApiError(400, f'"{entry.name}" does not support thinking')
        raise ApiError(400, f'invalid think value: "{think}" (must be "high", "medium", "low", "max", true, or false)')
    _check_format(body)
    keep_alive = _keep_alive(body)
    stream = _stream(body, S)
    if not messages:
        return await _load_or_unload(request, rt, entry, keep_alive, chat=True)
    history = [m.model_dump() for m in entry.config.messages] or list(entry.target.messages)
    sys_text = entry.config.system or entry.target.system
    full = history + messages
    if sys_text and messages[0]["role"] != "system":
        full = [{"role": "system", "content": sys_text}, *full]

    def render(lm: Loaded) -> tuple[str, list[int] | None]:
        return rt.template(entry, lm, None).render(full), None

    return await _run(request, rt, entry, body, render, stream, keep_alive, t_start, chat=True)


def _chunk(entry: PairEntry, chat: bool, text: str, done: bool) -> dict[str, Any]:
    c: dict[str, Any] = {"model": entry.name, "created_at": now_utc()}
    if chat:
        c["message"] = {"role": "assistant", "content": text}
    else:
        c["response"] = text
    c["done"] = done
    return c


async def _load_or_unload(request: web.Request, rt: Runtime, entry: PairEntry, keep_alive: float | None,
                          chat: bool) -> web.Response:
    if keep_alive == 0:
        await rt.unload(entry)
        reason = "unload"
    else:
        try:
            lm, _ = await rt.load(entry)
        except Exception as e:
            raise ApiError(500, f"failed to load {entry.name}: {e}") from e
        rt.touch(lm, keep_alive)
        reason = "load"
    c = _chunk(entry, chat, "", True)
    c["done_reason"] = reason
    return web.Response(text=line(c).decode(), content_type="application/json")


async def _run(request: web.Request, rt: Runtime, entry: PairEntry, body: dict[str, Any],
               render: Callable[[Loaded], tuple[str, list[int] | None]], stream: bool,
               keep_alive: float | None, t_start: float, *, chat: bool,
               with_context: bool = False) -> web.StreamResponse:
    try:
        opts = effective(entry.params, coerce(body.get("options")))
    except OptionError as e:
        raise ApiError(400, str(e)) from None

    if body.get("_debug_render_only"):
        lm, _ = await rt.load(entry, opts.num_ctx)
        text, _ = _render(render, lm)
        return json_response({"model": entry.name, "created_at": now_utc(),
                                  "_debug_info": {"rendered_template": text}})

    def prompt_of(lm: Loaded) -> tuple[str, list[int] | None]:
        return _render(render, lm)

    events = rt.generate(entry, prompt_of, opts, keep_alive)
    if not stream:
        parts: list[str] = []
        outcome: Outcome | None = None
        try:
            async for ev in events:
                if isinstance(ev, Outcome):
                    outcome = ev
                else:
                    parts.append(ev)
        except Exception as e:
            raise _api_error(e) from e
        assert outcome is not None
        _log_request(request, entry, outcome, "ok")
        final = _chunk(entry, chat, "".join(parts), True)
        final.update(_final_fields(outcome, t_start, with_context))
        return web.Response(text=line(final).decode(), content_type="application/json")

    # Streaming: nothing is sent until the first event, so early errors keep their status code.
    it: AsyncIterator[str | Outcome] = events.__aiter__()
    try:
        first = await it.__anext__()
    except Exception as e:
        raise _api_error(e) from e
    resp = web.StreamResponse(headers={"Content-Type": NDJSON})
    await resp.prepare(request)
    ev: str | Outcome = first
    try:
        while True:
            if isinstance(ev, Outcome):
                final = _chunk(entry, chat, "", True)
                final.update(_final_fields(ev, t_start, with_context))
                await resp.write(line(final))
                _log_request(request, entry, ev, "ok")
                break
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("client went away")
            await resp.write(line(_chunk(entry, chat, ev, False)))
            ev = await it.__anext__()
    except (ConnectionResetError, ConnectionError):
        log.info("client went away; generation stopped")
        await it.aclose()  # type: ignore[attr-defined]
        return resp
    except Exception as e:  # after the first byte: one last error line, no done:true
        log.exception("generation failed mid-stream")
        await resp.write(line({"error": _api_error(e).message}))
    await resp.write_eof()
    return resp


def _log_request(request: web.Request, entry: PairEntry, o: Outcome, status: str) -> None:
    """The one summary line per request: what it cost and whether speculation paid."""
    r = o.result
    requests_log.info(
        "request", path=request.path, model=entry.name, status=status, done_reason=r.done_reason,
        prompt_tokens=r.prompt_tokens, tokens=len(r.tokens),
        tok_s=round(len(r.tokens) / r.eval_seconds, 1) if r.eval_seconds > 0 else 0.0,
        drafter=r.drafter, draft_tokens=r.draft_tokens, draft_accepted_tokens=r.draft_accepted_tokens,
        draft_rounds=r.draft_rounds,
        acceptance=round(r.draft_accepted_tokens / r.draft_tokens, 3) if r.draft_tokens else None,
        fallback=r.fallback,
    )


def _render(render: Callable[[Loaded], tuple[str, list[int] | None]], lm: Loaded) -> tuple[str, list[int] | None]:
    try:
        return render(lm)
    except TemplateError as e:
        raise ApiError(400, f"template error: {e}") from None


def _api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, PromptTooLong):
        return ApiError(400, str(e))
    if isinstance(e, ServerBusy):
        return ApiError(503, str(e))
    return ApiError(500, f"an error was encountered while running the model: {e}")


def _final_fields(o: Outcome, t_start: float, with_context: bool) -> dict[str, Any]:
    r = o.result
    out: dict[str, Any] = {"done_reason": "" if r.done_reason == "cancel" else r.done_reason}
    if with_context:
        out["context"] = o.context
    out.update({
        "total_duration": ns(time.perf_counter() - t_start),
        "load_duration": ns(o.load_seconds),
        "prompt_eval_count": r.prompt_tokens,
        "prompt_eval_duration": ns(r.prompt_seconds),
        "eval_count": len(r.tokens),
        "eval_duration": ns(r.eval_seconds),
        "draft_tokens": r.draft_tokens,
        "draft_accepted_tokens": r.draft_accepted_tokens,
        "draft_rounds": r.draft_rounds,
        "fallback": r.fallback,
    })
    return out
