"""Ollama's native API for pairs: /api/generate, /api/chat, /api/show, /api/tags, /api/ps, /api/version.

Everything here is translation: a request body becomes a Job for the runtime (api.respond runs
it), and Deltas and the Outcome become Ollama's NDJSON chunks (`OllamaFraming`). No llama.cpp in
sight.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

from aiohttp import web

from sidecar.api import proxy
from sidecar.api.pairs import find_pair, runtime_of
from sidecar.api.requests import ChatRequest, GenerateRequest, ShowRequest
from sidecar.api.respond import joined, logprobs_json, respond
from sidecar.api.wire import (
    NDJSON,
    ApiError,
    dumps,
    json_response,
    line,
    local_time,
    now_utc,
    ns,
    parse_duration,
    read_body,
)
from sidecar.config.entries import PairEntry, metadata_of
from sidecar.runtime.contract import Delta, Job, Outcome, Prompt
from sidecar.runtime.render import full_name

# What /api/version answers when no upstream tells us better: a current release (clients gate
# features such as thinking and logprobs on it). The wire contract followed is Ollama's fb30760.
OLLAMA_VERSION = "0.32.0"


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
            "draft": entry.draft_label,
            **({"auto": True} if entry.auto else {}),  # served by `auto: true` under the model's own name
        },
    }
    return d


_FTYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
           11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
           17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


def _quant(ftype: Any) -> str:
    return _FTYPES.get(ftype, "unknown") if isinstance(ftype, int) else ""


def model_listing(entry: PairEntry) -> dict[str, Any]:
    size = entry.size
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
    for entry, served in rt.loaded_entries():
        s = served.status()
        item = model_listing(entry)
        del item["modified_at"]
        forever = "2318-08-27T00:00:00.000000+00:00"  # what "never" looks like: a far-away time
        item["expires_at"] = local_time(s.expires_at) if s.expires_at is not None else forever
        if served.plan is not None:  # Ollama's size and size_vram: its load's memory (server/sched.go, MemorySize)
            item["size"], item["size_vram"] = served.plan.total, served.plan.vram
        else:
            item["size_vram"] = item["size"] if s.gpu_layers else 0
        item["context_length"] = s.context_length
        # Not Ollama's: the batch the target decodes (README, Concurrency), under a key of its own.
        item["sidecar"] = {"parallel": s.parallel, "busy": s.busy,
                           "rows_per_step": round(s.rows / s.steps, 2) if s.steps else 0.0,
                           "cached_tokens": s.cached_tokens, "restored_tokens": s.restored_tokens}
        if s.host_share is not None:  # the step loop's own time, of its recent steps' (engine.hosttime)
            item["sidecar"]["host_share"] = round(s.host_share, 3)
        models.append(item)
    models.sort(key=lambda m: m["expires_at"], reverse=True)
    return json_response({"models": models + await _upstream_models(request, "/api/ps")})


async def show(request: web.Request) -> web.Response:
    req = ShowRequest.read(await read_body(request))
    name = req.model or req.name
    if not name:
        raise ApiError(400, "model is required")
    entry = find_pair(request, name)
    # Ollama's GetModelInfo: every array in full when verbose, else arrays over 5 items as [];
    # general.name and the chat template never.
    meta = await asyncio.to_thread(metadata_of, entry.target.path, full=True) if req.verbose else entry.metadata
    info: dict[str, Any] = {}
    for k, v in meta.items():
        if k in ("general.name", "tokenizer.chat_template"):
            continue
        short = not req.verbose and isinstance(v, list) and len(v) > 5
        if short or not isinstance(v, str | int | float | bool | list):
            v = []
        info[k] = v
    params = entry.params
    param_lines = []
    for k, v in params.items():
        for item in v if isinstance(v, list) else [v]:
            shown = f'"{item}"' if isinstance(item, str) else str(item)
            param_lines.append(f"{k:<30} {shown}")
    template = runtime_of(request).format(entry).shown_template  # the Go template, as Ollama shows it
    system = entry.system
    modelfile = ['# Modelfile generated by "ollama show"', f"FROM {entry.target.path}"]
    if entry.config.draft is not None:
        modelfile.append(f"# DRAFT {entry.draft_label}")
    modelfile.append(f'TEMPLATE """{template}"""')
    if system:
        modelfile.append(f'SYSTEM """{system}"""')
    modelfile += [f"PARAMETER {p}" for p in param_lines]
    out: dict[str, Any] = {
        "license": "",
        "modelfile": "\n".join(modelfile) + "\n",
        "parameters": "\n".join(param_lines),
        "template": template,
        "system": system,
        "details": details(entry),
        "model_info": info,
        "capabilities": list(runtime_of(request).format(entry).capabilities),
        "modified_at": local_time(entry.modified),
    }
    for key in ("renderer", "parser"):
        if value := entry.target.config.get(key):
            out[key] = value
    if entry.config.messages:
        out["messages"] = [m.model_dump() for m in entry.config.messages]
    return json_response(out)


# -- generation -----------------------------------------------------------------------------------
def _keep_alive(value: Any) -> float | None:
    return parse_duration(value) if value is not None else None


def _format(fmt: Any) -> str | dict[str, Any] | None:
    """Ollama's `format`: absent, null or "" (none), "json", or a JSON schema object."""
    if fmt in (None, ""):
        return None
    if fmt == "json" or isinstance(fmt, dict):
        return fmt
    raw = fmt if isinstance(fmt, str) else dumps(fmt)
    raise ApiError(400, f'invalid format: "{raw}"; expected "json" or a valid JSON Schema object')


