"""The vLLM engine behind the runtime's `Engine` seam (runtime.contract), for `engine: vllm` pairs.

The runtime renders the pair's template and counts the window exactly as for a llama.cpp pair;
this engine tokenizes with the server's own tokenizer (/tokenize), sends the prompt as token ids
to /v1/completions, and streams the text back. So a prompt reaches vLLM byte for byte as the
llama.cpp engine would feed it, and the output runs through the same parsers.

What vLLM decides itself: the batch (continuous batching over every request on the server) and
the speculation (`speculative_config`, fixed when the server starts: runtime.vllm.command). The
draft counters come from the server's Prometheus counters, read around each request; when
requests overlap on one server, each gets the counters' change over its lifetime times its share
of the tokens generated meanwhile, so the totals add up, but one request's split is an estimate.
Not here: context shift (a full window ends the answer with `length`), a request's own num_ctx
(the server's max_model_len is fixed when it starts), and `repeat_last_n` (vLLM's
repetition_penalty covers the whole prompt and output).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.config.entries import PairEntry
from sidecar.engine.sequence import PromptTooLong
from sidecar.engine.window import truncate_prompt
from sidecar.errors import Unavailable
from sidecar.runtime.contract import Generation, Logprob, Model, ModelStatus, Outcome, Piece, TokenLogprob, Vocabulary
from sidecar.runtime.vllm import command
from sidecar.runtime.vllm.client import SpecCounters, VllmClient
from sidecar.runtime.vllm.server import ManagedServer, free_port

STOP_TIMEOUT = 30.0  # seconds a managed server may take to drain on unload


class Restarting(Unavailable):
    """The pair's managed server crashed and is coming back."""


