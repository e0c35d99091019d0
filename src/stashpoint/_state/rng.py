"""RNGState: one stateful object for every random number generator a training run uses."""

from __future__ import annotations

import random
from typing import Any

import torch

_np: Any
try:  # NumPy is optional
    import numpy as _np
except ImportError:  # pragma: no cover - exercised only without NumPy
    _np = None


class RNGState:
    """Captures and restores Python's ``random``, NumPy's global generator (when NumPy is
    installed), torch's CPU generator and the generator of every CUDA device.

    Put an instance in the saved state (``{"rng": stashpoint.RNGState(), ...}``); saving reads
    the generators at that moment, loading sets them. The states are per process: in a
    distributed run each rank saves and restores its own. The state of the rank's current CUDA
    device goes back to its current device at load time, even where ``CUDA_VISIBLE_DEVICES``
    numbers the devices otherwise (a rank on GPU 3 of 8 at save, on its only visible GPU at
    resume); the other devices are restored by index only when both runs see the same devices
    and the same current one (see :func:`cuda_targets`).
    """

    def state_dict(self) -> dict[str, Any]:
        # Only plain values (bytes, ints, ...): they differ between ranks, and per-rank plain
        # values are kept per rank, where tensors under one key would be taken as replicas.
        sd: dict[str, Any] = {"python": random.getstate(), "torch": _to_bytes(torch.get_rng_state())}
        if _np is not None:
            st = _np.random.get_state(legacy=False)
            sd["numpy"] = {
                "bit_generator": st["bit_generator"],
                "key": st["state"]["key"].astype("<u4").tobytes(),
                "pos": int(st["state"]["pos"]),
                "has_gauss": int(st["has_gauss"]),
                "gauss": float(st["gauss"]),
            }
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            sd["cuda"] = [_to_bytes(t) for t in torch.cuda.get_rng_state_all()]
            sd["cuda_current"] = torch.cuda.current_device()
        return sd

    def _stashpoint_check(self, state_dict: Any) -> str | None:
        """Why ``state_dict`` is no RNG state (None if it is), tried on scratch generators."""
        if not isinstance(state_dict, dict) or not {"python", "torch"} <= set(state_dict) <= _KEYS:
            return f"an RNG state holds the keys {sorted(_KEYS)} (python and torch at least)"
        try:
            py = state_dict["python"]
            random.Random().setstate((py[0], tuple(py[1]), py[2]))
            torch.Generator().set_state(_from_bytes(state_dict["torch"]))
            np_state = state_dict.get("numpy")
            if np_state is not None and _np is not None:
                _np.random.RandomState().set_state(_numpy_state(np_state))
            cuda = state_dict.get("cuda")
            if cuda is not None and not (
                isinstance(cuda, (list, tuple)) and all(isinstance(s, (bytes, torch.Tensor)) for s in cuda)
            ):
                return "the CUDA RNG states are not a list of byte strings"
            current = state_dict.get("cuda_current")
            if current is not None and not (
                type(current) is int and cuda is not None and 0 <= current < len(cuda)
            ):
                return f"the current CUDA device {current!r} is not one of the saved CUDA RNG states"
        except (TypeError, ValueError, KeyError, IndexError, OverflowError, RuntimeError) as e:
            return f"the RNG state does not fit its generator ({type(e).__name__}: {str(e)[:80]})"
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        problem = self._stashpoint_check(state_dict)
        if problem is not None:
            raise ValueError(problem)
        py = state_dict["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        torch.set_rng_state(_from_bytes(state_dict["torch"]))
        np_state = state_dict.get("numpy")
        if np_state is not None and _np is not None:
            _np.random.set_state(_numpy_state(np_state))
        cuda = state_dict.get("cuda")
        if cuda and torch.cuda.is_available():
            pairs = cuda_targets(
                len(cuda), state_dict.get("cuda_current"), torch.cuda.device_count(), torch.cuda.current_device()
            )
            for saved, device in pairs:
                torch.cuda.set_rng_state(_from_bytes(cuda[saved]), device)


def cuda_targets(saved: int, saved_current: int | None, count: int, current: int) -> list[tuple[int, int]]:
    """``(saved index, device index)`` of each CUDA RNG state to restore.

    The saved current device's state goes to the current device. The others go by index only
    when the run sees as many devices and the same current one as the saving run (the same
    ``CUDA_VISIBLE_DEVICES``, as a rule); otherwise index ``i`` may be another GPU, whose
    generator is left alone. A checkpoint from before the current device was recorded
    (``saved_current`` None) is restored by index.
    """
    if saved_current is None:
        return [(i, i) for i in range(min(saved, count))]
    if saved == count and saved_current == current:
        return [(i, i) for i in range(count)]
    return [(saved_current, current)]


_KEYS = {"python", "torch", "numpy", "cuda", "cuda_current"}


def _numpy_state(np_state: dict[str, Any]) -> dict[str, Any]:
    assert _np is not None
    return {
        "bit_generator": np_state["bit_generator"],
        "state": {"key": _np.frombuffer(np_state["key"], dtype="<u4").astype(_np.uint32), "pos": np_state["pos"]},
        "has_gauss": np_state["has_gauss"],
        "gauss": np_state["gauss"],
    }


def _to_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()) if _np is not None else bytes(t.tolist())


def _from_bytes(b: bytes | torch.Tensor) -> torch.Tensor:
    if isinstance(b, torch.Tensor):  # tolerate states saved as tensors
        return b.to(torch.uint8).cpu()
    if not isinstance(b, (bytes, bytearray)):  # bytearray(n) of an int would allocate n bytes
        raise TypeError(f"an RNG state must be bytes, not {type(b).__name__}")
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)
