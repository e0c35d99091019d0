"""torch dtypes to and from the format's dtype names (stashpoint._core.dtypes), and a tensor's
bytes as a memoryview."""

from __future__ import annotations

import ctypes

import torch

from stashpoint._core.dtypes import ITEMSIZE
from stashpoint.errors import CorruptCheckpointError

_BY_NAME: dict[str, torch.dtype] = {
    name: d for name in ITEMSIZE if isinstance(d := getattr(torch, name, None), torch.dtype)
}


STORABLE: frozenset[torch.dtype] = frozenset(_BY_NAME.values())  # the torch dtypes the format lists


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: object, where: str) -> torch.dtype:
    """The torch dtype called ``name`` in a checkpoint; unknown names are corruption."""
    if not isinstance(name, str) or name not in _BY_NAME:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in {where}")
    return _BY_NAME[name]


def as_memoryview(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy).

    The caller keeps ``t`` alive while the view is in use.
    """
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
