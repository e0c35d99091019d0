"""What ``stashpoint diff`` does: which tensors and plain values differ between two checkpoints."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stashpoint._core.format import Manifest
from stashpoint._load.manifest import open_checkpoint
from stashpoint._tools.inspect import ABSENT, decode_value, plain_values

if TYPE_CHECKING:
    import torch


@dataclass
class DiffReport:
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    dtype: dict[str, tuple[str, str]] = field(default_factory=dict)
    shape: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    # key -> max |a - b| (nan where NaNs differ; None for dtypes without arithmetic: bytes differ)
    values: dict[str, float | None] = field(default_factory=dict)
    plain: list[tuple[str, Any, Any]] = field(default_factory=list)  # (key path, value in A, value in B)
    compared: int = 0
    by_checksum: int = 0  # of ``compared``: equal by the checksums both manifests record, not read

    @property
    def identical(self) -> bool:
        return not (self.only_a or self.only_b or self.dtype or self.shape or self.values or self.plain)


def _numeric(t: torch.Tensor) -> torch.Tensor | None:
    import torch

    try:
        return t.to(torch.complex128 if t.is_complex() else torch.float64)
    except (RuntimeError, TypeError):  # bits8, float4_e2m1fn_x2, ...: no arithmetic
        return None


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, step: int = 1 << 22) -> float | bool | None:
    """False if identical, else max |a - b| (NaN in both places counts as equal; None: no arithmetic).

    Same dtype: identical means bitwise (so -0.0 vs 0.0 differs, by 0). Another dtype: equal values.
    Computed ``step`` elements at a time, so that the float64 copies stay small."""
    import torch

    a, b = a.reshape(-1), b.reshape(-1)
    if a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
        return False
    worst = 0.0
    mixed = a.dtype != b.dtype and torch.uint64 in (a.dtype, b.dtype)
    integers = _integer(a.dtype) and _integer(b.dtype) and not mixed
    for i in range(0, a.numel(), step):
        if integers:  # float64 rounds 64-bit ints: 2**62 + 1 and 2**62 differed by 0
            worst = max(worst, _int_diff(a[i : i + step], b[i : i + step]))
            continue
        x, y = _numeric(a[i : i + step]), _numeric(b[i : i + step])
        if x is None or y is None:
            return None
        d = (x - y).abs()
        d[torch.isnan(x) & torch.isnan(y)] = 0
        worst = max(worst, float(d.max()), key=lambda v: math.inf if math.isnan(v) else v)
    return False if worst == 0 and a.dtype != b.dtype else worst  # equal values in another dtype


def _integer(dtype: torch.dtype) -> bool:
    import torch

    ints = (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64, torch.uint64)
    return dtype in ints


def _int_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| of integer tensors: exact below 2**52 (as int64, wrapping as unsigned ones'
    bytes do, exact while |a - b| < 2**63), from float64 above, where float64 is close enough."""
    import torch

    rough = (a.to(torch.float64) - b.to(torch.float64)).abs()
    exact = (a.to(torch.int64) - b.to(torch.int64)).abs().to(torch.float64)
    return float(torch.where(rough < 2.0**52, exact, rough).max()) if a.numel() else 0.0


def _same_bytes(ma: Manifest, mb: Manifest, key: str) -> bool:
    """Whether ``key`` holds the same bytes in both, by the checksums the manifests record for
    the same chunks (``verify`` checks those against the files)."""
    ea, eb = ma.resolve(key), mb.resolve(key)
    if ea.dtype != eb.dtype:
        return False

    def chunks(e: Any) -> list[tuple[Any, ...]]:
        return sorted((c.offsets, c.shape, c.checksums) for c in e.chunks if c.end > c.start)

    return chunks(ea) == chunks(eb)


def diff(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> DiffReport:
    """Tensors (keys, dtypes, shapes, values) and plain values that differ between two checkpoints."""
    (sa, ma), (sb, mb) = open_checkpoint(a), open_checkpoint(b)
    rep = DiffReport(only_a=[k for k in ma.tensors if k not in mb.tensors])
    rep.only_b = [k for k in mb.tensors if k not in ma.tensors]
    same = []
    for k, ea in ma.tensors.items():
        eb = mb.tensors.get(k)
        if eb is None:
            continue
        if ea.dtype != eb.dtype:
            rep.dtype[k] = (ea.dtype, eb.dtype)
        if ea.shape != eb.shape:
            rep.shape[k] = (list(ea.shape), list(eb.shape))
        elif _same_bytes(ma, mb, k):
            rep.compared += 1
            rep.by_checksum += 1
        else:
            same.append(k)
    if same:  # only tensors whose recorded bytes differ are read, and only then is torch imported
        from stashpoint._tools.tensors import batches, read_tensors

        for group in batches(ma, same):
            ta, tb = read_tensors(sa, ma, group), read_tensors(sb, mb, group)
            for k in group:
                d = max_abs_diff(ta[k], tb[k])
                if d is not False:
                    rep.values[k] = d
            rep.compared += len(group)
    seen = set()
    for r in range(max(ma.world_size, mb.world_size)):
        ta_, tb_ = ma.tree_for(r), mb.tree_for(r)
        if (id(ta_), id(tb_)) in seen:
            continue
        seen.add((id(ta_), id(tb_)))
        va, vb = plain_values(ta_, typed=True), plain_values(tb_, typed=True)
        label = f"[rank {r}] " if r else ""
        for k in [*va, *(k for k in vb if k not in va)]:
            if json.dumps(va.get(k), sort_keys=True) != json.dumps(vb.get(k), sort_keys=True):
                shown = [decode_value(v[k], loc) if k in v else ABSENT for v, loc in ((va, str(a)), (vb, str(b)))]
                rep.plain.append((label + k, shown[0], shown[1]))
    return rep
