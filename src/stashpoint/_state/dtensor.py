"""DTensor (and FSDP2) support: a tensor's local bytes and their place in the global tensor."""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from stashpoint import _runtime
from stashpoint._core.described import KeyDesc, Spread, spread_grid
from stashpoint._core.reshard import Box


def is_dtensor(t: object) -> bool:
    # No DTensor exists before its module is imported, so a program that never imported it
    # does not pay for importing it here (0.7 s, most of a first save's or load's imports).
    mod: Any = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None)
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The bytes of ``t`` this rank holds, as a plain tensor that does not require grad (no
    copy): a DTensor's local shard, cut to ``shape`` when given (FSDP2 pads its shards); any
    other tensor itself."""
    local: torch.Tensor = t
    if is_dtensor(t):
        inner = getattr(t, "_local_tensor", None)  # to_local() without its autograd wrapper (same storage)
        local = inner if isinstance(inner, torch.Tensor) else t.to_local()  # type: ignore[attr-defined]
    if local.requires_grad:
        local = local.detach()
    if shape is not None and local.shape != shape:
        if local.numel() == 0 and math.prod(shape) == 0:  # FSDP2 holds a (2, 0) box's empty shard as (0, 0)
            return local.new_empty(shape)
        local = local[tuple(slice(0, n) for n in shape)]  # e.g. FSDP2 padding: keep the unpadded part
    return local


def local_part(t: torch.Tensor) -> tuple[torch.Tensor, Box, tuple[int, ...]]:
    """``(local tensor, its box in the global tensor, global shape)``; the local tensor does not
    require grad.

    A plain tensor is its own whole box. A DTensor's local shard is placed by its device mesh and
    placements (``Shard(dim)``, uneven shards included, and ``Replicate``).
    """
    if not is_dtensor(t):
        return local_tensor(t), Box.whole(tuple(t.shape)), tuple(t.shape)
    global_shape = tuple(t.shape)
    shape, offsets = _placed(global_shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    return local_tensor(t, shape), Box(tuple(offsets), tuple(shape)), global_shape


def _placements() -> dict[tuple[object, ...], tuple[tuple[int, ...], tuple[int, ...]]]:
    return _runtime.slot("state.placements", dict)


def _placed(global_shape: tuple[int, ...], mesh: object, placements: tuple[object, ...]) -> tuple[
    tuple[int, ...], tuple[int, ...]
]:
    """``compute_local_shape_and_global_offset``, remembered: a model's DTensors repeat a few
    (shape, mesh, placements) combinations, and each computation costs tens of microseconds per
    tensor on every save."""
    key = (global_shape, id(mesh), mesh, tuple(placements))
    cache = _placements()
    hit = cache.get(key)
    if hit is None:
        if any(is_strided(p) for p in placements):
            hit = _strided_box(global_shape, mesh, placements)
        else:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)  # type: ignore[arg-type]
            hit = (tuple(shape), tuple(offsets))
        if len(cache) > 4096:
            cache.clear()
        cache[key] = hit
    return hit


def is_strided(placement: object) -> bool:
    """True for ``_StridedShard``: what FSDP2 puts on its mesh dim when tensor parallelism already
    shards the same tensor dim (2-D FSDP2 + TP)."""
    return type(placement).__name__ == "_StridedShard"


def _strided_box(
    global_shape: tuple[int, ...], mesh: object, placements: tuple[object, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The local shape and offset of a DTensor with ``_StridedShard`` placements.

    torch works out, per tensor dim, the global indices this rank holds; a shard is saved as one
    box, so each dim's indices must be one contiguous run (true for FSDP2 over tensor parallelism,
    where each rank holds a contiguous block of its TP shard). Anything else is refused.
    """
    from stashpoint.errors import UnsupportedStateError

    try:
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets as shard_of
    except ImportError:  # pragma: no cover - a torch before the helper
        return _public_box(global_shape, mesh, placements)
    shape = list(global_shape)
    indices: dict[int, torch.Tensor] = {}
    coords = mesh.get_coordinate()  # type: ignore[attr-defined]
    for mesh_dim, p in enumerate(placements):
        dim = getattr(p, "dim", None)
        if dim is None:  # Replicate
            continue
        if coords is None:
            raise UnsupportedStateError(f"DTensor placements {list(placements)} cannot be placed with this torch")
        size, index = shard_of(
            shape[dim], mesh.size(mesh_dim), coords[mesh_dim], p, indices.get(dim), global_shape[dim], False  # type: ignore[attr-defined,arg-type]
        )
        shape[dim] = int(size)
        assert index is not None
        indices[dim] = index
    offsets = [0] * len(global_shape)
    for dim, index in indices.items():
        ids = [int(i) for i in index.tolist()] if shape[dim] else []
        if ids and ids != list(range(ids[0], ids[0] + len(ids))):
            raise UnsupportedStateError(
                f"a DTensor of shape {list(global_shape)} with placements {list(placements)} holds rows "
                f"{ids[:4]}... of dim {dim} on this rank: not one contiguous block, which stashpoint cannot save "
                "as a shard. Redistribute it (t.redistribute(placements=...)) to Shard/Replicate placements."
            )
        offsets[dim] = ids[0] if ids else global_shape[dim]  # an empty shard: where torch puts it
    return tuple(shape), tuple(offsets)


