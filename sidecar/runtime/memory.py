"""A pair's memory plan from the GGUF headers, before anything is loaded, and where its layers go.

Why from the headers: a 70B target on a 24 GiB machine makes llama.cpp try to allocate a 37 GB
buffer and fail a minute later; Ollama refuses such a model at once, naming the sizes. The plan
needs only the tensor infos (models.gguf reads them from the mapped header, so a 40 GB file costs a
few pages) and a handful of hyperparameters:

- weights per repeating layer (`blk.N.*`), the output layer (`output.weight` and its norm, which
  llama.cpp offloads as layer N+1), and the rest (the token embeddings, which stay on the CPU);
- KV per token per layer: (key length + value length) x KV heads x the cache type's bytes, times
  the cells llama.cpp makes (num_ctx x num_parallel, each stream padded to 256);
- compute buffers: what llama.cpp's graph allocator reserves for one ubatch, on a GPU as Ollama's
  `fs/ggml/ggml.go` GraphSize estimates it for llama, on the CPU from the widest tensors of the
  graph (logits, attention scores, FFN activations), checked against the buffers llama.cpp
  reports for SmolLM2 and Gemma-3-270M (tests/test_memory_real.py holds it to 5%).

Placement (`place`), when `num_gpu` is not set: the draft goes wholly onto one GPU first (a draft
on the CPU beside a GPU target cannot pay), then as many target layers as fit, leaving llama.cpp's
`--fit-target` margin (1 GiB) plus OLLAMA_GPU_OVERHEAD on every GPU; several GPUs take layers in
proportion to their free memory (llama.cpp's tensor_split). An explicit num_gpu always wins. What is
not on a GPU must fit the free RAM (MemAvailable + SwapFree, as Ollama's discover/cpu_linux.go
reads it); otherwise the plan says so in Ollama's words (llm/server.go, v0.20.0).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.models.gguf import ArrayInfo, TensorInfo, read_header

GIB = 1 << 30
MIB = 1 << 20
FIT_MARGIN = GIB  # llama.cpp's --fit-target default: what placement leaves free on every GPU

# ggml_type -> (elements per block, bytes per block), ggml.c's type_traits.
_TYPE_SIZES = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17),
}
# The KV cache types a pair may set (config.schema Runtime.kv_cache_type): bytes per element.
KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
_LAYER = re.compile(r"^blk\.(\d+)\.")


def tensor_bytes(t: TensorInfo) -> int:
    """What the tensor's data takes, as ggml_nbytes computes it (rows of whole blocks)."""
    block, size = _TYPE_SIZES.get(t.ggml_type, (1, 4))
    if not t.shape:
        return size
    rows = t.n_elements // t.shape[0]
    return rows * (t.shape[0] // block) * size


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def human(n: int) -> str:
    """Ollama's format.HumanBytes2 (format/bytes.go): the unit its messages name sizes in."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    """"24GiB", "24 GB", "800MiB", "1.5T", a plain byte count: bytes. GB is read as GiB, as card
    makers' "24 GB" means 24 GiB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"not a size: {text!r} (try 24GiB)")
    scale = {"": 1, "k": 1 << 10, "m": MIB, "g": GIB, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


# -- what a model needs ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """The facts of one GGUF the plan needs, read from its header."""

    name: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_vocab: int
    n_ff: int
    head_kv: tuple[int, ...]  # KV heads of each layer (0: no attention there)
    key_length: int
    value_length: int
    layer_bytes: tuple[int, ...]  # weights of blk.i
    output_bytes: int  # the output layer llama.cpp offloads last (output.weight + output_norm)
    input_bytes: int  # everything else (token embeddings): stays on the CPU
    tied_output: bool  # no output.weight: the embeddings are used, and copied when it is offloaded
    n_ctx_train: int = 0

    @classmethod
    def from_gguf(cls, path: str | Path) -> Shape:
        header = read_header(path, tensors=True)
        return cls.from_header(Path(path).name, header.metadata, header.tensors)

    @classmethod
    def from_header(cls, name: str, md: dict[str, Any], tensors: Sequence[TensorInfo]) -> Shape:
        arch = str(md.get("general.architecture", ""))

        def get(key: str, default: Any = 0) -> Any:
            return md.get(f"{arch}.{key}", default)

        n_layer = int(get("block_count"))
        n_embd = int(get("embedding_length"))
        n_head = _first(get("attention.head_count"))
        kv = get("attention.head_count_kv", n_head)
        head_kv = tuple(int(x) for x in kv) if isinstance(kv, list) else (int(kv),) * n_layer
        head = n_embd // n_head if n_head else 0
        layers = [0] * n_layer
        output = inputs = 0
        has_output = False
        for t in tensors:
            m = _LAYER.match(t.name)
            size = tensor_bytes(t)
            if m and int(m.group(1)) < n_layer:
                layers[int(m.group(1))] += size
            elif t.name.startswith("output"):
                output += size
                has_output = has_output or t.name == "output.weight"
            else:
                inputs += size
        tokens = md.get("tokenizer.ggml.tokens")
        n_vocab = tokens.length if isinstance(tokens, ArrayInfo) else len(tokens) if isinstance(tokens, list) else 0
        return cls(
            name=name, arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_vocab=int(n_vocab),
            n_ff=_first(get("feed_forward_length")), head_kv=head_kv,
            key_length=int(get("attention.key_length", head) or head),
            value_length=int(get("attention.value_length", head) or head),
            layer_bytes=tuple(layers), output_bytes=output, input_bytes=inputs, tied_output=not has_output,
            n_ctx_train=int(get("context_length", 0) or 0),
        )

    @property
    def weights(self) -> int:
        """The file's tensor data."""
        return sum(self.layer_bytes) + self.output_bytes + self.input_bytes

    def output_gpu_bytes(self) -> int:
        """What the output layer puts on a GPU: with tied embeddings llama.cpp copies the token
        embeddings there (TENSOR_DUPLICATED), beside the output norm."""
        return self.output_bytes + (self.input_bytes if self.tied_output else 0)

    def kv_cells(self, num_ctx: int, num_parallel: int) -> int:
        """The cells llama.cpp's cache gives every layer: one stream of num_ctx per sequence, each
        padded to 256 (llama_context). Sliding-window layers get as many: the daemon's contexts
        keep llama.cpp's default full-size SWA cache (`swa_full`), which a shifted or reused
        prompt needs."""
        return _pad(num_ctx, 256) * num_parallel

    def kv_layer(self, layer: int, num_ctx: int, num_parallel: int, kv_type: str) -> int:
        per_token = (self.key_length + self.value_length) * self.head_kv[layer] * KV_BYTES[kv_type]
        return int(per_token * self.kv_cells(num_ctx, num_parallel))

    def compute(self, num_ctx: int, n_batch: int, *, gpu: bool, flash: bool, logits: bool = True) -> int:
        """The compute buffer of one ubatch of n_batch rows (llama.cpp reserves it for the widest
        graph: every row an output).

        On a GPU, Ollama's GraphSize for llama (fs/ggml/ggml.go, fullOffload), with the context of
        one stream, which is what each attends to here. On the CPU, the peak of llama.cpp's graph
        allocator, which is the larger of two phases: the logits (rows x vocab, f32, beside three
        embedding-wide rows), and one stream's attention (scores rows x cells x heads unless flash
        attention tiles them, the f32 mask rows x cells, and the FFN's activations). Checked against
        what llama.cpp reports for SmolLM2 and Gemma-3-270M (tests/test_memory_real.py: within 1%)."""
        b = min(n_batch, num_ctx)
        cells = _pad(num_ctx, 256)
        if gpu:
            return max(4 * b * (1 + 4 * self.n_embd + cells * (1 + self.n_head)),
                       4 * b * (self.n_embd + self.n_vocab))
        out = 4 * b * (self.n_vocab + 3 * self.n_embd) if logits else 0
        attention = 4 * b * cells * ((0 if flash else self.n_head) + 1) + 4 * b * (2 * self.n_ff + self.n_embd)
        return max(out, attention)


def _first(v: Any) -> int:
    """A per-layer array's largest value (Ollama's HeadCountMax), or the scalar."""
    if isinstance(v, list):
        return max((int(x) for x in v), default=0)
    return int(v or 0)


# -- where it goes -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    """A GPU's memory as ggml's device API reports it (engine.devices), or one injected for a plan."""

    name: str
    free: int
    total: int
    description: str = ""


@dataclass
class Settings:
    """How one model of a pair is loaded: its context, streams, batch, cache type and num_gpu
    (None: placed by the plan; a number: what the user asked for, which wins)."""

    num_ctx: int
    num_parallel: int = 1
    num_batch: int = 512
    kv_cache_type: str = "f16"
    flash: bool = False
    num_gpu: int | None = None


@dataclass
class Placement:
    """Where one model's memory goes: how many of its layers (the repeating ones plus the output
    layer) sit on the GPUs, and the bytes on each side."""

    name: str
    layers: int
    gpu_layers: int
    split: tuple[int, ...]  # layers on each GPU
    weights: int
    kv: int
    compute_cpu: int
    weights_gpu: int = 0
    kv_gpu: int = 0
    compute_gpu: int = 0
    note: str = ""

    @property
    def vram(self) -> int:
        return self.weights_gpu + self.kv_gpu + self.compute_gpu

    @property
    def ram(self) -> int:
        return self.weights - self.weights_gpu + self.kv - self.kv_gpu + self.compute_cpu

    @property
    def total(self) -> int:
        """Ollama's `size` in /api/ps (its memory estimate's TotalSize)."""
        return self.vram + self.ram

    def to_json(self) -> dict[str, Any]:
        return {"model": self.name, "layers": self.layers, "gpu_layers": self.gpu_layers,
                "tensor_split": list(self.split), "weights_bytes": self.weights, "kv_bytes": self.kv,
                "compute_bytes": self.compute_cpu + self.compute_gpu, "vram_bytes": self.vram,
                "ram_bytes": self.ram, "total_bytes": self.total, **({"note": self.note} if self.note else {})}


@dataclass
class PairPlan:
    target: Placement
    draft: Placement | None
    fits: bool
    reason: str  # why it does not fit ("" when it does)
    gpus: list[Device] = field(default_factory=list)
    ram_free: int = 0
    gpu_left: list[int] = field(default_factory=list)  # bytes each GPU keeps free after the pair

    @property
    def vram(self) -> int:
        return self.target.vram + (self.draft.vram if self.draft else 0)

    @property
    def ram(self) -> int:
        return self.target.ram + (self.draft.ram if self.draft else 0)

    @property
    def total(self) -> int:
        return self.vram + self.ram

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target.to_json(), "draft": self.draft.to_json() if self.draft else None,
                "fits": self.fits, **({"reason": self.reason} if self.reason else {}),
                "ram_needed_bytes": self.ram, "ram_free_bytes": self.ram_free,
                "gpus": [{"name": g.name, "free_bytes": g.free, "total_bytes": g.total, "left_bytes": left}
                         for g, left in zip(self.gpus, self.gpu_left, strict=False)]}


def gpu_overhead(env: dict[str, str] | os._Environ[str] | None = None) -> int:
    """OLLAMA_GPU_OVERHEAD: bytes to keep free on every GPU (envconfig/config.go), beyond the margin."""
    raw = (env if env is not None else os.environ).get("OLLAMA_GPU_OVERHEAD", "").strip()
    try:
        return max(0, int(raw)) if raw else 0
    except ValueError:
        return 0


def _model(shape: Shape, s: Settings, gpu_layers: int, split: Sequence[int]) -> Placement:
    """The bytes of one model with its last `gpu_layers` layers (output layer first) on GPUs."""
    kv = [shape.kv_layer(i, s.num_ctx, s.num_parallel, s.kv_cache_type) for i in range(shape.n_layer)]
    p = Placement(shape.name, shape.n_layer + 1, gpu_layers, tuple(split), shape.weights, sum(kv),
                  shape.compute(s.num_ctx, s.num_batch, gpu=False, flash=s.flash))
    if gpu_layers <= 0:
        return p
    # llama.cpp offloads the output layer with the (n_gpu_layers > n_layer) and the last layers first.
    repeating = min(gpu_layers, shape.n_layer)
    first = shape.n_layer - repeating
    p.weights_gpu = sum(shape.layer_bytes[first:]) + (shape.output_gpu_bytes() if gpu_layers > shape.n_layer else 0)
    p.kv_gpu = sum(kv[first:])
    p.compute_gpu = shape.compute(s.num_ctx, s.num_batch, gpu=True, flash=s.flash)
    if gpu_layers > shape.n_layer:
        if shape.tied_output:
            p.weights += shape.input_bytes  # the copy on the GPU comes on top of the CPU's
        # the logits are made on the GPU; with every layer there, the CPU only looks up embeddings
        p.compute_cpu = 4 * min(s.num_batch, s.num_ctx) * shape.n_embd if repeating == shape.n_layer else \
            shape.compute(s.num_ctx, s.num_batch, gpu=False, flash=s.flash, logits=False)
    return p


def _layer_cost(shape: Shape, s: Settings, i: int) -> int:
    """What layer i (n_layer: the output layer) adds on a GPU."""
    if i == shape.n_layer:
        return shape.output_gpu_bytes()
    return shape.layer_bytes[i] + shape.kv_layer(i, s.num_ctx, s.num_parallel, s.kv_cache_type)


def _fit_layers(shape: Shape, s: Settings, room: list[int]) -> tuple[int, list[int]]:
    """As many layers as the GPUs' `room` holds, the output layer and the last layers first, split
    across the GPUs in proportion to their room (tensor_split); `room` is reduced by what is used."""
    if not room or max(room) <= 0:
        return 0, [0] * len(room)
    compute = shape.compute(s.num_ctx, s.num_batch, gpu=True, flash=s.flash)
    avail = [max(0, r - compute) for r in room]  # each GPU holding layers runs the graph's part there
    order = [shape.n_layer, *range(shape.n_layer - 1, -1, -1)]
    limit = len(order) if s.num_gpu is None else min(len(order), s.num_gpu)
    total, n = sum(avail), 0
    used = 0
    for i in order[:limit]:
        cost = _layer_cost(shape, s, i)
        if s.num_gpu is None and used + cost > total:
            break
        used += cost
        n += 1
    split = _split(n, avail)
    for g, k in enumerate(split):
        if k:
            room[g] -= compute
    for g, k in enumerate(split):
        # the bytes of the layers each GPU holds come off its room
        room[g] -= used * k // max(n, 1)
    return n, split


def _split(n: int, avail: Sequence[int]) -> list[int]:
    """n layers over GPUs in proportion to their free memory (llama.cpp's tensor_split)."""
    total = sum(avail)
    if n == 0 or total <= 0:
        return [0] * len(avail)
    shares = [n * a // total for a in avail]
    rest = n - sum(shares)
    for g in sorted(range(len(avail)), key=lambda g: -avail[g])[:rest]:
        shares[g] += 1
    return shares


def place(target: Shape, t: Settings, draft: Shape | None, d: Settings | None, gpus: Sequence[Device],
          ram_free: int, *, overhead: int = 0) -> PairPlan:
    """Plan the pair: the draft wholly onto the GPU first, then as many target layers as fit, the
    rest on the CPU; `fits` when the CPU's part fits the free RAM."""
    room = [max(0, g.free - FIT_MARGIN - overhead) for g in gpus]
    note = ""
    dp: Placement | None = None
    if draft is not None and d is not None:
        want = draft.n_layer + 1
        if d.num_gpu is not None:  # the user's number wins
            k, split = _fit_layers(draft, d, room)
            dp = _model(draft, d, k, split)
        else:
            whole = _model(draft, d, want, [0] * len(gpus))
            best = max(range(len(room)), key=lambda g: room[g], default=-1)
            if best >= 0 and whole.vram <= room[best]:
                split = [0] * len(gpus)
                split[best] = want
                dp = _model(draft, d, want, split)
                room[best] -= dp.vram
            else:
                dp = _model(draft, d, 0, [0] * len(gpus))
                if gpus:
                    note = (f"the draft needs {human(whole.vram)} on one GPU and the largest has "
                            f"{human(max(room, default=0))} to spare: the target is planned alone, "
                            "the draft runs on the CPU")
                    dp.note = note
    k, split = _fit_layers(target, t, room)
    tp = _model(target, t, k, split)
    plan = PairPlan(tp, dp, True, "", list(gpus), ram_free)
    plan.gpu_left = [max(0, g.free - u) for g, u in zip(gpus, _used(plan, len(gpus)), strict=True)]
    if plan.ram > ram_free:
        # Ollama's words (llm/server.go): the CPU's part against free RAM plus free swap.
        plan.fits = False
        plan.reason = f"model requires more system memory ({human(plan.ram)}) than is available ({human(ram_free)})"
    return plan


def _used(plan: PairPlan, n: int) -> list[int]:
    """Bytes the pair puts on each GPU, spread by its layers."""
    used = [0] * n
    for p in (plan.target, plan.draft):
        if p is None or not p.gpu_layers:
            continue
        for g, k in enumerate(p.split):
            used[g] += p.vram * k // p.gpu_layers
    return used


def ram_available(meminfo: str = "/proc/meminfo") -> int:
    """Free RAM as Ollama reads it on Linux (discover/cpu_linux.go): MemAvailable plus SwapFree."""
    try:
        with open(meminfo) as f:
            fields = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except (OSError, ValueError):
        return 0
    return fields.get("MemAvailable", fields.get("MemFree", 0)) + fields.get("SwapFree", 0)
