"""A rank's tensors as the chunks it stores, remembered between saves of the same state.

:class:`Layout` is what a save works out from the tensors of the state: each one's local part
(a DTensor's shard) and place in the global tensor, which keys share their bytes (tied tensors,
stored once), and the hash the ranks compare to reuse their agreed plan. Training saves the same
state again and again, so :class:`LayoutCache` remembers the layouts of the last few structures,
keyed by one *token* per tensor that holds everything a layout depends on: where the tensor's
bytes are, its shape, strides, dtype and device, and for a DTensor its global shape, mesh and
placements. Tokens cost a microsecond or two per tensor; working the layout out again, several
times that (benchmarks/RESULTS.md, "The call's per-tensor cost"). The tensors to copy from are
taken afresh on every save, and no reference to them is kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stashpoint._core.assign import ChunkMeta, layout_hash
from stashpoint._core.described import Description, KeyDesc
from stashpoint._core.plan import TensorSpec, group_aliases
from stashpoint._dist.commit import LayoutMsg
from stashpoint._dist.group import DistContext
from stashpoint._state.dtensor import describe, is_dtensor, local_part, local_tensor
from stashpoint._state.dtypes import dtype_name
from stashpoint._state.tree import check_tensor

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def signature(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors hold the same bytes (None for empty tensors, which hold none)."""
    if t.numel() == 0:
        return None
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t.is_conj(), t.is_neg())


def _tie(sig: tuple[Any, ...] | None, loc: torch.Tensor, t: torch.Tensor, box: Any) -> tuple[Any, ...] | None:
    """What ties two keys of a rank: the same bytes (``sig``) at the same place of the same
    global shape. A shard empty here holds no bytes, yet the ranks that hold some tie it: it is
    tied by the storage it views (one parameter's, which each ``detach()`` a ``state_dict()``
    gives shares) and its place there (None: empty everywhere)."""
    if sig is not None:
        return (sig, box, tuple(t.shape))
    if t.numel() == 0:
        return None
    where = ("empty", _storage_of(loc), loc.storage_offset(), tuple(loc.shape), loc.stride(), loc.dtype, loc.device)
    return (where, box, tuple(t.shape))


def _storage_of(loc: torch.Tensor) -> int:
    """Which storage ``loc`` views (an empty one too: views of one share it, where their
    ``data_ptr()`` is 0 and says nothing)."""
    return int(loc.untyped_storage()._cdata)


def token(t: torch.Tensor) -> tuple[Any, ...]:
    """Everything about ``t`` that its place in a :class:`Layout` depends on (see the module doc),
    and that :func:`check_tensor` checks (its type and dtype: a tensor is only remembered once
    checked). May raise for tensors without plain memory (sparse), which the check refuses."""
    kind = type(t)
    if kind in _PLAIN or not is_dtensor(t):
        return (kind, t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t.is_conj(), t.is_neg())
    loc = local_tensor(t)
    return (
        kind,
        loc.data_ptr(),
        loc.shape,
        loc.stride(),
        loc.dtype,
        loc.device,
        loc.is_conj(),
        loc.is_neg(),
        t.shape,
        id(t.device_mesh),  # type: ignore[attr-defined]
        tuple(t.placements),  # type: ignore[attr-defined]
        None if loc.numel() else _storage_of(loc),  # an empty shard ties by its storage (see _tie)
    )


_NONE = object()


def _shared_spread(d: KeyDesc, spreads: dict[Any, Any]) -> KeyDesc:
    """``d`` holding the first of the equal spreads seen (a copy only where it held another)."""
    if d.spread is None:
        return d
    first = spreads.setdefault(d.spread, d.spread)
    return d if first is d.spread else dataclasses.replace(d, spread=first)


