"""The state tree as stored in a manifest: its node kinds, key paths, and plain values decoded.

The tree mirrors the state's nesting. Each node is a one-key (or two-key) JSON object:

====================================  =============================================================
``{"dict": [[key, node], ...]}``      a mapping; keys are strings or integers, order preserved
``{"list": [node, ...]}``             a list
``{"tuple": [node, ...]}``            a tuple
``{"tensor": "key/path"}``            a tensor, stored in a shard under that key path
``{"value": x}``                      an int, finite float, bool, str or None
``{"float": "nan" | "inf" | "-inf"}`` a non-finite float
``{"bytes": "<base64>"}``             a bytes value
``{"pickle": "<base64>"}``            any other object, only when saved with ``allow_pickle=True``
``{"stateful": kind, "state": node}`` an object with state_dict(); kind is module/optimizer/object
====================================  =============================================================

A tensor's key path joins the dict keys and list indices leading to it with ``/``; ``%`` and ``/``
inside a component are percent-escaped. Objects with ``state_dict()`` add no component.
"""

from __future__ import annotations

import base64
import collections
import functools
import itertools
import pickle
import re
from collections.abc import Container, Iterable, Iterator
from typing import Any, NoReturn

from stashpoint.errors import CheckpointError, CorruptCheckpointError

Node = dict[str, Any]
MAX_TREE_DEPTH = 100  # containers nested in a state; deeper ones are refused when saving and loading
#: Python hashes an int modulo 2**61 - 1 (not randomised, unlike str): keys can be chosen to share
#: one hash, and a dict of N of them takes N**2 steps to build. Real keys (``hash(s)`` of strings,
#: ids) share one by chance alone: more than this many is a crafted checkpoint's attack on a load
MAX_SAME_HASH = 64


def _bad(where: str, what: str) -> NoReturn:
    raise CorruptCheckpointError(f"malformed manifest {where}: {what}")


def _want(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"malformed manifest {where}: {what}")


@functools.lru_cache(maxsize=1 << 16)
def escape(component: str | int) -> str:
    """Escape one key-path component (remembered: a save escapes the same names every time)."""
    return str(component).replace("%", "%25").replace("/", "%2F")


def join(prefix: str, component: str | int) -> str:
    c = escape(component)
    return f"{prefix}/{c}" if prefix else c


def is_plain(node: Node) -> bool:
    """True if the node holds no tensor and no stateful object."""
    if "dict" in node:
        return all(is_plain(v) for _, v in node["dict"])
    if "list" in node:
        return all(is_plain(v) for v in node["list"])
    if "tuple" in node:
        return all(is_plain(v) for v in node["tuple"])
    return "tensor" not in node and "stateful" not in node


_NUMPY_NONFINITE = re.compile(r"np\.float(?:16|32|64)\((nan|inf|-inf)\)")


def nonfinite(text: object) -> str | None:
    """A float node's text as ``float()`` takes it: "nan", "inf" or "-inf", also as earlier
    versions wrote a NumPy float's (``np.float64(nan)``, which no load took); None otherwise."""
    if text in ("nan", "inf", "-inf"):
        return str(text)
    m = _NUMPY_NONFINITE.fullmatch(text) if isinstance(text, str) else None
    return m[1] if m else None


def decode_plain(node: Node, *, allow_pickle: bool, where: str, key: str | None = None) -> Any:
    """Rebuild a plain node's Python value."""
    if "value" in node:
        return node["value"]
    if "float" in node:
        return float(nonfinite(node["float"]) or "nan")
    if "bytes" in node:
        try:
            return base64.b64decode(node["bytes"], validate=True)
        except ValueError:
            raise CorruptCheckpointError(f"malformed bytes value in the manifest of {where}") from None
    if "dict" in node:
        return {k: decode_plain(v, allow_pickle=allow_pickle, where=where) for k, v in node["dict"]}
    if "list" in node:
        return [decode_plain(v, allow_pickle=allow_pickle, where=where) for v in node["list"]]
    if "tuple" in node:
        return tuple(decode_plain(v, allow_pickle=allow_pickle, where=where) for v in node["tuple"])
    if "pickle" in node:
        if not allow_pickle:
            raise PickleRefused(where, key)
        return pickle.loads(base64.b64decode(node["pickle"]))  # noqa: S301 - explicit opt-in
    raise CorruptCheckpointError(f"malformed tree node {str(node)[:100]!r} in the manifest of {where}")


