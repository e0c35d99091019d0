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
import pickle
from typing import Any

from stashpoint.errors import CheckpointError, CorruptCheckpointError

Node = dict[str, Any]


def escape(component: str | int) -> str:
    """Escape one key-path component."""
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


def decode_plain(node: Node, *, allow_pickle: bool, where: str) -> Any:
    """Rebuild a plain node's Python value."""
    if "value" in node:
        return node["value"]
    if "float" in node:
        return float(node["float"])
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
            raise CheckpointError(
                f"the checkpoint at {where} holds a pickled value; loading it would run code from the "
                "file. Pass allow_pickle=True only if you trust where the file came from."
            )
        return pickle.loads(base64.b64decode(node["pickle"]))  # noqa: S301 - explicit opt-in
    raise CorruptCheckpointError(f"malformed tree node {str(node)[:100]!r} in the manifest of {where}")


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
