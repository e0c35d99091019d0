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
    distributed run each rank saves and restores its own. When the number of CUDA devices
    differs at load time, the devices both runs have are restored.
    """

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if _np is not None:
            st = _np.random.get_state(legacy=False)
            sd["numpy"] = {
                "bit_generator": st["bit_generator"],
                "key": torch.from_numpy(st["state"]["key"].astype(_np.int64)),
                "pos": int(st["state"]["pos"]),
                "has_gauss": int(st["has_gauss"]),
                "gauss": float(st["gauss"]),
            }
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            sd["cuda"] = list(torch.cuda.get_rng_state_all())
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        py = state_dict["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        torch.set_rng_state(state_dict["torch"].to(torch.uint8).cpu())
        np_state = state_dict.get("numpy")
        if np_state is not None and _np is not None:
            _np.random.set_state(
                {
                    "bit_generator": np_state["bit_generator"],
                    "state": {"key": np_state["key"].numpy().astype(_np.uint32), "pos": np_state["pos"]},
                    "has_gauss": np_state["has_gauss"],
                    "gauss": np_state["gauss"],
                }
            )
        cuda = state_dict.get("cuda")
        if cuda and torch.cuda.is_available():
            for i, s in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s.to(torch.uint8).cpu(), i)