def _public_box(
    global_shape: tuple[int, ...], mesh: object, placements: tuple[object, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box torch's public placement gives a ``_StridedShard`` DTensor, where a torch lacks
    the helper :func:`_strided_box` asks: the box its own DCP saves. Taken only for FSDP2 over
    tensor parallelism, where each rank's rows are one block: each strided dim split by exactly
    the plain shards of that dim on later mesh dims, and evenly. Other layouts are refused."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from stashpoint.errors import UnsupportedStateError

    sizes = [mesh.size(i) for i in range(len(placements))]  # type: ignore[attr-defined]
    for i, p in enumerate(placements):
        if not is_strided(p):
            continue
        dim = getattr(p, "dim", None)
        later = math.prod(
            sizes[j]
            for j in range(i + 1, len(placements))
            if getattr(placements[j], "dim", None) == dim and not is_strided(placements[j])
        )
        # torch's public placement of an uneven split is wrong before the helper: even splits only
        even = global_shape[dim] % (sizes[i] * later) == 0 if isinstance(dim, int) else False
        if mesh.get_coordinate() is None or getattr(p, "split_factor", None) != later or not even:  # type: ignore[attr-defined]
            raise UnsupportedStateError(
                f"DTensor placements {list(placements)} cannot be placed with torch {torch.__version__}: only "
                "FSDP2 over tensor parallelism can; upgrade torch or redistribute to Shard/Replicate placements"
            )
    shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)  # type: ignore[arg-type]
    return tuple(shape), tuple(offsets)


def _affine_meshes() -> dict[int, tuple[object, tuple[int, tuple[int, ...]] | None]]:
    return _runtime.slot("state.affine_meshes", dict)


def _affine(mesh: object) -> tuple[int, tuple[int, ...]] | None:
    """``(base, strides)`` when the mesh's rank at every coordinate is ``base + sum(strides *
    coordinate)`` (meshes made by ``init_device_mesh``), else None; remembered per mesh."""
    cache = _affine_meshes()
    hit = cache.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        return hit[1]
    ranks = mesh.mesh  # type: ignore[attr-defined]
    base = int(ranks.flatten()[0])
    strides = []
    for k, n in enumerate(ranks.shape):
        unit = tuple(int(j == k) for j in range(ranks.ndim))
        strides.append(int(ranks[unit]) - base if n > 1 else 0)
    expect = torch.full(tuple(ranks.shape), base, dtype=torch.int64)
    for k, (n, s) in enumerate(zip(ranks.shape, strides)):
        expect += (torch.arange(n, dtype=torch.int64) * s).view([n if j == k else 1 for j in range(ranks.ndim)])
    result = (base, tuple(strides)) if torch.equal(expect, ranks.to(torch.int64)) else None
    if len(cache) > 64:
        cache.clear()
    cache[id(mesh)] = (mesh, result)
    return result


def describe(key: str, t: torch.Tensor, box: Box, dtype: str, lowest: bool) -> KeyDesc | None:
    """``t``'s entry in this rank's description (see ``_core.described``): a plain tensor as
    itself; a DTensor by its mesh and placements, when those are ``Shard``/``Replicate`` on an
    affine mesh and this rank's shard is exactly the chunk the grid gives its coordinate (else
    None: the general plan)."""
    shape, itemsize = tuple(t.shape), t.element_size()
    if not is_dtensor(t):
        return KeyDesc(key, dtype, shape, itemsize, None, lowest)
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
    affine = _affine(mesh)
    coords = mesh.get_coordinate()
    dims: list[int | None] = []
    for p in placements:
        if type(p) is Shard:
            dims.append(p.dim % max(1, len(shape)))
        elif type(p) is Replicate:
            dims.append(None)
        else:  # _StridedShard, Partial
            return None
    if affine is None or coords is None:
        return None
    kd = KeyDesc(key, dtype, shape, itemsize, Spread(tuple(mesh.mesh.shape), affine[0], affine[1], tuple(dims)), lowest)
    if math.prod(shape) == 0:
        return kd
    grid = spread_grid(kd)
    if grid is None:
        return None
    off, shp = [0] * len(shape), list(shape)
    for k, dim in enumerate(dims):
        if dim is not None:
            off[dim] = min(coords[k] * grid.block[dim], shape[dim])
            shp[dim] = max(0, min(grid.block[dim], shape[dim] - coords[k] * grid.block[dim]))
    if math.prod(shp) == 0:
        return kd if box.numel == 0 else None
    return kd if (box.offsets, box.shape) == (tuple(off), tuple(shp)) else None
