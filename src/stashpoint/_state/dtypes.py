"""torch dtypes to and from the format's dtype names (stashpoint._core.dtypes), and a tensor's
bytes as a memoryview."""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from stashpoint._core.dtypes import ITEMSIZE
from stashpoint.errors import CheckpointError, CorruptCheckpointError

_BY_NAME: dict[str, torch.dtype] = {
    name: d for name in ITEMSIZE if isinstance(d := getattr(torch, name, None), torch.dtype)
}


STORABLE: frozenset[torch.dtype] = frozenset(_BY_NAME.values())  # the torch dtypes the format lists


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: object, where: str) -> torch.dtype:
    """The torch dtype called ``name`` in a checkpoint. A name the format lists that this torch
    lacks (saved under a newer torch) is not damage: the checkpoint is sound, the torch too old."""
    if isinstance(name, str) and name in _BY_NAME:
        return _BY_NAME[name]
    if isinstance(name, str) and name in ITEMSIZE:
        raise CheckpointError(
            f"{where} holds dtype {name}, which torch {torch.__version__} does not have: the checkpoint was saved "
            "with a newer torch; load it with that torch (or a newer one)"
        )
    raise CorruptCheckpointError(f"unknown dtype {name!r} in {where}")


def empty_for(key: str, dtype: object, shape: tuple[int, ...], device: Any = None) -> torch.Tensor:
    """A tensor for ``key`` as a checkpoint describes it (dtype name, shape); an allocation that
    fails (a shape too large for this host, or a hostile catalog's) is a CheckpointError that
    names the key and the bytes."""
    dt = torch_dtype(dtype, key)
    try:
        return torch.empty(shape, dtype=dt, device=device)
    except (RuntimeError, MemoryError) as e:
        nbytes = math.prod(shape) * dt.itemsize
        raise CheckpointError(
            f"cannot allocate {nbytes:,} bytes for {key!r} ({dtype}{list(shape)}), the size the checkpoint gives it: "
            f"{str(e)[:200]} (load it into a state that holds it, or on a host with the memory)"
        ) from None


def as_memoryview(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy).

    The caller keeps ``t`` alive while the view is in use.
    """
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