@dataclass
class Layout:
    """A rank's tensors as chunks of global tensors, with tied tensors stored once."""

    chunks: list[ChunkMeta]  # the stored ones, in traversal order
    sources: dict[str, torch.Tensor]  # key -> local tensor to stage (never requires grad)
    aliases: dict[str, str]  # key -> the key whose bytes it shares
    keyinfo: dict[str, tuple[str, tuple[int, ...]]]  # every key -> (dtype name, global shape)
    hash: str
    signatures: dict[str, tuple[Any, ...] | None] = field(default_factory=dict)  # every key's local bytes
    key_of: dict[int, str] = field(default_factory=dict)  # id() of each tensor of the state -> its key
    # what the first plan of a structure needs of this rank, the same on every rank of a regular
    # parallelism (None: some tensor's layout is irregular; see ``_core.described``)
    description: Description | None = None
    # what later saves of this structure can reuse (shared by the layouts a cache hit makes)
    memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def remember(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, once per structure and ``key`` (a few kept: keys that came and went go)."""
        value = self.memo.get(key, _NONE)
        if value is _NONE:  # (a local: the writer thread and the caller's may both ask)
            value = make()
            if len(self.memo) > 8:
                self.memo.clear()
            self.memo[key] = value
        return value

    def specs(self, keys: frozenset[str] | None) -> tuple[TensorSpec, ...]:
        """What planning needs of the chunks this rank copies (``keys``; None: all), made once
        per layout and set of keys (tens of thousands of frozen records cost tenths of a second)."""

        def make() -> tuple[TensorSpec, ...]:
            chunks = self.chunks if keys is None else [c for c in self.chunks if c.key in keys]
            return tuple(TensorSpec(c.key, c.dtype, c.shape, c.itemsize) for c in chunks)

        result: tuple[TensorSpec, ...] = self.remember(("specs", keys), make)
        return result

    @classmethod
    def of(cls, tensors: Sequence[tuple[str, torch.Tensor]], lowest: Collection[str] = ()) -> Layout:
        """``lowest``: keys written by the lowest rank that holds them (module buffers)."""
        parts = [(k, *local_part(t)) for k, t in tensors]
        sigs = [signature(loc) for _, loc, _, _ in parts]
        # stored once where the bytes and their place in the global tensor are the same (a
        # DTensor's local shard saved beside it under a key of its own is a tensor of its own);
        # an empty shard holds no bytes to compare: it is tied by the storage it views (_tie)
        firsts = group_aliases([_tie(s, loc, t, box) for s, (_, loc, box, _), (_, t) in zip(sigs, parts, tensors)])
        chunks, sources, aliases, keyinfo = [], {}, {}, {}
        described: list[KeyDesc | None] = []
        for (key, loc, box, gshape), first, (_, t) in zip(parts, firsts, tensors):
            keyinfo[key] = (dtype_name(loc.dtype), gshape)
            if first is not None:
                aliases[key] = parts[first][0]
                continue
            dtype = dtype_name(loc.dtype)
            chunks.append(ChunkMeta(key, dtype, gshape, box.offsets, box.shape, loc.element_size(), key in lowest))
            sources[key] = loc
            described.append(describe(key, t, box, dtype, key in lowest))
        signatures = {k: s for (k, _, _, _), s in zip(parts, sigs)}
        key_of = {id(t): k for k, t in tensors}
        desc = None
        if all(d is not None for d in described):
            spreads: dict[Any, Any] = {}  # one object per distinct spread: pickled once, not per tensor
            keys = tuple(_shared_spread(d, spreads) for d in described if d)
            desc = Description(keys, tuple(sorted(aliases.items())))
        return cls(chunks, sources, aliases, keyinfo, layout_hash(chunks, aliases), signatures, key_of, desc)

    def expected_writes(self, ctx: DistContext) -> frozenset[str] | None:
        """The keys the last plan gave this rank to write, if that plan was made for this
        layout and may be reused (None if not, and the rank copies everything: a first save, a
        changed structure, a plan made under constraint, or a layout that once left a tensor
        uncopied, see ``_save.agree``)."""
        last = ctx.last_plan
        if last is None or last.layout_hash != self.hash:
            return None
        if ctx.plan_constrained or self.hash in ctx.copy_all:
            return None
        return self.given(last.mine)

    def given(self, mine: Collection[Any]) -> frozenset[str]:
        """The keys of this layout's chunks among ``mine`` (the chunk idents a plan gave this rank)."""
        return frozenset(c.key for c in self.chunks if c.ident in mine)

    def message(self, copied: tuple[Any, ...] | None) -> LayoutMsg:
        """This layout as sent to the other ranks (``copied``: the chunks copied for this save)."""
        return LayoutMsg(tuple(self.chunks), self.aliases, self.keyinfo, copied)


@dataclass(frozen=True)
class _Entry:
    layout: Layout  # without ``sources`` and ``key_of``: no reference to the state's tensors is kept
    shapes: dict[str, tuple[int, ...]]  # stored key -> shape of its local part
    meshes: tuple[object, ...]  # kept alive: their id() is part of the tokens


class LayoutCache:
    """The layouts of the last ``size`` state structures saved (see the module doc)."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._entries: dict[tuple[Any, ...], _Entry] = {}
        self.hits = 0

    def __call__(self, tensors: Sequence[tuple[str, torch.Tensor]], lowest: Collection[str] = ()) -> Layout:
        """The layout of ``tensors``; raises :class:`UnsupportedStateError` for a tensor that
        cannot be saved (checked whenever the layout is not remembered). ``lowest``: see
        :meth:`Layout.of`."""
        try:
            tokens = tuple(token(t) for _, t in tensors)
            key: tuple[Any, ...] | None = (tuple(k for k, _ in tensors), tokens, frozenset(lowest))
        except Exception:  # a tensor without plain memory (sparse): the check below says which and why
            key = None
        entry = self._entries.get(key) if key is not None else None
        if entry is None:
            for k, t in tensors:
                check_tensor(k or "<root>", t)
            layout = Layout.of(tensors, lowest)
            if key is None:
                return layout
            held = (getattr(t, "device_mesh", None) for _, t in tensors)
            meshes = tuple({id(m): m for m in held if m is not None}.values())
            shapes = {k: tuple(t.shape) for k, t in layout.sources.items()}
            if len(self._entries) >= self.size:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = _Entry(dataclasses.replace(layout, sources={}, key_of={}), shapes, meshes)
            return layout
        self.hits += 1
        cached = entry.layout
        sources = {k: local_tensor(t, entry.shapes[k]) for k, t in tensors if k in entry.shapes}
        key_of = {id(t): k for k, t in tensors}
        return dataclasses.replace(cached, sources=sources, key_of=key_of)
