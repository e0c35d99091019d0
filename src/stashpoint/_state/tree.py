"""Turning a training state into a JSON tree plus a list of tensors, and back: the node kinds
are described in :mod:`stashpoint._core.nodes`."""

from __future__ import annotations

import base64
import math
import pickle
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from stashpoint import _runtime
from stashpoint._core.nodes import MAX_SAME_HASH, MAX_TREE_DEPTH, Node, join, same_hash_keys
from stashpoint._core.sealed import shape_problem
from stashpoint._state import perrank
from stashpoint._state import stateful as _stateful
from stashpoint._state.dtensor import is_dtensor, is_strided, local_tensor
from stashpoint._state.dtypes import STORABLE
from stashpoint._state.scaler import scaler_state
from stashpoint.errors import UnsupportedStateError

_SUB_BYTE = {
    getattr(torch, n)
    for n in (
        *(f"int{i}" for i in range(1, 8)),
        *(f"uint{i}" for i in range(1, 8)),
        "quint4x2",
        "quint2x4",
    )
    if hasattr(torch, n)
}


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_PLAIN_MAPPINGS = (dict, OrderedDict)  # never stateful: no need to look for state_dict()


def _placements_ok() -> dict[tuple[object, ...], bool]:
    return _runtime.slot("state.placements_ok", dict)


def _odd_placements(t: torch.Tensor) -> list[object]:
    """The placements of DTensor ``t`` other than ``Shard(dim)`` and ``Replicate`` (remembered
    per placements tuple: checked on every tensor of every save)."""
    placements = tuple(t.placements)  # type: ignore[attr-defined]
    cache = _placements_ok()
    if cache.get(placements):
        return []
    from torch.distributed.tensor import Replicate, Shard

    odd = [p for p in placements if type(p) not in (Shard, Replicate) and not is_strided(p)]
    if len(cache) > 256:
        cache.clear()
    cache[placements] = not odd
    return odd


def check_tensor(key: str, t: torch.Tensor) -> None:
    """Raise :class:`UnsupportedStateError` for tensors whose bytes cannot be saved as-is."""
    where = f"at key {key!r}"
    kind = type(t)
    if torch.nn.parameter.is_lazy(t):  # any use of it raises torch's ValueError, naming no key
        raise UnsupportedStateError(
            f"the parameter {where} belongs to a lazy module (torch.nn.LazyLinear, ...) that has not run yet, so "
            "it has no shape or data; run a forward pass on a sample batch before saving."
        )
    if t.is_nested:  # strided (layout torch.strided, but no one shape) or jagged (a subclass)
        raise UnsupportedStateError(
            f"nested tensor {where} is not supported; save its components (t.unbind(), a list of tensors) instead."
        )
    dtensor = kind not in _PLAIN_TYPES and is_dtensor(t)
    if kind not in _PLAIN_TYPES and not dtensor and not (isinstance(t, torch.nn.Parameter) and _own_memory(kind)):
        # a wrapper subclass (in a Parameter too: its type stays the subclass's) holds its
        # data in inner tensors, not at data_ptr(): saved as it was, its bytes were wrong
        raise UnsupportedStateError(
            f"tensor subclass {kind.__name__} {where} is not supported; convert it to a plain tensor "
            "(DTensor is supported)."
        )
    if t.is_quantized:
        raise UnsupportedStateError(
            f"quantized tensor {where} is not supported; dequantize it (t.dequantize()) or save "
            "its int_repr() with its scale and zero point."
        )
    if t.layout != torch.strided:
        raise UnsupportedStateError(
            f"tensor with layout {t.layout} {where} is not supported; convert it with .to_dense()."
        )
    if t.device.type == "meta":
        raise UnsupportedStateError(f"meta tensor {where} holds no data; materialize it before saving.")
    if key.endswith("__metadata__") and key.rsplit("/", maxsplit=1)[-1] == "__metadata__":
        raise UnsupportedStateError(f"the key {key!r} is reserved by the safetensors layout of the shards; rename it")
    if dtensor:
        odd = _odd_placements(t)
        if odd:
            raise UnsupportedStateError(
                f"DTensor {where} has placement(s) {odd}; only Shard(dim), FSDP2's strided "
                "Shard and Replicate are saved as they are. "
                "Redistribute it first (t.redistribute(placements=[Replicate()]) for a Partial sum)."
            )
    if (problem := shape_problem(tuple(t.shape), t.element_size())) is not None:  # refused by a load
        raise UnsupportedStateError(f"the tensor {where} {problem}; reshape it or save it in parts.")
    if t.dtype in _SUB_BYTE:
        raise UnsupportedStateError(f"tensor of sub-byte dtype {t.dtype} {where} holds no addressable bytes.")
    if t.dtype not in STORABLE:
        raise UnsupportedStateError(
            f"tensor of dtype {t.dtype} {where} is not in the format's dtype table; convert it (t.to(...)) "
            "or upgrade stashpoint"
        )