@dataclass(eq=False)
class VllmModel:
    """A target served by one vLLM server, and the pairs riding on it."""

    client: VllmClient
    target: str  # the folder it was started on, or the remote server's URL
    max_model_len: int
    parallel: int
    vocab: Vocabulary
    add_bos: bool
    speculative: dict[str, Any] | None  # what the managed server was started with; None: none or unknown
    server: ManagedServer | None = None  # None: a remote server
    by_priority: bool = False  # it was started to take waiting requests by priority (command.by_priority)
    entries: dict[str, PairEntry] = field(default_factory=dict)
    busy: int = 0
    generated: int = 0  # tokens streamed by every request so far (shares the draft counters out)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    stopped: asyncio.Task[None] | None = None

    @property
    def n_ctx(self) -> int:
        return self.max_model_len

    def fits(self, n_ctx: int, num_gpu: int = -1) -> bool:
        return True  # vLLM's window is set when the server starts; a request's num_ctx cannot restart it

    def vocabulary(self) -> Vocabulary:
        return self.vocab

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return self.client.tokenize(text, add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.client.detokenize(list(tokens))

    def pair(self, name: str) -> PairEntry | None:
        return self.entries.get(name)

    def status(self) -> ModelStatus:
        return ModelStatus(self.target, self.max_model_len, self.parallel, tuple(sorted(self.entries)), 0,
                           None, busy=self.busy)


def _vocabulary(entry: PairEntry) -> tuple[Vocabulary, bool]:
    m = entry.metadata
    return (Vocabulary(str(m.get("tokenizer.bos_token", "")), str(m.get("tokenizer.eos_token", ""))),
            bool(m.get("tokenizer.ggml.add_bos_token", False)))


def _drafter_label(spec: dict[str, Any] | None) -> str:
    """What drafted, as the request's log line and draft_sources name it (a remote server's is its own)."""
    if spec is None:
        return "vllm"
    return f"vllm:{spec.get('method') or 'draft_model'}"


class VllmEngine:
    """The daemon's vLLM engine: the servers it manages and the remote ones it talks to."""

    def __init__(self) -> None:
        self.models: list[VllmModel] = []

    def load_key(self, entry: PairEntry, parallel: int) -> str:
        s = command.settings(entry)
        if s.url is not None:
            return f"remote|{s.url}|{s.model}"
        # Everything the server is started with, but the port (picked at start when not set); whether
        # arctic-inference is installed is the same for every pair on one interpreter.
        args = command.serve_args(entry, entry.num_ctx(None), s.port or 0, False)
        return f"managed|{command.python(entry)}|{json.dumps(args)}|{json.dumps(s.env, sort_keys=True)}"

    async def load(self, entry: PairEntry, n_ctx: int, parallel: int, num_gpu: int = -1) -> VllmModel:
        # num_gpu is llama.cpp's: vLLM holds the whole model on its GPUs (config.schema refuses it there).
        s = command.settings(entry)
        vocab, add_bos = _vocabulary(entry)
        if s.url is not None:
            client = VllmClient(s.url, s.model or "")
            cards = await client.models()
            card = next((c for c in cards if s.model in (None, c.get("id"))), None)
            if card is None:
                raise RuntimeError(f"{entry.name}: the vLLM server at {s.url} does not serve "
                                   f"{s.model!r} (it serves {[c.get('id') for c in cards]})")
            client.model = str(card["id"])
            model = VllmModel(client, s.url, int(card.get("max_model_len") or n_ctx), parallel, vocab, add_bos, None)
        else:
            model = await self._start(entry, parallel, vocab, add_bos)
        model.idle.set()
        self.models.append(model)
        return model

    async def _start(self, entry: PairEntry, parallel: int, vocab: Vocabulary, add_bos: bool) -> VllmModel:
        s = command.settings(entry)
        python = command.python(entry)
        version = await asyncio.to_thread(command.installed, python)
        if version is None:
            raise RuntimeError(f"{entry.name}: vLLM is not installed for {python} (pip install vllm, or set "
                               "vllm.python to an interpreter that has it)")
        suffix = await asyncio.to_thread(command.has_suffix, python)
        n_ctx = entry.num_ctx(None)  # the pair's window; a request's num_ctx never restarts the server
        port = s.port or free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [python, "-m", command.MODULE, *command.serve_args(entry, n_ctx, port, suffix)]
        server = ManagedServer(entry.name, argv, {"VLLM_HOST_IP": "127.0.0.1", **s.env}, url, s.start_timeout)
        await server.start()
        return VllmModel(VllmClient(url, command.served_name(entry)), str(entry.target.path), n_ctx, parallel,
                         vocab, add_bos, command.speculative_config(entry, suffix), server,
                         by_priority=command.by_priority(entry))

    async def add_pair(self, model: Model, entry: PairEntry) -> None:
        _own(model).entries[entry.name] = entry

    def rebind_pair(self, model: Model, entry: PairEntry) -> None:
        _own(model).entries[entry.name] = entry

    def drop_pair(self, model: Model, name: str) -> None:
        _own(model).entries.pop(name, None)

    def unload(self, model: Model) -> None:
        vm = _own(model)
        if vm.stopped is None:
            vm.stopped = asyncio.get_running_loop().create_task(self._stop(vm))

    async def _stop(self, vm: VllmModel) -> None:
        """After the requests already running on it: stop a managed server, close the connections."""
        await vm.idle.wait()
        if vm.server is not None:
            await vm.server.stop(STOP_TIMEOUT)
        await vm.client.close()
        if vm in self.models:
            self.models.remove(vm)

    async def join(self, model: Model, timeout: float) -> None:
        vm = _own(model)
        if vm.stopped is not None:
            await asyncio.wait({vm.stopped}, timeout=timeout)

    async def close(self) -> None:
        for vm in list(self.models):
            self.unload(vm)
            await self.join(vm, STOP_TIMEOUT + 5)

    def status(self) -> dict[str, Any]:
        return {"servers": [{
            "target": vm.target, "url": vm.client.url, "model": vm.client.model,
            "managed": vm.server is not None, "up": vm.server.ready.is_set() if vm.server else None,
            "restarts": vm.server.restarts if vm.server else None,
            "pid": vm.server.proc.pid if vm.server and vm.server.proc else None, "speculative_config": vm.speculative,
            "pairs": sorted(vm.entries), "busy": vm.busy} for vm in self.models]}

    async def generate(self, model: Model, pair: str, gen: Generation, stop: Callable[[], bool]
                       ) -> AsyncIterator[Piece]:
        vm = _own(model)
        if vm.server is not None and not vm.server.ready.is_set():
            raise Restarting(f"the vLLM server for {pair} is restarting, please try again")
        prompt, truncated = _fit(vm, gen)
        room = vm.n_ctx - len(prompt)
        max_tokens = room if gen.num_predict < 0 else min(gen.num_predict, room)
        vm.busy += 1
        vm.idle.clear()
        try:
            async for piece in self._run(vm, gen, prompt, truncated, max_tokens, stop):
                yield piece
        finally:
            vm.busy -= 1
            if vm.busy == 0:
                vm.idle.set()

    async def _run(self, vm: VllmModel, gen: Generation, prompt: list[int], truncated: int, max_tokens: int,
                   stop: Callable[[], bool]) -> AsyncIterator[Piece]:
        speculating = vm.speculative is not None or vm.server is None
        before = await vm.client.spec_counters() if speculating else SpecCounters()
        generated_before = vm.generated
        t0 = time.perf_counter()
        t_first: float | None = None
        tokens: list[int] = []
        usage: dict[str, Any] = {}
        done_reason = "cancel"
        chunks = vm.client.complete(request_body(vm.client.model, gen, prompt, max_tokens, vm.by_priority))
        try:
            async for chunk in chunks:
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    if t_first is None:
                        t_first = time.perf_counter()
                    ids = [int(t) for t in choice.get("token_ids") or ()]
                    tokens += ids
                    vm.generated += len(ids)
                    if choice.get("logprobs"):
                        yield _logprobs(choice["logprobs"], gen.logprobs or 0)
                    if choice.get("text"):
                        yield choice["text"]
                    if choice.get("finish_reason"):
                        done_reason = "length" if choice["finish_reason"] == "length" else "stop"
                        if done_reason == "stop" and not isinstance(choice.get("stop_reason"), str) and ids:
                            tokens.pop()  # the end-of-generation (or stop) token, which Ollama does not count
                if stop():
                    done_reason = "cancel"
                    break
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        t_end = time.perf_counter()
        spec = await _share(vm, before, len(tokens), vm.generated - generated_before) if speculating else None
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        n_prompt = int(usage.get("prompt_tokens") or len(prompt))
        t_first = t_first or t_end
        label = _drafter_label(vm.speculative) if spec and spec.draft_tokens else None
        yield Outcome(
            done_reason=done_reason, tokens=tokens, prompt_tokens=n_prompt - cached, prompt_cached=cached,
            prompt_seconds=t_first - t0, eval_seconds=max(t_end - t_first, 1e-9),
            draft_tokens=round(spec.draft_tokens) if spec else 0,
            draft_accepted_tokens=round(spec.accepted_tokens) if spec else 0,
            draft_rounds=round(spec.drafts) if spec else 0,
            accepted_per_pos=[round(spec.per_pos[p]) for p in sorted(spec.per_pos)] if spec else [],
            drafts_by_source={label: (round(spec.draft_tokens), round(spec.accepted_tokens))}
            if spec and label else {},
            drafter=label,
            prompt_truncated=truncated, context=prompt + tokens,
        )


def _own(model: Model) -> VllmModel:
    if not isinstance(model, VllmModel):
        raise TypeError(f"not a vLLM model: {model!r}")
    return model


def _fit(vm: VllmModel, gen: Generation) -> tuple[list[int], int]:
    """The prompt cut as the llama.cpp engine cuts it (engine.window), or refused without `truncate`."""
    prompt = list(gen.tokens)
    if len(prompt) < vm.n_ctx:
        return prompt, 0
    if not gen.truncate:
        raise PromptTooLong(f"the prompt ({len(prompt)} tokens) does not fit the context window ({vm.n_ctx})")
    cut = truncate_prompt(prompt, vm.n_ctx, gen.options.num_keep, vm.add_bos)
    return cut, len(prompt) - len(cut)


async def _share(vm: VllmModel, before: SpecCounters, own: int, everyone: int) -> SpecCounters:
    """This request's part of the server's counter change since it began (exact when it ran alone)."""
    delta = await vm.client.spec_counters() - before
    share = own / everyone if everyone > own else 1.0
    return SpecCounters(delta.drafts * share, delta.draft_tokens * share, delta.accepted_tokens * share,
                        {p: v * share for p, v in delta.per_pos.items()})


def request_body(model: str, gen: Generation, prompt: list[int], max_tokens: int, by_priority: bool = False
                 ) -> dict[str, Any]:
    """Ollama's options as vLLM's sampling parameters (the table in the README); on a server that
    schedules by priority, a request nobody watches (not streamed) waits behind streamed ones."""
    s = gen.options.sampling
    penalised = s.repeat_last_n != 0
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True,
        "temperature": max(s.temperature, 0.0), "top_p": s.top_p if 0.0 < s.top_p <= 1.0 else 1.0,
        "top_k": s.top_k if s.top_k > 0 else -1, "min_p": s.min_p,
        "repetition_penalty": s.repeat_penalty if penalised and s.repeat_penalty > 0 else 1.0,
        "presence_penalty": s.presence_penalty if penalised else 0.0,
        "frequency_penalty": s.frequency_penalty if penalised else 0.0,
        "skip_special_tokens": not gen.preserve,  # the output parser reads control tokens it asked for
    }
    if by_priority and not gen.interactive:
        body["priority"] = 1  # lower is earlier; a remote server may not run the priority policy
    if s.seed >= 0:
        body["seed"] = s.seed
    if gen.options.stop:
        body["stop"] = list(gen.options.stop)
    if gen.logprobs is not None:
        body["logprobs"] = gen.logprobs
    if gen.format == "json":
        body["structured_outputs"] = {"json_object": True}
    elif isinstance(gen.format, dict):
        body["structured_outputs"] = {"json": gen.format}
    return body


def _logprobs(lp: dict[str, Any], top: int) -> tuple[Logprob, ...]:
    """vLLM's completions logprobs (tokens, token_logprobs, top_logprobs) as Ollama's."""
    out = []
    tops = lp.get("top_logprobs") or []
    for i, (token, logprob) in enumerate(zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], strict=False)):
        alts = sorted((tops[i] or {}).items(), key=lambda kv: -kv[1])[:top] if i < len(tops) and top else []
        out.append(Logprob(TokenLogprob(token, float(logprob), token.encode()),
                           tuple(TokenLogprob(t, float(v), t.encode()) for t, v in alts)))
    return tuple(out)
