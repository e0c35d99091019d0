"""The records of a load's plan (what to read where, what to set, what to call) and the pure
helpers the planner (``restore``) matches the saved tree against the live state with."""

from __future__ import annotations

import dataclasses
import unicodedata
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from stashpoint._core.format import TensorEntry
from stashpoint._core.nodes import Node
from stashpoint._core.reshard import Box, intersect
from stashpoint._state import stateful as _stateful
from stashpoint._state.dtensor import local_part
from stashpoint._state.dtypes import dtype_name

Setter = Callable[[Any], None] | None


@dataclass
class Read:
    """Read the ``region`` (global coordinates) of stored tensor ``key`` (never an alias) into
    ``dest``, a tensor of the region's shape (a rank's local shard, or the whole tensor)."""

    key: str
    dest: torch.Tensor
    region: Box

    @classmethod
    def into(cls, key: str, live: torch.Tensor) -> Read:
        dest, region, _ = local_part(live)
        return cls(key, dest, region)


@dataclass
class RestorePlan:
    reads: list[Read] = field(default_factory=list)
    setters: list[Callable[[], None]] = field(default_factory=list)
    finalizers: list[tuple[str, Callable[[], None]]] = field(default_factory=list)  # (where, call)
    # calls that raise where a finalizer would, changing nothing: an atomic load runs them first
    checks: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # key paths of "missing key" problems
    unexpected: list[str] = field(default_factory=list)  # and of "unexpected key" ones
    casts: set[tuple[str, str]] = field(default_factory=set)  # (saved, live) dtypes of same-shape mismatches


def holds_tensors(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor) or _stateful.kind_of(obj) is not None:
        return True
    if isinstance(obj, MutableMapping):
        return any(holds_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_tensors(v) for v in obj)
    return False


def without_inner_wrappers(state: Node) -> Node:
    """A module's saved state dict with its keys as saved now: a checkpoint written before
    modules' keys were saved without inner wrappers' parts holds them."""
    items = state.get("dict") if isinstance(state, dict) else None
    if not isinstance(items, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in items):
        return state
    if not all(isinstance(k, str) for k, _ in items):
        return state
    keys = _stateful.module_keys(k for k, _ in items)
    if keys is None:
        return state
    back = {k: saved for saved, k in keys.items()}
    return {**state, "dict": [[back[k], v] for k, v in items]}


def mismatch(entry: TensorEntry, t: torch.Tensor) -> bool:
    return entry.dtype != dtype_name(t.dtype) or tuple(entry.shape) != tuple(t.shape)


def refill(live: MutableMapping[Any, Any], value: dict[Any, Any]) -> None:
    live.clear()
    live.update(value)


def bind(fn: Callable[[Any, Any], None] | None, key: Any) -> Setter:
    if fn is None:
        return None
    return lambda value: fn(key, value)


def objects_in(node: Node) -> int:
    """How many objects' states (``stateful`` nodes, not within one another) ``node`` holds."""
    count, stack = 0, [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, dict):
            continue
        if "stateful" in n:
            count += 1
        elif "dict" in n:
            stack.extend(child for _, child in n["dict"])
        elif "list" in n or "tuple" in n:
            stack.extend(n.get("list") or n.get("tuple") or ())
    return count


def shown(live: Any) -> str:
    """What a live object is called in a message: its class, or what stashpoint's own objects
    (private classes) say they are (``_stashpoint_what``)."""
    return str(getattr(type(live), "_stashpoint_what", type(live).__name__))


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, t.shape, t.stride(), t.device, t.is_conj(), t.is_neg())  # as a save tells aliases


def _stored(entry: TensorEntry, region: Box) -> list[tuple[Any, ...]]:
    """The chunks of ``entry`` that ``region`` takes: their places and checksums."""
    return [
        (c.offsets, c.shape, c.checksums)
        for c in entry.chunks
        if intersect(Box(c.offsets, c.shape), region) is not None
    ]


def tied_apart(reads: list[Read], tensors: Mapping[str, TensorEntry]) -> tuple[list[Read], list[tuple[str, str]]]:
    """``reads`` less those into a tensor an earlier read fills too from another entry (a state
    tied where the checkpoint was saved untied: decided by the state alone, so every rank keeps
    the same), and the pairs of keys whose stored values are not shown alike (same chunks, same
    checksums), the kept one first. ``reads`` itself where none is dropped. Pure."""
    ptrs = [r.dest.data_ptr() for r in reads]
    if len(set(ptrs)) == len(ptrs):
        return reads, []  # as a rule: one pass over addresses alone (~1 us a tensor, where 100k count)
    at: dict[tuple[Any, ...], int] = {}  # by address and layout: a flat buffer first must not hide two views
    clashes: list[tuple[str, str]] = []
    dropped = set()
    for i, ptr in enumerate(ptrs):
        first = at.setdefault((ptr, *_layout(reads[i].dest)), i)
        a, b = reads[first], reads[i]
        if first == i or a.key == b.key or not b.dest.numel():
            continue
        dropped.add(i)
        stored = _stored(tensors[a.key], a.region)
        if not stored or stored != _stored(tensors[b.key], b.region):
            clashes.append((a.key, b.key))
    if not dropped:
        return reads, []
    return [r for i, r in enumerate(reads) if i not in dropped], clashes


def key_named(key: str) -> str:
    if not key:
        return "<root>"
    if unicodedata.is_normalized("NFC", key):
        return repr(key)
    # a combining accent ('cafe\u0301') prints as the composed name ('café'): shown escaped
    return f"{key!r} (written {key!a}, not in Unicode's composed form)"


def with_tied_apart(plan: RestorePlan, tensors: Mapping[str, TensorEntry]) -> RestorePlan:
    """``plan`` where the state holds one tensor under two keys (tied weights) that the
    checkpoint holds as two tensors (saved untied): the first key's read alone, on every rank
    alike, and a problem where their values differ or cannot be shown alike. ``tensors``: the
    entries with every chunk the reads need (a version-2 rank's own index lacks the chunks
    other ranks wrote). A new plan: the one given may be remembered."""
    reads, clashes = tied_apart(plan.reads, tensors)
    if reads is plan.reads:
        return plan
    problems = [
        f"{key_named(other)} and {key_named(first)}: the state holds one tensor for both (tied weights, an "
        "embedding and an output layer, say), and the checkpoint holds two tensors of values not alike (saved "
        f"untied); untie them in this model as they were at the save, or load with strict=False to take {first!r} "
        "for both"
        for first, other in clashes
    ]
    return dataclasses.replace(plan, reads=reads, problems=[*plan.problems, *problems])
