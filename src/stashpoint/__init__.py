"""stashpoint: checkpointing for PyTorch training that barely stops it.

A save is split in two: *staging* copies every tensor into reusable host buffers (the only part
that blocks training), and *persisting* writes those bytes to storage in the background with
checksums, fsync and an atomic commit.

Public API::

    stashpoint.save(state, path)            # blocking, durable on return
    stashpoint.async_save(state, path)      # returns once staged -> SaveHandle
    stashpoint.load(state, path)            # in place, verified
    stashpoint.read(path)                   # no template: nested dicts of full tensors
    stashpoint.verify(path)                 # every checksum and the structure -> VerifyReport
    stashpoint.RNGState()                   # every RNG, as a stateful object
    stashpoint.StatefulSampler(dataset)     # a resumable data position
    stashpoint.shutdown()                   # wait for saves, stop the writer process, free groups
"""

from typing import TYPE_CHECKING, Any

from stashpoint._version import __version__
from stashpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
    UnsupportedStateError,
)

# The public API by the module that defines it. They are imported on first use, so that
# ``import stashpoint`` (and the command line's ls, inspect, verify) need not import torch.
_LAZY = {
    "StatefulSampler": "stashpoint._state.sampler",
    "RNGState": "stashpoint._state.rng",
    "SaveHandle": "stashpoint._save.handle",
    "SaveStats": "stashpoint._save.handle",
    "RestoreReport": "stashpoint._manager.restoring",
    "async_save": "stashpoint._save.engine",
    "save": "stashpoint._save.engine",
    "load": "stashpoint._load.loader",
    "read": "stashpoint._load.read",
    "CheckpointManager": "stashpoint._manager.manager",
    "VerifyReport": "stashpoint._tools.checking",
    "verify": "stashpoint._tools.checking",
    "shutdown": "stashpoint._runtime",
}

if TYPE_CHECKING:
    from stashpoint._load.loader import load
    from stashpoint._load.read import read
    from stashpoint._manager.manager import CheckpointManager
    from stashpoint._manager.restoring import RestoreReport
    from stashpoint._runtime import shutdown
    from stashpoint._save.engine import async_save, save
    from stashpoint._save.handle import SaveHandle, SaveStats
    from stashpoint._state.rng import RNGState
    from stashpoint._state.sampler import StatefulSampler
    from stashpoint._tools.checking import VerifyReport, verify

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "RNGState",
    "RestoreReport",
    "SaveHandle",
    "SaveStats",
    "StateMismatchError",
    "StatefulSampler",
    "UnsupportedStateError",
    "VerifyReport",
    "__version__",
    "async_save",
    "load",
    "read",
    "save",
    "shutdown",
    "verify",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stashpoint' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
