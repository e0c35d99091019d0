"""DTensor (and FSDP2) support: a tensor's local bytes and their place in the global tensor."""

from __future__ import annotations

import torch

from ._reshard import Box

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]
    compute_local_shape_and_global_offset = None  # type: ignore[assignment]


def is_dtensor(t: object) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local_part(t: torch.Tensor) -> tuple[torch.Tensor, Box, tuple[int, ...]]:
    """``(local tensor, its box in the global tensor, global shape)``.

    A plain tensor is its own whole box. A DTensor's local shard is placed by its device mesh and
    placements (``Shard(dim)``, uneven shards included, and ``Replicate``).
    """
    if not is_dtensor(t):
        return t, Box.whole(tuple(t.shape)), tuple(t.shape)
    global_shape = tuple(t.shape)
    shape, offsets = _placed(global_shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    local = getattr(t, "_local_tensor", None)  # to_local() without its autograd wrapper (same storage)
    if local is None:
        local = t.to_local()  # type: ignore[attr-defined]
    if local.requires_grad:
        local = local.detach()
    if tuple(local.shape) != tuple(shape):  # e.g. FSDP2 padding: keep the unpadded part
        local = local[tuple(slice(0, n) for n in shape)]
    return local, Box(tuple(offsets), tuple(shape)), global_shape


_placements: dict[tuple[object, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}


def _placed(global_shape: tuple[int, ...], mesh: object, placements: tuple[object, ...]) -> tuple[
    tuple[int, ...], tuple[int, ...]
]:
    """``compute_local_shape_and_global_offset``, remembered: a model's DTensors repeat a few
    (shape, mesh, placements) combinations, and each computation costs tens of microseconds per
    tensor on every save."""
    key = (global_shape, id(mesh), mesh, tuple(placements))
    hit = _placements.get(key)
    if hit is None:
        assert compute_local_shape_and_global_offset is not None
        shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)  # type: ignore[arg-type]
        hit = (tuple(shape), tuple(offsets))
        if len(_placements) > 4096:
            _placements.clear()
        _placements[key] = hit
    return hit
