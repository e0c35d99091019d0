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
    assert compute_local_shape_and_global_offset is not None
    global_shape = tuple(t.shape)
    shape, offsets = compute_local_shape_and_global_offset(global_shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    local = t.to_local()  # type: ignore[attr-defined]
    if tuple(local.shape) != tuple(shape):  # e.g. FSDP2 padding: keep the unpadded part
        local = local[tuple(slice(0, n) for n in shape)]
    return local, Box(tuple(offsets), tuple(shape)), global_shape
