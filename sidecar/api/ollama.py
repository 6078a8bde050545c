"""Ollama's native API for pairs: /api/generate, /api/chat, /api/show, /api/tags, /api/ps, /api/version.

Everything here is translation: HTTP + JSON in, a prompt and options for the runtime, pieces and
an Outcome back out as Ollama's chunks. No llama.cpp in sight.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from aiohttp import web

from sidecar.api import generation, proxy
from sidecar.api.generation import Generation, Render, client_gone
from sidecar.api.wire import (
    NDJSON,
    ApiError,
    dumps,
    get,
    json_response,
    line,
    local_time,
    now_utc,
    ns,
    parse_duration,
    read_body,
)
from sidecar.runtime.manager import Loaded, Outcome, PairEntry, Runtime
from sidecar.templates.tools import ToolCallParser, supports_tools

OLLAMA_VERSION = "0.12.6"  # what /api/version answers when no upstream tells us better


def runtime_of(request: web.Request) -> Runtime:
    return request.app["runtime"]


# -- small read-only routes ---------------------------------------------------------------------
async def root(_: web.Request) -> web.Response:
    return web.Response(text="Ollama is running", content_type="text/plain")


async def version(request: web.Request) -> web.Response:
    """The upstream's version when it answers (clients gate features on it), else our own."""
    up = proxy.upstream_of(request)
    if up is not None and await up.flavour() == "ollama":
        theirs = await up.get_json(request, "/api/version")
        if isinstance(theirs, dict) and isinstance(theirs.get("version"), str):
            return json_response({"version": theirs["version"]})
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


async def _upstream_models(request: web.Request, path: str) -> list[dict[str, Any]]:
    """The upstream's listing minus the names a pair shadows (each name appears once: the pair)."""
    up = proxy.upstream_of(request)
    if up is None or await up.flavour() != "ollama":
        return []  # LM Studio's models are reachable through /v1 only; /v1/models lists them
    theirs = await up.get_json(request, path)
    items = theirs.get("models") if isinstance(theirs, dict) else None
    rt = runtime_of(request)
    return [m for m in items if isinstance(m, dict) and not rt.find(str(m.get("model") or m.get("name") or ""))] \
        if isinstance(items, list) else []


async def tags(request: web.Request) -> web.Response:
    rt = runtime_of(request)
    ours = [model_listing(e) for e in rt.entries.values()]
    return json_response({"models": ours + await _upstream_models(request, "/api/tags")})


async def ps(request: web.Request) -> web.Response:
    rt = runtime_of(request)
    models = []
    for entry, lm in rt.loaded_entries():
        item = model_listing(entry)
        del item["modified_at"]
        forever = "2318-08-27T00:00:00.000000+00:00"  # what "never" looks like: a far-away time
        item["expires_at"] = local_time(lm.expires_at) if lm.expires_at is not None else forever
        item["size_vram"] = item["size"] if lm.weights.gpu_layers else 0
        item["context_length"] = lm.n_ctx
        models.append(item)
    models.sort(key=lambda m: m["expires_at"], reverse=True)
    return json_response({"models": models + await _upstream_models(request, "/api/ps")})


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
    template = generation.template_source(entry)
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
        "capabilities": ["completion", "tools"] if supports_tools(template) else ["completion"],
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


