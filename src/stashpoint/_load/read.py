"""read: a checkpoint as plain Python values, without a live state to load into."""

from __future__ import annotations

import operator
import os
from typing import Any

import torch

from stashpoint import _runtime
from stashpoint._core.format import Manifest
from stashpoint._core.nodes import Node, PickleRefused, decode_plain, escape, join, pickled_values
from stashpoint._core.policy import flag
from stashpoint._core.reshard import Box
from stashpoint._load.manifest import as_changed, open_checkpoint
from stashpoint._load.reads import execute_reads
from stashpoint._load.restoreplan import Read
from stashpoint._state.dtypes import empty_for
from stashpoint._storage import Storage, storage_for
from stashpoint.errors import CheckpointError, CorruptCheckpointError


def read(
    path: str | os.PathLike[str],
    *,
    select: str | None = None,
    device: str | torch.device = "cpu",
    allow_pickle: bool = False,
    rank: int = 0,
) -> Any:
    """Read the checkpoint at ``path`` into new Python values, with no state to load into.

    Returns the saved state as nested dicts, lists and tuples of whole tensors and plain values:
    sharded tensors (DTensor, FSDP2) come back assembled into full tensors, a module as its
    ``state_dict()``, an optimizer as its state dict keyed by parameter name (as saved), tensors
    saved tied as one tensor. Every checksum is verified, and nothing is unpickled unless
    ``allow_pickle=True``. Only the selected tensors are allocated, each once, on ``device``;
    besides them a read holds at most about 256 MiB of bounce buffers (shards that are not a
    contiguous part of their tensor, and CUDA destinations, land there first).

    Args:
        path: a checkpoint directory or ``s3://`` URL.
        select: a key path into the state, its components joined by ``/`` (e.g. ``"model"`` or
            ``"optim/state"``): only that subtree is read. A key that holds ``/`` or ``%`` is
            written with them escaped, ``%2F`` and ``%25`` (``"a%2Fb"`` for the key ``"a/b"``),
            as ``stashpoint inspect`` shows it.
        device: where the tensors are created (``"cuda:0"`` reads straight to the GPU).
        allow_pickle: unpickle values saved with ``allow_pickle=True`` (runs code from the file:
            only for files you trust).
        rank: whose per-rank plain values (RNG states, ...) to return, for a checkpoint saved by
            several ranks (0 to its world size - 1); tensors are the same for every rank.

    A save to ``path`` still in flight in this process (``async_save``) is waited for first.

    Raises:
        CheckpointNotFoundError: nothing at ``path``, or it was deleted while it was read (a
            manager's retention); one replaced meanwhile (``overwrite=True``) raises a
            :class:`CheckpointError` that says so.
        CheckpointError: ``select`` names no key of the checkpoint (the message lists those there).
        CorruptCheckpointError: a checksum or the structure does not match.
        ValueError: ``device`` is a CUDA device and this process has none, or ``rank`` is not a
            rank of the checkpoint.
        TypeError: ``rank`` is not an integer.
    """
    flag("allow_pickle", allow_pickle)
    if select is not None and not isinstance(select, str):
        raise TypeError(f"select must be a key path such as 'model' or 'optim/state', not {select!r}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():  # before anything is read, not at the first tensor
        raise ValueError(f"device={device!r}, but this process has no CUDA device; read to device='cpu'")
    if _runtime.peek("save.engine") is not None:  # a save to ``path`` in flight here: read it committed
        from stashpoint._save.engine import wait_all

        wait_all(storage_for(path).location)
    if isinstance(rank, bool) or not hasattr(rank, "__index__"):  # NumPy's and torch's integers are ints here
        raise TypeError(f"rank must be an int, not {type(rank).__name__}")
    rank = operator.index(rank)
    try:
        storage, manifest = open_checkpoint(path)
    except CorruptCheckpointError as e:  # an index gone with its step (retention)?
        raise as_changed(e, storage_for(path), None) from None
    if not 0 <= rank < manifest.world_size:  # a load's rank r of a larger world reads r mod N; a read names one
        raise ValueError(f"rank {rank} is out of range: {path} was saved by {manifest.world_size} rank(s)")
    node = _select(manifest.tree_for(rank), select, str(path))
    builder = _Builder(manifest, dev, allow_pickle, storage.location)
    try:
        value = builder.build(node)
    except PickleRefused:  # the key is worked out only now: no path is made per value on every read
        found = pickled_values(node, select.strip("/") if select else "")
        raise PickleRefused(storage.location, found[0] if found else None) from None
    try:
        builder.run(storage)
    except CorruptCheckpointError as e:
        raise as_changed(e, storage, manifest.save_id) from None
    return value


def _select(tree: Node, select: str | None, where: str) -> Node:
    if not select:
        return tree
    node, done = tree, ""
    parts = select.strip("/").split("/")
    for i, part in enumerate(parts):
        while "stateful" in node:  # an object adds no key path component
            node = node["state"]
        children: list[tuple[str, Node]] = []
        if "dict" in node:
            children = [(escape(k), v) for k, v in node["dict"]]
        elif "list" in node or "tuple" in node:
            children = [(str(i), v) for i, v in enumerate(node["list"] if "list" in node else node["tuple"])]
        found = [v for k, v in children if k == part]
        if not found:
            shown = ", ".join(repr(k) for k, _ in children[:20]) + (", ..." if len(children) > 20 else "")
            escaped = " (a key holding '/' or '%' is selected escaped: '%2F', '%25')" if "%" in select else ""
            raise CheckpointError(
                f"select={select!r}: {where} has no key {'/'.join(parts[: i + 1])!r}"
                + (f"; the keys under {done or 'the root'!r} are {shown}" if children else f"; {done!r} is a leaf")
                + escaped
            )
        node, done = found[0], join(done, part)
    return node


class _Builder:
    """Builds the Python value of a tree node, allocating each stored tensor once."""

    def __init__(self, manifest: Manifest, device: torch.device, allow_pickle: bool, where: str) -> None:
        self.m = manifest
        self.device = device
        self.allow_pickle = allow_pickle
        self.where = where
        self.tensors: dict[str, torch.Tensor] = {}
        self.reads: list[Read] = []

    def build(self, node: Node) -> Any:
        if "tensor" in node:
            return self._tensor(node["tensor"])
        if "stateful" in node:
            return self.build(node["state"])
        if "dict" in node:
            return {k: self.build(v) for k, v in node["dict"]}
        if "list" in node:
            return [self.build(v) for v in node["list"]]
        if "tuple" in node:
            return tuple(self.build(v) for v in node["tuple"])
        return decode_plain(node, allow_pickle=self.allow_pickle, where=self.where)

    def _tensor(self, key: str) -> torch.Tensor:
        entry = self.m.resolve(key)
        t = self.tensors.get(entry.key)
        if t is None:  # tied tensors come back as one
            t = empty_for(entry.key, entry.dtype, entry.shape, self.device)
            self.tensors[entry.key] = t
            self.reads.append(Read(entry.key, t, Box.whole(tuple(entry.shape))))
        return t

    def run(self, storage: Storage) -> None:
        # in batches: a chunk that is not a contiguous part of its tensor (Shard(1)) lands in a
        # bounce buffer first, and those of one batch exist at once
        batch: list[Read] = []
        size = 0
        for r in self.reads:
            n = r.dest.numel() * r.dest.element_size()
            if batch and size + n > _BATCH_BYTES:
                execute_reads(storage, self.m, batch, verify=True)
                batch, size = [], 0
            batch.append(r)
            size += n
        if batch:
            execute_reads(storage, self.m, batch, verify=True)


_BATCH_BYTES = 256 << 20
