"""Overlap mode's plan: which of a save's copies may wait for the background (the tensors only
an optimizer's ``step()`` changes) and which optimizers hold ``step()`` back until they are
done (see :mod:`.overlap`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from stashpoint._save.layout import Layout, signature
from stashpoint._state.dtensor import local_part
from stashpoint._state.stateful import find_all

Triple = tuple[str, torch.Tensor, torch.Tensor]  # (key, live source, staging view)


def hookable(optim: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The optimizer whose step hooks run at ``optim.step()``: itself, or the optimizer a wrapper
    that never ran ``Optimizer.__init__`` holds (Accelerate's ``AcceleratedOptimizer``); None
    where there is none (its tensors are then copied before the call returns)."""
    for candidate in (optim, getattr(optim, "optimizer", None)):
        if isinstance(candidate, torch.optim.Optimizer) and hasattr(candidate, "_optimizer_step_pre_hooks"):
            return candidate
    return None


def optimizers_in(state: Any) -> list[torch.optim.Optimizer]:
    """Every optimizer reachable through the containers of ``state`` (dicts, lists, tuples)."""
    return find_all(state, torch.optim.Optimizer)


def _updated_by_step(optimizers: Iterable[torch.optim.Optimizer], layout: Layout | None) -> set[Any]:
    """Signatures of the tensors only ``step()`` changes: the optimizers' parameters and state.

    Those that are tensors of the saved state (the usual case) take their signature from its
    ``layout``; any other is worked out.
    """
    tensors: list[torch.Tensor] = []
    for optim in optimizers:
        for group in optim.param_groups:
            tensors.extend(p for p in group["params"] if isinstance(p, torch.Tensor))
        for per_param in optim.state.values():
            if isinstance(per_param, Mapping):
                tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    key_of = layout.key_of if layout is not None else {}
    sigs = layout.signatures if layout is not None else {}
    out = set()
    for t in tensors:
        key = key_of.get(id(t))
        out.add(sigs[key] if key is not None and key in sigs else signature(local_part(t)[0]))
    out.discard(None)
    return out


def split(
    triples: Sequence[Triple], optimizers: Sequence[torch.optim.Optimizer], layout: Layout | None = None
) -> tuple[list[Triple], list[Triple]]:
    """``(eager, deferred)``: the copies a deferred copy would be unsafe for, and the others.

    A copy is deferred only if its source is exactly (same memory, shape, strides, dtype) a
    parameter or a state tensor of one of ``optimizers``, and lives on the CPU or a CUDA device.
    ``layout``, the layout the triples come from, saves working signatures out again.
    The tensors of an optimizer built with ``capturable=True`` are copied eagerly: its step may
    be captured in a CUDA graph, whose replay runs no hook that could hold it back.
    """
    # Which keys are deferred depends only on the tensors (one layout: the same ones, found by
    # the layout cache) and on what the optimizers hold: remembered per structure, the split of
    # a later save is one pass (working signatures out again cost a few microseconds a tensor).
    memo_key = (
        "split",
        tuple(id(o) for o in optimizers),
        tuple(capturable(o) for o in optimizers),
        tuple(len(o.state) for o in optimizers),
        tuple(id(p) for o in optimizers for g in o.param_groups for p in g["params"]),
    )

    def make() -> frozenset[str]:
        return _deferred_keys(triples, optimizers, layout)

    late = layout.remember(memo_key, make) if layout is not None else make()
    eager: list[Triple] = []
    deferred: list[Triple] = []
    for t in triples:
        (deferred if t[0] in late else eager).append(t)
    return eager, deferred


def _deferred_keys(
    triples: Sequence[Triple], optimizers: Sequence[torch.optim.Optimizer], layout: Layout | None
) -> frozenset[str]:
    captured = [o for o in optimizers if capturable(o)]
    stepped = _updated_by_step([o for o in optimizers if not capturable(o)], layout)
    if captured:
        stepped -= _updated_by_step(captured, layout)
    sigs = layout.signatures if layout is not None else {}
    late = set()
    for key, src, _ in triples:
        sig = sigs[key] if key in sigs else signature(src)
        if src.device.type in ("cpu", "cuda") and sig in stepped:
            late.add(key)
    return frozenset(late)


def capturable(optim: torch.optim.Optimizer) -> bool:
    """Whether ``optim`` was built for CUDA graph capture (``capturable=True`` in a group)."""
    return any(bool(g.get("capturable")) for g in optim.param_groups)
