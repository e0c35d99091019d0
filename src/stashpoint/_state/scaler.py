"""``torch.amp.GradScaler`` without a host sync: its ``state_dict()`` turns the scale and the
growth tracker into Python numbers with ``.item()``, which waits for every kernel queued on the
GPU. A save takes the scaler's own 0-d tensors instead (staged like every other tensor, on a side
stream ordered after the current one, so the values at the time of the call are saved), and a
load turns them back into the numbers ``load_state_dict`` expects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

_GradScaler = torch.amp.GradScaler  # torch.cuda.amp.GradScaler and FSDP's ShardedGradScaler subclass it

#: What ``state_dict()`` reads; a subclass that overrides one of them keeps its own ``state_dict()``.
_READERS = ("state_dict", "get_scale", "_get_scale_async", "_get_growth_tracker")

#: The entries of ``state_dict()`` that are 0-d tensors in a save, with the type they come back as.
_TENSOR_ENTRIES: dict[str, type] = {"scale": float, "_growth_tracker": int}


def _native(obj: Any) -> bool:
    """``obj`` is a GradScaler whose ``state_dict()`` is torch's own (and reads what torch's reads)."""
    cls = type(obj)
    return isinstance(obj, _GradScaler) and all(
        getattr(cls, name, None) is getattr(_GradScaler, name, None) for name in _READERS
    )


def scaler_state(obj: Any) -> dict[str, Any] | None:
    """``obj.state_dict()`` with ``"scale"`` and ``"_growth_tracker"`` as the scaler's own live
    tensors (no ``.item()``, no copy) for an enabled GradScaler that has made them (its first
    ``scale()``); None for anything else, which keeps its plain ``state_dict()`` (a disabled
    scaler's is ``{}``, an unused one's holds its initial numbers and costs no sync)."""
    if not _native(obj) or not getattr(obj, "_enabled", False):
        return None
    scale = getattr(obj, "_scale", None)
    tracker = getattr(obj, "_growth_tracker", None)
    if not (isinstance(scale, torch.Tensor) and isinstance(tracker, torch.Tensor)):
        return None
    try:  # the fields and order of torch's GradScaler.state_dict()
        return {
            "scale": scale,
            "growth_factor": obj._growth_factor,
            "backoff_factor": obj._backoff_factor,
            "growth_interval": obj._growth_interval,
            "_growth_tracker": tracker,
        }
    except AttributeError:  # a torch whose GradScaler keeps these elsewhere: its own state_dict()
        return None


def scaler_load_state(sd: Mapping[str, Any]) -> dict[str, Any]:
    """The state to give ``GradScaler.load_state_dict``: ``sd`` with a one-element tensor under
    ``"scale"`` (float) or ``"_growth_tracker"`` (int) turned into the Python number torch's
    ``state_dict()`` has there (``load_state_dict`` keeps the scale as ``_init_scale``, which
    ``get_scale()`` returns until the scaler's first ``scale()``). Numbers, as checkpoints made
    before the tensors were saved hold, are kept as they are."""
    out = dict(sd)
    for key, kind in _TENSOR_ENTRIES.items():
        value = out.get(key)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = kind(value.item())
    return out