class PickleRefused(CheckpointError):
    """A pickled value met where pickles are not allowed: names the key where known."""

    def __init__(self, where: str, key: str | None) -> None:
        under = f" under {key!r}" if key else ""
        super().__init__(
            f"the checkpoint at {where} holds a pickled value{under}; loading it would run code from the "
            "file. Pass allow_pickle=True only if you trust where the file came from."
        )


def _leaves(node: Node, path: str = "") -> Iterator[tuple[str, Node]]:
    """(key path, node) of every leaf under ``node``: tensors and plain values."""
    if "stateful" in node:
        yield from _leaves(node["state"], path)
    elif "dict" in node:
        for k, v in node["dict"]:
            yield from _leaves(v, join(path, k))
    elif "list" in node or "tuple" in node:
        for i, v in enumerate(node["list"] if "list" in node else node["tuple"]):
            yield from _leaves(v, join(path, i))
    else:
        yield path or "<root>", node


def pickled_values(node: Node, path: str = "") -> list[str]:
    """The key paths of the pickled values under ``node`` (unpickles nothing)."""
    return [p for p, leaf in _leaves(node, path) if "pickle" in leaf]


def _unreadable(leaf: Node) -> bool:
    if "bytes" in leaf or "pickle" in leaf:
        try:
            base64.b64decode(leaf["bytes"] if "bytes" in leaf else leaf["pickle"], validate=True)
        except ValueError:
            return True
    return "float" in leaf and nonfinite(leaf["float"]) is None


def unreadable_values(node: Node, path: str = "") -> list[str]:
    """Where plain values under ``node`` (a parsed tree) would fail to decode: bytes or a
    pickle that is not base64, a float that is not one. Decodes nothing else, unpickles nothing:
    what ``verify`` checks of the values a load would rebuild."""
    return [p for p, leaf in _leaves(node, path) if _unreadable(leaf)]


def tensor_keys(node: Node) -> list[str]:
    """Every tensor key under ``node``."""
    if "tensor" in node:
        return [node["tensor"]]
    if "stateful" in node:
        return tensor_keys(node["state"])
    children: list[Node] = []
    if "dict" in node:
        children = [v for _, v in node["dict"]]
    elif "list" in node:
        children = node["list"]
    elif "tuple" in node:
        children = node["tuple"]
    return [k for c in children for k in tensor_keys(c)]


_LEAF_TYPES: dict[str, tuple[type, ...]] = {
    "value": (type(None), bool, int, float, str),
    "float": (str,),
    "bytes": (str,),
    "pickle": (str,),
}


_STATEFUL_FIELDS = frozenset({"stateful", "state", "keyed_by", "class"})


def check_tree(node: object, tensors: Container[str], where: str, depth: int) -> None:
    """Every tree node has one known form (see the module doc); every tensor it names is in
    ``tensors``; nesting is bounded. Raises :class:`CorruptCheckpointError` naming ``where``."""
    # per node: each message is formatted only when its check fails (str(node) is the subtree)
    if depth > MAX_TREE_DEPTH:
        _bad(where, f"the state tree is nested deeper than {MAX_TREE_DEPTH} levels")
    if type(node) is not dict:
        _bad(where, "tree node must be an object")
    if "stateful" in node:
        if node["stateful"] not in ("module", "optimizer", "object"):
            _bad(where, "unknown stateful kind")
        if not node.keys() <= _STATEFUL_FIELDS or "state" not in node:
            _bad(where, f"a stateful node has the fields {sorted(node)[:8]!r}, not those of the format")
        if node.get("keyed_by", "name") not in ("name", "index"):
            _bad(where, "unknown optimizer keying")
        if not isinstance(node.get("class", ""), str) or len(node.get("class", "")) > 512:
            _bad(where, "an optimizer's class must be a name of at most 512 characters")
        check_tree(node.get("state"), tensors, where, depth + 1)
        return
    if len(node) != 1:
        _bad(where, f"tree node {str(node)[:80]!r} must have exactly one field")
    ((kind, value),) = node.items()
    if kind == "tensor":
        if not (type(value) is str and value in tensors):
            _bad(where, f"tree names tensor {str(value)[:80]!r} with no entry")
    elif kind in _LEAF_TYPES:
        if not isinstance(value, _LEAF_TYPES[kind]) or (kind == "float" and nonfinite(value) is None):
            _bad(where, f"malformed {kind} node")
    elif kind == "dict":
        if type(value) is not list:
            _bad(where, "dict node must hold a list of [key, node] pairs")
        for item in value:
            if not (type(item) is list and len(item) == 2 and type(item[0]) in (str, int)):
                _bad(where, "dict node must hold [key, node] pairs")
            check_tree(item[1], tensors, where, depth + 1)
        crowded = same_hash_keys(item[0] for item in value)
        if crowded is not None:
            _bad(where, f"a dict node holds more than {MAX_SAME_HASH} integer keys of one hash, as {crowded}'s")
    elif kind in ("list", "tuple"):
        if type(value) is not list:
            _bad(where, f"{kind} node must hold a list")
        for item in value:
            check_tree(item, tensors, where, depth + 1)
    else:
        _bad(where, f"unknown tree node kind {kind!r}")


