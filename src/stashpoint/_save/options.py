"""The options of one save, checked when they are made."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stashpoint._core.policy import count_or_none, flag, seconds_or_none
from stashpoint._save import writerproc as _writerproc

DEFAULT_MAX_SHARD_BYTES = 256 << 20  # files small enough that a save has several to write at once
DEFAULT_WRITER = "thread"  # the faster on the training loop here: see async_save's ``writer``


@dataclass(frozen=True)
class SaveOptions:
    """Options of one save (the public ones are documented on :func:`async_save`)."""

    overwrite: bool = False
    allow_pickle: bool = False
    metadata: Mapping[str, str] = field(default_factory=dict)
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    max_inflight: int = 1
    on_busy: str = "wait"
    step: int | None = None
    process_group: Any = None
    timeout_s: float | None = None
    overlap: bool = False
    writer: str = DEFAULT_WRITER
    nodes: Any = None  # node-local directories: a ``_dist.nodes.NodeSave``
    refused: str | None = None  # this rank refuses the save (why): every rank fails it together
    # where this rank's refusal is raised (the other ranks learn of it from their handles):
    # "call" (from the call), "alone" (from the call of a one-rank save, else from the handle),
    # "handle" (from the handle only: a storage that failed a check must not stop training)
    refusal: str = "call"

    def __post_init__(self) -> None:
        if not isinstance(self.metadata, Mapping):
            raise TypeError(f"metadata must be a dict of str to str, not {type(self.metadata).__name__}")
        for k, v in self.metadata.items():
            if not (isinstance(k, str) and isinstance(v, str)):
                what = (
                    f"its key {k!r} is a {type(k).__name__}"
                    if not isinstance(k, str)
                    else f"metadata[{k!r}] is a {type(v).__name__}"
                )
                raise TypeError(f"metadata must map str to str: {what}; convert them with str() or json.dumps()")
        if self.on_busy not in ("wait", "skip"):
            raise ValueError(f"on_busy must be 'wait' or 'skip', got {self.on_busy!r}")
        for name in ("max_inflight", "max_shard_bytes"):
            value = getattr(self, name)
            if value is None:
                raise ValueError(f"{name} must be a positive integer, got None")
            count_or_none(name, value)
        seconds_or_none("timeout", self.timeout_s)
        for name in ("overwrite", "allow_pickle", "overlap"):
            flag(name, getattr(self, name))
        if self.writer not in _writerproc.WRITERS:
            raise ValueError(f"writer must be 'thread' or 'process', got {self.writer!r}")


def copy_metadata(metadata: Any) -> Any:
    """A copy of ``metadata`` (a mapping, or pairs as ``dict()`` takes); anything else as it
    is, for :class:`SaveOptions` to refuse naming its type."""
    if not metadata:
        return {}
    try:
        return dict(metadata)
    except (TypeError, ValueError):
        return metadata