def _job(req: GenerateRequest | ChatRequest, prompt: Prompt, load_only: bool) -> Job:
    return Job(prompt, req.options, _format(req.format), _keep_alive(req.keep_alive), load_only=load_only,
               truncate=req.truncate is not False, shift=req.shift is not False,
               logprobs=req.top_logprobs if req.logprobs else None)


async def generate(request: web.Request) -> web.StreamResponse:
    t_start = time.perf_counter()
    req = GenerateRequest.read(await read_body(request))
    entry = find_pair(request, req.model)
    if req.raw and (req.template or req.system or req.context):
        raise ApiError(400, "raw mode does not support template, system, or context")
    if req.images:
        return await _images(request, entry)
    prompt = Prompt.of_completion(req.prompt, raw=req.raw, system=req.system, template=req.template,
                                  context=req.context, suffix=req.suffix, think=req.think)
    job = _job(req, prompt, load_only=not req.prompt and not req.context)
    framing = OllamaFraming(entry, chat=False, t_start=t_start, with_context=not req.raw)
    return await _run(request, entry, job, framing, req.stream, req.debug_render_only)


async def chat(request: web.Request) -> web.StreamResponse:
    t_start = time.perf_counter()
    req = ChatRequest.read(await read_body(request))
    if not req.model:
        raise ApiError(400, "model is required")
    entry = find_pair(request, req.model)
    if any(m.images for m in req.messages):
        return await _images(request, entry)
    prompt = Prompt.of_chat([m.as_dict() for m in req.messages], req.tools or None, think=req.think)
    job = _job(req, prompt, load_only=not req.messages)
    framing = OllamaFraming(entry, chat=True, t_start=t_start)
    return await _run(request, entry, job, framing, req.stream, req.debug_render_only)


async def _images(request: web.Request, entry: PairEntry) -> web.StreamResponse:
    """Images: the upstream Ollama runs them where it has the pair's target, else Ollama's refusal
    (scheduleRunner: `<full name> does not support vision`)."""
    forwarded = await proxy.images_upstream(request, entry)
    if forwarded is None:
        raise ApiError(400, f"{full_name(entry)} does not support vision")
    return forwarded


async def _run(request: web.Request, entry: PairEntry, job: Job, framing: OllamaFraming, stream: bool,
               debug_render_only: bool) -> web.StreamResponse:
    if debug_render_only and not job.load_only:
        text = await runtime_of(request).render_only(entry, job)
        return json_response({"model": entry.name, "created_at": now_utc(),
                              "_debug_info": {"rendered_template": text}})
    return await respond(request, entry, job, framing, stream)


class OllamaFraming:
    """Ollama's chunks: `response` (generate) or `message` (chat), with `thinking` beside the text,
    `logprobs` at the top level, and the metrics on the final one (api/types.go)."""

    content_type = NDJSON

    def __init__(self, entry: PairEntry, *, chat: bool, t_start: float, with_context: bool = False) -> None:
        self.model = entry.name
        self.chat = chat
        self.t_start = t_start  # the request's arrival: total_duration counts from it
        self.with_context = with_context

    def chunk(self, d: Delta, done: bool) -> dict[str, Any]:
        c: dict[str, Any] = {"model": self.model, "created_at": now_utc()}
        if self.chat:
            c["message"] = {"role": "assistant", "content": d.content}
            if d.thinking:
                c["message"]["thinking"] = d.thinking
            if d.tool_calls:
                c["message"]["tool_calls"] = list(d.tool_calls)
        else:
            c["response"] = d.content
            if d.thinking:
                c["thinking"] = d.thinking
        c["done"] = done
        if d.logprobs:
            c["logprobs"] = logprobs_json(d.logprobs)
        return c

    def encode(self, chunk: dict[str, Any]) -> bytes:
        return line(chunk)

    def delta(self, d: Delta) -> list[dict[str, Any]]:
        """Text, thinking and logprobs in one chunk, then any tool calls in a chunk of their own
        (empty content), as Ollama streams them."""
        out = []
        if d.content or d.thinking or d.logprobs:
            out.append(self.chunk(Delta(d.content, (), d.thinking, d.logprobs), False))
        if d.tool_calls:
            out.append(self.chunk(Delta(tool_calls=d.tool_calls), False))
        return out

    def final(self, o: Outcome) -> list[dict[str, Any]]:
        return [{**self.chunk(Delta(), True), **self._final_fields(o)}]

    def end(self) -> bytes:
        return b""

    def error(self, message: str) -> dict[str, Any]:
        return {"error": message}

    def whole(self, parts: list[Delta], o: Outcome) -> web.Response:
        c = self.chunk(joined(parts), True)
        c.update({"done_reason": o.done_reason} if o.load_only else self._final_fields(o))
        return web.Response(text=line(c).decode(), content_type="application/json")

    def _final_fields(self, o: Outcome) -> dict[str, Any]:
        out: dict[str, Any] = {"done_reason": "" if o.done_reason == "cancel" else o.done_reason}
        if self.with_context:
            out["context"] = o.context
        out.update({
            "total_duration": ns(time.perf_counter() - self.t_start),
            "load_duration": ns(o.load_seconds),
            "prompt_eval_count": o.prompt_tokens,
            "prompt_eval_duration": ns(o.prompt_seconds),
            "eval_count": o.eval_count,
            "eval_duration": ns(o.eval_seconds),
            "draft_tokens": o.draft_tokens,
            "draft_accepted_tokens": o.draft_accepted_tokens,
            "draft_rounds": o.draft_rounds,
            "draft_sources": {name: {"drafted": d, "accepted": a} for name, (d, a) in o.drafts_by_source.items()},
            "fallback": o.fallback,
        })
        return out
