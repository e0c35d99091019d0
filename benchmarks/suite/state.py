"""The training state every method saves: a GPT-style model's fp32 weights + AdamW after one step.

Seeded and deterministic, so every method's process builds the same bytes. Three layouts:

* ``single``: one process holds the whole state;
* ``ddp``: every rank holds the whole state (replicated, same seed);
* ``fsdp``: the model sharded with FSDP2 ``fully_shard`` on a CPU mesh, AdamW re-made and
  stepped once (parameters and moments are DTensors); each rank holds about 1/world of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .common import GB

LAYOUTS = ("single", "ddp", "fsdp")


@dataclass(frozen=True)
class Shape:
    """A GPT-2-style decoder: untied embeddings and head, 12 parameter tensors per block."""

    layers: int
    width: int
    vocab: int
    context: int

    @property
    def num_params(self) -> int:
        d = self.width
        return self.layers * (12 * d * d + 13 * d) + (2 * self.vocab + self.context + 2) * d

    @property
    def num_param_tensors(self) -> int:
        return 12 * self.layers + 5

    @property
    def state_bytes(self) -> int:
        # fp32 weights + exp_avg + exp_avg_sq, plus AdamW's scalar fp32 `step` per parameter.
        return 12 * self.num_params + 4 * self.num_param_tensors


def choose_shape(size_gb: float) -> Shape:
    """Layers and width (a multiple of 64) whose weights + AdamW state come closest to ``size_gb``.

    Among shapes within 3% of the target, the one with width/layers closest to 48 (GPT-like
    proportions) wins.
    """
    target = size_gb * GB
    vocab = int(min(50304, max(4096, round(32000 * math.sqrt(size_gb / 2.5) / 64) * 64)))
    context = 2048 if size_gb >= 1 else 1024
    best: tuple[tuple[bool, float], Shape] | None = None
    for layers in range(2, 97):
        a = 12 * 12 * layers
        b = 12 * (13 * layers + 2 * vocab + context + 2)
        d = (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
        for width in {max(64, math.floor(d / 64) * 64), max(64, math.ceil(d / 64) * 64)}:
            shape = Shape(layers, width, vocab, context)
            err = abs(shape.state_bytes - target) / target
            close = err <= 0.03
            key = (not close, abs(math.log(width / layers / 48)) if close else err)
            if best is None or key < best[0]:
                best = (key, shape)
    assert best is not None
    return best[1]


def _gpt(shape: Shape) -> Any:
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.c_attn = nn.Linear(d, 3 * d)
            self.c_proj = nn.Linear(d, d)

    class MLP(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.c_fc = nn.Linear(d, 4 * d)
            self.c_proj = nn.Linear(4 * d, d)

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(d)
            self.attn = Attention(d)
            self.ln_2 = nn.LayerNorm(d)
            self.mlp = MLP(d)

    class GPT(nn.Module):
        def __init__(self, s: Shape) -> None:
            super().__init__()
            self.wte = nn.Embedding(s.vocab, s.width)
            self.wpe = nn.Embedding(s.context, s.width)
            self.h = nn.ModuleList(Block(s.width) for _ in range(s.layers))
            self.ln_f = nn.LayerNorm(s.width)
            self.lm_head = nn.Linear(s.width, s.vocab, bias=False)

    return GPT(shape)


def build_state(shape: Shape, seed: int) -> dict[str, Any]:
    """{"model": GPT module, "optim": AdamW after one step, "step": int}, seeded and deterministic."""
    import torch

    with torch.device("meta"):
        model = _gpt(shape)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.empty_like(p).normal_(0.0, 1e-3, generator=g)
    optim.step()
    model.zero_grad(set_to_none=True)
    return {"model": model, "optim": optim, "step": 1000}


def build(layout: str, shape: Shape, seed: int, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """The state of this rank for ``layout`` (``single``, ``ddp`` or ``fsdp``; see the module doc)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    state = build_state(shape, seed)
    if layout != "fsdp":
        return state
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = state["model"]
    del state["optim"]  # frees the unsharded moments
    mesh = init_device_mesh("cpu", (world,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(seed + 1 + rank)
    for p in model.parameters():
        grad = torch.empty(local(p).shape).normal_(0.0, 1e-3, generator=g)
        p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    optim.step()
    model.zero_grad(set_to_none=True)
    return {"model": model, "optim": optim, "step": 1000}


def local(t: Any) -> Any:
    """A DTensor's local part; any other tensor as is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def live_tensors(state: dict[str, Any]) -> list[Any]:
    """Every tensor of the model and its optimizer, in a fixed order (re-read each time: loads may
    replace them)."""
    model, optim = state["model"], state["optim"]
    out = list(model.parameters())
    for group in optim.param_groups:
        for p in group["params"]:
            st = optim.state[p]
            out.extend(st[k] for k in sorted(st))
    return out


def local_bytes(state: dict[str, Any]) -> tuple[int, int]:
    """(bytes, number of tensors) this rank holds of the model and its optimizer."""
    ts = [local(t) for t in live_tensors(state)]
    return sum(t.numel() * t.element_size() for t in ts), len(ts)


def fingerprint(state: dict[str, Any]) -> list[Any]:
    """Per local tensor ~64 strided samples and the float64 sum, then the step: to check a load."""
    fp: list[Any] = []
    for t in live_tensors(state):
        flat = local(t).detach().reshape(-1)
        fp.append((flat[:: max(1, flat.numel() // 64)].clone(), float(flat.double().sum())))
    return [*fp, state["step"]]


def same_fingerprint(a: list[Any], b: list[Any]) -> bool:
    import torch

    if len(a) != len(b) or a[-1] != b[-1]:
        return False
    return all(torch.equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(a[:-1], b[:-1], strict=True))


def scramble(state: dict[str, Any]) -> None:
    """Zero the live state, so that a load that skips anything fails the fingerprint check."""
    import torch

    with torch.no_grad():
        for t in live_tensors(state):
            local(t).zero_()
    state["step"] = -1


def data_ptrs(state: dict[str, Any]) -> list[int]:
    """Where each live tensor's bytes are: equal before and after an in-place load."""
    return [local(t).data_ptr() for t in live_tensors(state)]