# what wrappers put before a module's own names in its state_dict(): DDP and DataParallel,
# torch.compile, FSDP1, activation checkpointing
_WRAPPER_PARTS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def same_hash_keys(keys: Iterable[object]) -> int | None:
    """An integer key that more than :data:`MAX_SAME_HASH` of ``keys`` share their hash with, or
    None. Linear: the hashes are counted, no dict of the keys is built."""
    ints = [k for k in keys if type(k) is int]
    if len(ints) <= MAX_SAME_HASH:
        return None
    counts = collections.Counter(hash(k) for k in ints)
    top, n = counts.most_common(1)[0]
    return next(k for k in ints if hash(k) == top) if n > MAX_SAME_HASH else None


def wrapper_hint(missing: list[str], unexpected: list[str]) -> str | None:
    """A hint for a mismatch where the state's and the checkpoint's key paths differ only by
    the names a wrapper adds (``model/module.0.weight`` against ``model/0.weight``); None
    when that explains less than half of the missing keys."""

    def bare(path: str) -> str:
        return "/".join(".".join(p for p in c.split(".") if p not in _WRAPPER_PARTS) for c in path.split("/"))

    theirs = {bare(k): k for k in unexpected}
    pairs = [(theirs[bare(k)], k) for k in missing if bare(k) in theirs and theirs[bare(k)] != k]
    if not pairs or 2 * len(pairs) < len(missing):
        return _prefix_hint(missing, unexpected)
    saved, live = pairs[0]
    parts = saved.rsplit("/", 1)[-1].split(".")
    leading = list(itertools.takewhile(lambda p: p in _WRAPPER_PARTS, parts[:-1]))
    imported = (
        "; a checkpoint made by `stashpoint import` of such a torch.save file: import it again with "
        + " ".join(f"--strip-prefix {p + '.'!r}" for p in leading)
        if leading
        else ""
    )
    return (
        f"the keys differ by a wrapper's prefix ({saved!r} in the checkpoint, {live!r} in the state): DDP, "
        "DataParallel, torch.compile and FSDP1 add one to state_dict(). Put the module itself in the state "
        "(stashpoint saves and loads a wrapped module under its own names), not a wrapped module's state_dict()"
        + imported
    )


_HINT_PARTS = 64  # a model's keys have a dozen parts or so; longer ones get no hint


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str | None:
    """A hint where most missing keys are unexpected ones under another prefix (a model saved
    bare, loaded as a submodule ``backbone`` of another): the two prefixes, with an example."""
    table: dict[tuple[str, ...], tuple[str, str]] = {}
    for u in unexpected[:100_000]:
        parts = tuple(u.replace("/", ".").split("."))
        if len(parts) > _HINT_PARTS:  # every tail of a key is kept: quadratic in its parts
            continue
        for k in range(len(parts) - 1):  # every tail of two names or more ("0.weight", not "weight")
            table.setdefault(parts[k:], (".".join(parts[:k]), u))
    counts: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for m in missing[:100_000]:
        parts = tuple(m.replace("/", ".").split("."))
        if len(parts) > _HINT_PARTS:
            continue
        for k in range(len(parts) - 1):
            hit = table.get(parts[k:])
            if hit is not None:
                counts.setdefault((hit[0], ".".join(parts[:k])), []).append((hit[1], m))
                break
    best = max(counts.items(), key=lambda kv: len(kv[1]), default=None)
    if best is None or 2 * len(best[1]) < len(missing) or best[0][0] == best[0][1]:
        return None
    (theirs, ours), [(saved, live), *_] = best
    return (
        f"the keys differ by a prefix: the checkpoint has {theirs or '(none)'!r} where the state has "
        f"{ours or '(none)'!r} ({saved!r} against {live!r}); load into the part of the state the checkpoint "
        "was saved from, or give the state the checkpoint's structure"
    )