def _format(body: dict[str, Any]) -> str | dict[str, Any] | None:
    """Ollama's `format`: absent, null or "" (none), "json", or a JSON schema object."""
    fmt = body.get("format")
    if fmt in (None, ""):
        return None
    if fmt == "json" or isinstance(fmt, dict):
        return fmt
    raw = fmt if isinstance(fmt, str) else dumps(fmt)
    raise ApiError(400, f'invalid format: "{raw}"; expected "json" or a valid JSON Schema object')


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
        if m.get("tool_call_id"):
            msg["tool_call_id"] = get(m, "tool_call_id", str, "Message")
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
    fmt = _format(body)
    keep_alive = _keep_alive(body)
    stream = _stream(body, S)

    if not prompt and not context:
        return await _load_or_unload(request, rt, entry, keep_alive, chat=False)

    messages = generation.completion_messages(entry, prompt, system, with_history=context is None)

    def render(lm: Loaded) -> tuple[str, list[int] | None]:
        if raw:
            return prompt, None
        return rt.template(entry, lm, template).render(messages), context

    return await _run(request, rt, entry, body, render, stream, keep_alive, t_start, chat=False,
                      with_context=not raw, fmt=fmt)


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
    tools = get(body, "tools", list, S) or None
    if tools and not supports_tools(generation.template_source(entry)):
        raise ApiError(400, f"{entry.name} does not support tools")
    think = body.get("think")
    if think not in (None, False):
        if think is True or think in ("low", "medium", "high", "max"):
            raise ApiError(400, f'"{entry.name}" does not support thinking')
        raise ApiError(400, f'invalid think value: "{think}" (must be "high", "medium", "low", "max", true, or false)')
    fmt = _format(body)
    keep_alive = _keep_alive(body)
    stream = _stream(body, S)
    if not messages:
        return await _load_or_unload(request, rt, entry, keep_alive, chat=True)
    full = generation.chat_messages(entry, messages)

    def render(lm: Loaded) -> tuple[str, list[int] | None]:
        return rt.template(entry, lm, None).render(full, tools), None

    # Like Ollama, tool calls are looked for only when the request offers tools.
    parser = ToolCallParser(generation.template_source(entry), tools) if tools else None
    return await _run(request, rt, entry, body, render, stream, keep_alive, t_start, chat=True, fmt=fmt,
                      parser=parser)


def _chunk(entry: PairEntry, chat: bool, text: str, done: bool,
           tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"model": entry.name, "created_at": now_utc()}
    if chat:
        c["message"] = {"role": "assistant", "content": text}
        if tool_calls:
            c["message"]["tool_calls"] = tool_calls
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


async def _run(request: web.Request, rt: Runtime, entry: PairEntry, body: dict[str, Any], render: Render,
               stream: bool, keep_alive: float | None, t_start: float, *, chat: bool,
               with_context: bool = False, fmt: str | dict[str, Any] | None = None,
               parser: ToolCallParser | None = None) -> web.StreamResponse:
    opts = generation.options(entry, body.get("options"))

    if body.get("_debug_render_only"):
        lm, _ = await rt.load(entry, opts.num_ctx)
        text, _ = generation.render(render, lm)
        return json_response({"model": entry.name, "created_at": now_utc(),
                              "_debug_info": {"rendered_template": text}})

    # Nothing is sent until the first event, so early errors keep their status code.
    gen = await Generation.start(rt, entry, render, opts, keep_alive, fmt)
    if not stream:
        text, calls, outcome = await gen.text(parser)
        gen.finish(request, entry)
        final = _chunk(entry, chat, text, True, calls)
        final.update(_final_fields(outcome, t_start, with_context))
        return web.Response(text=line(final).decode(), content_type="application/json")

    resp = web.StreamResponse(headers={"Content-Type": NDJSON})
    await resp.prepare(request)
    try:
        async for piece in gen.pieces():
            if client_gone(request):
                raise ConnectionResetError("client went away")
            await _write_piece(resp, entry, chat, parser, piece)
        if parser is not None:
            await _write_piece(resp, entry, chat, parser, None)
        assert gen.outcome is not None
        final = _chunk(entry, chat, "", True)
        final.update(_final_fields(gen.outcome, t_start, with_context))
        await resp.write(line(final))
        gen.finish(request, entry)
    except (ConnectionResetError, ConnectionError):
        gen.disconnected(request, entry)
        await gen.aclose()
        return resp
    except Exception as e:  # after the first byte: one last error line, no done:true
        await resp.write(line({"error": generation.failed_mid_stream(e).message}))
    await resp.write_eof()
    return resp


async def _write_piece(resp: web.StreamResponse, entry: PairEntry, chat: bool, parser: ToolCallParser | None,
                       piece: str | None) -> None:
    """One streamed piece (None: the end), with tool calls split out into their own chunk as in Ollama."""
    if parser is None:
        content, calls = piece or "", []
    else:
        content, calls = parser.feed(piece) if piece is not None else parser.flush()
    if content:
        await resp.write(line(_chunk(entry, chat, content, False)))
    if calls:
        await resp.write(line(_chunk(entry, chat, "", False, calls)))


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
