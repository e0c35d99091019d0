"""A data loader's state kept per rank: its tensors (a sampler's generator state) as plain values.

A tensor under one key on several ranks is taken to be a replica and written once; a data
loader's tensors differ between ranks (each shuffles its own shard), and plain values are kept
per rank. So a ``StatefulDataLoader`` (torchdata) in the state saves its tensors as plain bytes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from stashpoint._state.dtypes import dtype_name, torch_dtype
from stashpoint.errors import CheckpointError

TENSOR = "__stashpoint_tensor__"


def is_loader(obj: object) -> bool:
    """A data loader with a state of its own (torchdata's ``StatefulDataLoader``)."""
    return isinstance(obj, torch.utils.data.DataLoader) and callable(getattr(obj, "state_dict", None))


#: Tensors up to this size become plain values (a generator's state: 5 KiB); larger ones (an
#: IterableDataset's shuffle buffer) stay tensors, in shards: as JSON they would bloat the index.
MAX_PLAIN_BYTES = 1 << 20


def as_plain(value: Any) -> Any:
    """``value`` with its small tensors turned into plain values (their dtype, shape and bytes)."""
    if isinstance(value, torch.Tensor):
        if value.numel() * value.element_size() > MAX_PLAIN_BYTES:
            return value
        t = value.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {TENSOR: dtype_name(t.dtype), "shape": list(t.shape), "data": data}
    if isinstance(value, dict):
        return {k: as_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return _like(value, [as_plain(v) for v in value])
    return value


def _like(value: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    """``items`` in a sequence of ``value``'s type (a named tuple takes them as its fields)."""
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)


def encoded(node: Any) -> bool:
    """Whether a saved state's node holds a tensor :func:`as_plain` turned into a plain value."""
    if not isinstance(node, dict):
        return False
    if "stateful" in node:
        return encoded(node["state"])
    if "dict" in node:
        return any(k == TENSOR or encoded(v) for k, v in node["dict"])
    children = node.get("list") or node.get("tuple") or ()
    return any(encoded(v) for v in children)


def as_tensors(value: Any) -> Any:
    """The inverse of :func:`as_plain`; ValueError names what is malformed (a hostile file)."""
    if isinstance(value, dict):
        if TENSOR in value:
            try:
                dtype = torch_dtype(value[TENSOR], "a data loader's state")
            except CheckpointError as e:  # damaged, or a dtype of a newer torch
                raise ValueError(str(e)) from None
            data, shape = value.get("data"), value.get("shape")
            if not (isinstance(data, bytes) and isinstance(shape, list) and all(_count(n) for n in shape)):
                raise ValueError("a tensor of it is not 'data' bytes and a 'shape' of non-negative integers")
            if math.prod(shape) * dtype.itemsize != len(data):
                raise ValueError(f"a tensor of shape {shape} and dtype {value[TENSOR]} has {len(data)} bytes")
            if not data:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
        return {k: as_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return _like(value, [as_tensors(v) for v in value])
    return value


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
