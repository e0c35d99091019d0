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
"""

from ._data import StatefulSampler
from ._handle import SaveHandle, SaveStats
from ._inspect import VerifyReport, verify
from ._load import load
from ._manager import CheckpointManager
from ._read import read
from ._rng import RNGState
from ._save import async_save, save
from ._version import __version__
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
    UnsupportedStateError,
)

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "RNGState",
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
    "verify",
]
