"""Whole tensors read from a checkpoint, in batches of bounded memory (diff and export)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from stashpoint._core.format import Manifest
from stashpoint._core.reshard import Box
from stashpoint._load.reads import execute_reads
from stashpoint._load.restoreplan import Read
from stashpoint._state.dtypes import empty_for
from stashpoint._storage import Storage
from stashpoint._tools.inspect import nbytes


def read_tensors(storage: Storage, m: Manifest, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """Each key's whole tensor (an alias gets its own copy of its target), on the CPU, verified."""
    out: dict[str, torch.Tensor] = {}
    reads = []
    for key in keys:
        e = m.resolve(key)
        out[key] = empty_for(key, e.dtype, e.shape)
        reads.append(Read(e.key, out[key], Box.whole(e.shape)))
    execute_reads(storage, m, reads, verify=True)
    return out


def batches(m: Manifest, keys: Sequence[str], budget: int = 1 << 28) -> Iterator[list[str]]:
    """``keys`` in groups of at most ``budget`` bytes (a larger tensor alone)."""
    group: list[str] = []
    size = 0
    for k in keys:
        e = m.resolve(k)
        n = nbytes(e.dtype, e.shape)
        if group and size + n > budget:
            yield group
            group, size = [], 0
        group.append(k)
        size += n
    if group:
        yield group