def _own_memory(kind: type) -> bool:
    """A tensor subclass whose data is its own memory (no ``__torch_dispatch__`` of its own, as
    a wrapper subclass has, whose data lives in inner tensors)."""
    return getattr(kind, "__torch_dispatch__", None) is getattr(torch.Tensor, "__torch_dispatch__", None)


def template_problem(t: torch.Tensor) -> str | None:
    """Why a load cannot write into ``t`` as the state's tensor (None: it can), for the plan's
    list of mismatches."""
    if t.is_nested:
        return "a nested tensor; give the state a list of plain tensors"
    if t.layout != torch.strided:
        return f"of layout {t.layout}; give the state a dense tensor, load, then convert it (t.to_sparse())"
    kind = type(t)
    if kind not in _PLAIN_TYPES and not is_dtensor(t) and not _own_memory(kind):
        return (
            f"a {kind.__name__}, a tensor subclass whose data a load cannot write; give the state a plain "
            "tensor or Parameter, load, then convert it"
        )
    if is_dtensor(t) and (odd := _odd_placements(t)):  # a Partial's ranks would each get the whole value
        return (
            f"a DTensor of placement(s) {odd}, whose local parts are no part of the tensor; load into one "
            "of Shard or Replicate placements, then redistribute it"
        )
    if t.device.type == "meta":
        return (
            "on the meta device and has no memory to load into; materialize it first (module.to_empty(device=...)), "
            "then initialize what the checkpoint does not hold (buffers registered with persistent=False, e.g. "
            "rotary inv_freq)"
        )
    if _elements_overlap(local_tensor(t) if is_dtensor(t) else t):
        return (
            "a view whose elements share memory, or may (an expand, unfold or as_strided window; past "
            f"{_EXACT_OVERLAP_ELEMENTS:,} elements an irregular one is not told apart), so a load cannot write into "
            "it; give the state a tensor with its own memory (t.clone())"
        )
    return None


_EXACT_OVERLAP_ELEMENTS = 1 << 22  # offsets listed one by one up to here (32 MiB of int64)


def _elements_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` are one place in memory. Torch's own test answers "too
    hard" for any view that is not dense (a step slice as for a sliding window): dimensions
    sorted by stride that each step past the extent of the smaller ones cannot overlap; others
    are told by their offsets, or, past a size where listing them costs too much, said to."""
    flag = torch._debug_has_internal_overlap(t)
    if flag != 2:
        return flag == 1
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    extent = 1
    for st, n in dims:
        if st < extent:
            break
        extent += st * (n - 1)
    else:
        return False
    if t.numel() > _EXACT_OVERLAP_ELEMENTS:
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for st, n in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st).flatten()
    return bool(torch.unique(offsets).numel() != offsets.numel())


#: Python's default int_max_str_digits: an int longer than this is refused by the JSON of a
#: default process (ValueError), whatever the saving process allowed.
_INT_DIGITS = 4300
_BIG_INT = 10**_INT_DIGITS


def _check_int(value: int, key: str, what: str) -> None:
    if not -_BIG_INT < value < _BIG_INT:
        raise UnsupportedStateError(
            f"the {what} {key or '<root>'!r} is an int of more than {_INT_DIGITS} digits, which Python "
            "refuses to read back from text by default; save it as a string (str(x)) or as bytes."
        )


class Flattener:
    """Walks a state once; collects the tree and the ``(key, tensor)`` leaves."""

    def __init__(self, *, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self._keys: set[str] = set()
        self._names: dict[int, str] | None = None
        self.buffers: set[str] = set()
        self._depth = 0  # keys of module buffers (plain tensors of a module's state)
        self._root: Any = None

    def flatten(self, state: Any) -> Node:
        self._root = state
        return self._node(state, "")

    def _param_names(self) -> dict[int, str]:
        if self._names is None:
            self._names = _stateful.param_names(_stateful.find_modules(self._root))
        return self._names

    def _node(self, obj: Any, key: str) -> Node:
        if isinstance(obj, torch.Tensor):  # the common leaf, without the depth count
            return self._make(obj, key)
        self._depth += 1
        try:
            if self._depth > MAX_TREE_DEPTH:
                raise UnsupportedStateError(
                    f"the state is nested deeper than {MAX_TREE_DEPTH} containers at key {key[:200]!r}; flatten it"
                )
            return self._make(obj, key)
        finally:
            self._depth -= 1

    def _leaf(self, obj: torch.Tensor, key: str) -> Node:
        """A tensor: checked by the layout (check_tensor) unless known."""
        if key in self._keys:
            raise UnsupportedStateError(
                f"two entries map to the key path {key!r} (e.g. a string key '0' beside an "
                "integer key 0, or a dict under an empty key '' beside its parent's own); rename one of them."
            )
        self._keys.add(key)
        # not detached here: the state's own tensor objects (whose id() the layout cache and
        # overlap mode match), and detach() of a DTensor goes through its dispatcher (slow,
        # per tensor, every save); the layout takes each one's local part, detached
        self.tensors.append((key, obj))
        return {"tensor": key}

    def _make(self, obj: Any, key: str) -> Node:
        if isinstance(obj, torch.Tensor):
            return self._leaf(obj, key)
        if obj is None or isinstance(obj, (bool, int, str)):
            if isinstance(obj, int) and not isinstance(obj, bool):
                _check_int(obj, key, "value at key")
            return {"value": obj}
        if isinstance(obj, float):
            # repr(float(...)): a NumPy float's repr is "np.float64(nan)", which no load takes
            return {"value": obj} if math.isfinite(obj) else {"float": repr(float(obj))}
        if isinstance(obj, bytes):
            return {"bytes": base64.b64encode(obj).decode("ascii")}
        try:
            kind = None if type(obj) in _PLAIN_MAPPINGS else _stateful.kind_of(obj)
        except UnsupportedStateError as e:  # a class given for its object, ZeroRedundancyOptimizer
            raise UnsupportedStateError(f"at key {key or '<root>'!r}: {e}") from None
        if kind == "optimizer":
            if (problem := _stateful.shard_shaped_state(obj, self._param_names())) is not None:
                _stateful.say_shard_shaped(obj, key, problem)
            keyed_by, sd = _stateful.optimizer_to_tree(obj, self._param_names())
            node: dict[str, Any] = {"stateful": kind, "keyed_by": keyed_by, "class": _stateful.class_name(obj)}
            return {**node, "state": self._node(sd, key)}
        if kind == "module":
            obj = _stateful.unwrap(obj)
            # keep_vars: the parameters themselves, not a detach() each (through a DTensor's
            # dispatcher: tens of microseconds per tensor on every save); the layout takes
            # their local parts detached. Only where state_dict() is nn.Module's own.
            if getattr(obj.state_dict, "__func__", None) is torch.nn.Module.state_dict:
                sd = obj.state_dict(keep_vars=True)
                if (renamed := _stateful.module_keys(sd)) is not None:
                    sd = {saved: sd[k] for saved, k in renamed.items()}
                node = {"stateful": kind, "state": self._node(sd, key)}
                self.buffers.update(
                    join(key, k)
                    for k, v in sd.items()
                    if type(v) is torch.Tensor  # not a Parameter, not a DTensor
                )
                return node
        if kind is not None and perrank.is_loader(obj):  # its tensors differ per rank: no replicas
            return {"stateful": kind, "state": self._node(perrank.as_plain(obj.state_dict()), key)}
        if kind is not None:
            # a GradScaler's state with its scale and growth tracker as tensors: its own
            # state_dict() calls .item() on them, which waits for the whole GPU queue
            scaler_sd = scaler_state(obj)
            state = obj.state_dict() if scaler_sd is None else scaler_sd
            return {"stateful": kind, "state": self._node(state, key)}
        if isinstance(obj, Mapping):
            items = []
            for k, v in obj.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise UnsupportedStateError(
                        f"dict key {k!r} of type {type(k).__name__} under {key or '<root>'!r}: only "
                        "str and int keys can be saved; convert the key to a string."
                    )
                if not isinstance(k, str):
                    _check_int(k, key, "dict key under")
                # a tensor value without the depth count's frames (most of a state's nodes)
                sub = join(key, k)
                items.append([k, self._leaf(v, sub) if isinstance(v, torch.Tensor) else self._node(v, sub)])
            crowded = same_hash_keys(obj) if len(obj) > MAX_SAME_HASH else None
            if crowded is not None:  # a load refuses them: they are how a crafted checkpoint attacks it
                raise UnsupportedStateError(
                    f"the dict under {key or '<root>'!r} holds more than {MAX_SAME_HASH} integer keys of one hash "
                    f"(as {crowded}'s), which a load refuses; convert the keys to strings."
                )
            return {"dict": items}
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple, torch.Size):
            kind_name = "list" if isinstance(obj, list) else "tuple"
            return {kind_name: [self._node(v, join(key, i)) for i, v in enumerate(obj)]}
        if self.allow_pickle:
            return {"pickle": base64.b64encode(pickle.dumps(obj, protocol=5)).decode("ascii")}
        module = type(obj).__module__
        hint = ""
        if module == "numpy" and hasattr(obj, "item"):  # a NumPy scalar or array
            hint = " (a NumPy scalar: x.item(); an array: torch.from_numpy(x))"
        elif isinstance(obj, torch.Generator):
            hint = (
                " (a torch.Generator: save b = g.get_state().numpy().tobytes(), kept per rank, and after the "
                "load g.set_state(torch.frombuffer(bytearray(b), dtype=torch.uint8)); stashpoint.RNGState() keeps "
                "the default generators)"
            )
        elif callable(getattr(obj, "to_dict", None)):  # a Hugging Face config, a dataclass-like record
            hint = " (one with to_dict(): save obj.to_dict(), or leave it out: code that builds the model remakes it)"
        raise UnsupportedStateError(
            f"value of type {module}.{type(obj).__qualname__} at key "
            f"{key or '<root>'!r} cannot be saved without pickle. Give it state_dict()/"
            f"load_state_dict(), convert it to tensors or plain values{hint}, or pass allow_pickle=True "
            "(the file then needs allow_pickle=True to load, and loading runs code from it)."
        )


def flatten(state: Any, *, allow_pickle: bool = False) -> tuple[Node, list[tuple[str, torch.Tensor]]]:
    """Return the tree of ``state`` and its tensors in traversal order."""
    f = Flattener(allow_pickle=allow_pickle)
    tree = f.flatten(state)
    return tree, f.tensors


def flatten_with_buffers(
    state: Any, *, allow_pickle: bool = False
) -> tuple[Node, list[tuple[str, torch.Tensor]], set[str]]:
    """:func:`flatten`, and the keys of the modules' buffers among the tensors."""
    f = Flattener(allow_pickle=allow_pickle)
    tree = f.flatten(state)
    return tree, f.tensors, f.buffers
