"""Planning a load: match the saved tree against the live state, before any byte is read.

The planner walks both trees together and produces, without modifying anything:

* ``reads``: which stored tensor goes into which destination tensor;
* ``setters``: plain values to put back into containers (applied after the reads);
* ``finalizers``: ``load_state_dict`` calls, innermost first;
* ``problems``: every mismatch found (missing or unexpected keys, shapes, dtypes, types).

Rules: tensors load in place into the state's tensors. Plain values (and containers holding
only plain values) come back whole from the checkpoint. Inside a stateful object that is not a
module (optimizers, schedulers, user objects) the saved state is authoritative: tensors the live
object lacks are allocated. Modules and the top-level containers are matched key by key.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from stashpoint._core.format import Manifest
from stashpoint._core.nodes import Node, decode_plain, is_plain, join, tensor_keys
from stashpoint._load import trial
from stashpoint._load.optimplan import OptimizerPlanning, names_params
from stashpoint._load.restoreplan import (
    Read,
    RestorePlan,
    Setter,
    bind,
    holds_tensors,
    key_named,
    mismatch,
    objects_in,
    refill,
    shown,
    without_inner_wrappers,
)
from stashpoint._state import perrank
from stashpoint._state import stateful as _stateful
from stashpoint._state.dtypes import dtype_name, empty_for
from stashpoint._state.scaler import scaler_load_state
from stashpoint._state.tree import template_problem
from stashpoint._state.validate import structure_problem
from stashpoint.errors import CorruptCheckpointError


class Planner(OptimizerPlanning):
    def __init__(
        self, manifest: Manifest, root: Any, *, allow_pickle: bool, where: str, rank: int = 0, partial: bool = False
    ) -> None:
        self.m = manifest
        self.partial = partial  # keys the state lacks are skipped, not reported
        self.tree = manifest.tree_for(rank)
        self.root = root
        self.allow_pickle = allow_pickle
        self.where = where
        self.plan = RestorePlan()
        self._materialized: dict[str, torch.Tensor] = {}
        self._own: frozenset[str] | None = None  # the tensor keys of this rank's saved tree, once asked
        self._resized: set[str] = set()  # buffers their module's own load_state_dict resizes (quantization's)

    def run(self) -> RestorePlan:
        if "dict" in self.tree and isinstance(self.root, MutableMapping):
            self._dict(self.tree, self.root, "", None, materialize=False)  # the root is updated in place
        else:
            self.restore(self.tree, self.root, "", None, materialize=False)
        return self.plan

    # -- helpers -------------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        return key_named(key)

    def _set(self, setter: Setter, value: Any, where: str = "") -> None:
        if setter is not None:
            self.plan.setters.append(lambda: setter(value))
        else:
            self.plan.problems.append(
                f"{self._name(where)}: the checkpoint holds a plain value here, and the state has no place to put "
                "it back (a tuple, or a plain value at its root, is not changed in place); make the root a dict "
                "or a list"
            )

    def _entry(self, key: str) -> Any:
        entry = self.m.tensors.get(key)
        if entry is None:
            raise CorruptCheckpointError(
                f"the manifest of {self.where} names tensor {key!r} in its tree but lists no entry for it"
            )
        return entry

    def _materialize(self, key: str) -> torch.Tensor:
        entry = self.m.resolve(self._entry(key).key)
        t = self._materialized.get(entry.key)
        if t is None:  # tensors saved once for several keys come back as one tensor (tied)
            t = empty_for(entry.key, entry.dtype, entry.shape)
            self._materialized[entry.key] = t
            self.plan.reads.append(Read.into(entry.key, t))
        return t

    def build(self, node: Node, where: str, like: Any = None) -> Any:
        """A fresh Python value for ``node``; containers are rebuilt.

        A tensor is read into the matching tensor of ``like`` (same place, dtype and shape) when
        there is one a load can write into, so live tensors are reused; otherwise it is
        allocated on the CPU (an object's own ``load_state_dict`` then takes it as it would).
        """
        if "tensor" in node:
            entry = self._entry(node["tensor"])
            reusable = isinstance(like, torch.Tensor) and template_problem(like) is None
            if reusable and not mismatch(entry, like):
                self.plan.reads.append(Read.into(self.m.resolve(entry.key).key, like))
                return like
            return self._materialize(node["tensor"])
        if "stateful" in node:
            return self.build(node["state"], where, like)
        if "dict" in node:
            sub = like if isinstance(like, Mapping) else {}
            return {k: self.build(v, join(where, k), sub.get(k)) for k, v in node["dict"]}
        if "list" in node or "tuple" in node:
            items = node["list"] if "list" in node else node["tuple"]
            seq = like if isinstance(like, (list, tuple)) and len(like) == len(items) else [None] * len(items)
            out = [self.build(v, join(where, i), x) for i, (v, x) in enumerate(zip(items, seq))]
            return out if "list" in node else tuple(out)
        return decode_plain(node, allow_pickle=self.allow_pickle, where=self.where, key=where or None)

    # -- the walk ------------------------------------------------------------------------------

    def restore(self, saved: Node, live: Any, where: str, setter: Setter, *, materialize: bool) -> None:
        if "tensor" in saved:
            self._tensor(saved["tensor"], live, where, setter, materialize)
        elif is_plain(saved):
            if _stateful.kind_of(live) is not None and not isinstance(live, MutableMapping):
                # a state dict without tensors (a scheduler's, an optimizer's before its first
                # step) saved as a value loads into the live object like any raw state dict
                self._raw_state(saved, live, where, setter)
            elif holds_tensors(live):
                self.plan.problems.append(
                    f"{self._name(where)}: the checkpoint holds a plain value, the state holds {type(live).__name__}"
                )
            else:
                self._plain(self.build(saved, where), live, where, setter)
        elif "stateful" in saved:
            self._stateful(saved, live, where, setter)
        elif "dict" in saved:
            self._dict(saved, live, where, setter, materialize)
        else:
            items: list[Node] = saved["list"] if "list" in saved else saved["tuple"]
            if isinstance(live, (list, tuple)) and len(live) == len(items):
                # a tuple is rebuilt from a list copy once its items are back, then set in its parent
                seq = live if isinstance(live, list) else list(live)
                for i, child in enumerate(items):
                    self.restore(child, seq[i], join(where, i), bind(seq.__setitem__, i), materialize=materialize)
                if isinstance(live, tuple) and setter is not None:
                    self.plan.setters.append(lambda: setter(type(live)(seq)))
                elif isinstance(live, tuple) and any(is_plain(c) for c in items):
                    self._set(None, None, where)  # a root tuple cannot take plain values back
            elif (
                materialize
                or live is None
                or (isinstance(live, list) and not live and where and "list" in saved and not self.partial)
            ):
                # an empty list (losses kept as tensors, grown by training) takes the saved one
                if live is not None and not materialize and self._objects_for_nothing(saved, where):
                    return
                self._set(setter, self.build(saved, where))
            else:
                n = len(live) if isinstance(live, (list, tuple)) else None
                self.plan.problems.append(
                    f"{self._name(where)}: the checkpoint holds a sequence of {len(items)} items, the state "
                    f"holds {type(live).__name__}" + (f" of {n} items" if n is not None else "")
                )

    def _plain(self, value: Any, live: Any, where: str, setter: Setter) -> None:
        if isinstance(value, dict) and isinstance(live, MutableMapping) and type(live) is not dict:
            # a defaultdict or Counter keeps its type and default: a dict in its place broke the
            # training's next `counts[new] += 1`
            typed = _typed_like(live, value)  # its values' Counters and defaultdicts too
            self.plan.setters.append(lambda: refill(live, typed))
        else:
            self._set(setter, _typed_like(live, value), where)

    def _tensor(self, key: str, live: Any, where: str, setter: Setter, materialize: bool) -> None:
        entry = self._entry(key)
        if torch.nn.parameter.is_lazy(live):  # a lazy module not run yet: its load_state_dict takes the shape
            live = None
        elif where in self._resized and isinstance(live, torch.Tensor) and live.numel() <= 1:
            # an observer's range or scale not sized yet (its first forward): its own load sizes it
            live = None if entry.dtype == dtype_name(live.dtype) else live
        if isinstance(live, torch.Tensor):
            if (problem := template_problem(live)) is not None:
                self.plan.problems.append(f"{self._name(key)}: the state's tensor is {problem}")
                return
            if mismatch(entry, live):
                if tuple(entry.shape) == tuple(live.shape):
                    self.plan.casts.add((entry.dtype, dtype_name(live.dtype)))
                self.plan.problems.append(
                    f"{self._name(key)}: the checkpoint holds {entry.dtype}{list(entry.shape)}, "
                    f"the state holds {dtype_name(live.dtype)}{list(live.shape)}"
                )
                return
            self.plan.reads.append(Read.into(self.m.resolve(key).key, live))
        elif materialize or live is None:
            self._set(setter, self._materialize(key))
        else:
            self.plan.problems.append(
                f"{self._name(key)}: the checkpoint holds a tensor, the state holds {type(live).__name__}"
            )

    def _dict(self, saved: Node, live: Any, where: str, setter: Setter, materialize: bool) -> None:
        if _stateful.kind_of(live) is not None and not isinstance(live, MutableMapping):
            # a raw state dict (e.g. imported from torch.save) loads into the live object
            self._raw_state(saved, live, where, setter)
            return
        if not isinstance(live, MutableMapping):
            if materialize or live is None:
                self._set(setter, self.build(saved, where))
                return
            self.plan.problems.append(
                f"{self._name(where)}: the checkpoint holds a dict, the state holds {type(live).__name__}"
            )
            return
        # an empty dict in the state ({epoch: tensor}, grown by training) takes the saved one
        grown = not materialize and not live and bool(where) and type(live) is dict and not self.partial
        if grown and self._objects_for_nothing(saved, where):
            return  # left empty (built beside the objects, a pickled value would mask the mismatch)
        materialize = materialize or grown
        seen = set()
        for k, child in saved["dict"]:
            seen.add(k)
            cw = join(where, k)
            if k in live:
                self.restore(child, live[k], cw, bind(live.__setitem__, k), materialize=materialize)
            elif self.partial and not materialize:
                continue
            elif materialize or is_plain(child):
                self._set(bind(live.__setitem__, k), self.build(child, cw))
            else:
                keys = tensor_keys(child)
                self.plan.unexpected.append(cw)
                self.plan.problems.append(
                    f"unexpected key {self._name(cw)}: in the checkpoint, not in the state"
                    + (f" ({len(keys)} tensor(s))" if len(keys) > 1 else "")
                )
        for k in live:
            if k not in seen and self._saved_by_another_rank(join(where, k), live[k]):
                # ranks that held different parts (pipeline stages), loaded by fewer: from the catalog
                self._tensor(join(where, k), live[k], join(where, k), bind(live.__setitem__, k), materialize)
            elif k not in seen:  # plain values too: a silently kept value (a step counter) is a wrong resume
                self.plan.missing.append(join(where, k))
                self.plan.problems.append(
                    f"missing key {self._name(join(where, k))}: in the state, not in the checkpoint"
                )
        if not self.partial or any(k not in seen for k in live):  # (partial: only where a key is missing)
            self._keys_of_another_type([k for k in seen if k not in live], [k for k in live if k not in seen], where)

    def _saved_by_another_rank(self, key: str, live: Any) -> bool:
        """Whether ``key``, which this rank's saved tree lacks, is a tensor another saving rank
        stored (the catalog holds every rank's tensors, the tree one rank's structure): not one
        of this rank's own under another spelling (an int key saved, a str key live, whose
        paths print alike)."""
        if not (isinstance(live, torch.Tensor) and key in self.m.tensors):
            return False
        if self._own is None:
            self._own = frozenset(tensor_keys(self.tree))
        return key not in self._own

    def _objects_for_nothing(self, saved: Node, where: str) -> bool:
        """Whether the saved container, which an empty one in the state would take, holds
        objects' states (a model's, an optimizer's, a registered object's): built as plain
        dicts they would stand for no object, and the objects missing from the state would
        go unnoticed. A problem says so."""
        n = objects_in(saved)
        if n:
            self.plan.problems.append(
                f"{self._name(where)}: the checkpoint holds {n} object(s) with load_state_dict here (a model, an "
                "optimizer, a registered object), the state an empty container: put the objects in it, as they "
                "were when saved, before loading"
            )
        return n > 0

    def _keys_of_another_type(self, saved: list[Any], live: list[Any], where: str) -> None:
        """Keys that print alike on both sides (0 and "0") read as one key both missing and
        unexpected: say which type each side has."""
        alike = sorted({str(k) for k in saved} & {str(k) for k in live})
        if not alike:
            return
        kind_saved = type(next(k for k in saved if str(k) == alike[0])).__name__
        kind_live = type(next(k for k in live if str(k) == alike[0])).__name__
        self.plan.problems.append(
            f"{self._name(where)}: {len(alike)} key(s) ({', '.join(alike[:3])}) are of type {kind_saved} in the "
            f"checkpoint and {kind_live} in the state; build the state's dict with {kind_saved} keys, as it was saved"
        )

    def _raw_state(self, saved: Node, live: Any, where: str, setter: Setter) -> None:
        """A state dict saved as such (a dict, not the object) into the live stateful ``live``."""
        kind = _stateful.kind_of(live)
        wrapped: Node = {"stateful": kind, "state": saved, "raw": True}
        if kind == "optimizer":  # torch's own state dict numbers the parameters; DCP's names them
            wrapped["keyed_by"] = "name" if names_params(saved) else "index"
        self._stateful(wrapped, live, where, setter)

    def _stateful(self, saved: Node, live: Any, where: str, setter: Setter) -> None:
        kind = _stateful.kind_of(live)
        if kind is None:
            if isinstance(live, MutableMapping) or live is None:  # a placeholder: rebuild the raw state
                self._dict(saved["state"], live, where, setter, materialize=True)
            else:
                self.plan.problems.append(
                    f"{self._name(where)}: the checkpoint holds a {saved['stateful']} state, "
                    f"the state holds {type(live).__name__} (which has no load_state_dict)"
                )
            return
        if kind == "optimizer" or saved["stateful"] == "optimizer":
            if kind != saved["stateful"]:
                self.plan.problems.append(
                    f"{self._name(where)}: the checkpoint holds a {saved['stateful']} state, "
                    f"the state holds {type(live).__name__}"
                )
                return
            problem = _stateful.optimizer_class_problem(saved.get("class"), live)
            if problem is not None:
                self.plan.problems.append(f"{self._name(where)}: {problem}")
                return
            self._optimizer(saved, live, where)
            return
        if kind == "object":
            self._object(saved, live, where)
            return
        live = _stateful.unwrap(live)
        sd = live.state_dict()
        keys = _stateful.module_keys(sd) or {}  # the live keys as they are saved, and back
        if resized := _stateful.resized_on_load(live):
            saved_as = {k: s for s, k in keys.items()}
            self._resized |= {join(where, saved_as.get(k, k)) for k in resized}
        box = [{saved_key: sd[k] for saved_key, k in keys.items()} if keys else sd]
        state = without_inner_wrappers(saved["state"])
        self.restore(state, box[0], where, bind(box.__setitem__, 0), materialize=False)
        self.plan.finalizers.append(
            (where, lambda: live.load_state_dict({keys.get(k, k): v for k, v in box[0].items()}, strict=False))
        )

    def _object(self, saved: Node, live: Any, where: str) -> None:
        """A stateful object gets back only a state of the structure its own ``state_dict()``
        has (same keys, lengths and kinds of values), checked before anything is changed; its
        tensors are read into the live state's tensors where they match."""
        # a data loader's position is kept per rank, its small tensors as plain values (saved
        # before that, with tensors alone: loaded as any object's state)
        loader = perrank.is_loader(live) and (perrank.encoded(saved["state"]) or not tensor_keys(saved["state"]))
        own_sd = live.state_dict()
        live_sd = perrank.as_plain(own_sd) if loader else own_sd
        built = self.build(saved["state"], where, like=live_sd)
        check = getattr(live, "_stashpoint_check", None)  # stashpoint's own objects check themselves
        if built is None and live_sd is not None:  # None matches anything inside a state, not as all of it
            problem: str | None = "the checkpoint holds None for its whole state"
        else:
            problem = (
                check(built)
                if callable(check)
                else structure_problem(built, live_sd, per_group=trial.is_torch_scheduler(live))
            )
        if problem is not None:
            self.plan.problems.append(
                f"{self._name(where)}: the saved state does not fit this {shown(live)}: {problem} "
                "(with strict=False it is not loaded: it keeps the state it was built with"
                + (", its schedule starting over)" if trial.is_torch_scheduler(live) else ")")
            )
            return
        if loader:
            try:
                built = perrank.as_tensors(built)
            except ValueError as e:
                self.plan.problems.append(f"{self._name(where)}: a data loader's saved position is malformed: {e}")
                return
        if isinstance(live, torch.amp.GradScaler):
            # saved with its scale and growth tracker as tensors (read by then): back to the
            # numbers torch's state_dict() gives, which load_state_dict keeps as _init_scale
            self.plan.finalizers.append((where, lambda: live.load_state_dict(scaler_load_state(built))))
            return
        built = _typed_like(own_sd, built)  # a Counter, a torch.Size where its own state holds one
        self.plan.finalizers.append((where, lambda: live.load_state_dict(built)))
        if trial.is_torch_scheduler(live):
            self.plan.checks.append((where, lambda: trial.scheduler(live, built)))


def _typed_like(live: Any, value: Any) -> Any:
    """``value`` (a plain value, or an object's built state), its tuples a ``torch.Size`` and its
    dicts a ``Counter``, ``OrderedDict`` or ``defaultdict`` (with the live one's default) where the
    live value holds one there, in dicts and lists too: a Counter is what a MultiStepLR's closed
    form needs, a plain dict in a defaultdict's place fails the next ``counts[new] += 1``. Other
    tuple subclasses are left as they are: a named tuple built from one list would take it whole
    as its first field. A ``defaultdict(Counter)``'s keys it does not hold yet are Counters too."""
    if isinstance(value, dict) and isinstance(live, Mapping):
        factory = getattr(live, "default_factory", None)
        # only a class that cannot count or log calls: a factory such as count().__next__ would advance
        model = factory() if factory in (collections.Counter, collections.OrderedDict) else None
        out = {k: _typed_like(live.get(k, model), v) for k, v in value.items()} if live or model is not None else value
        if type(live) is collections.defaultdict:
            return collections.defaultdict(live.default_factory, out)
        if type(live) is collections.OrderedDict:
            return collections.OrderedDict(out)
        return collections.Counter(out) if type(live) is collections.Counter else out
    if not isinstance(value, (list, tuple)) or not isinstance(live, (list, tuple)):
        return value
    items = [_typed_like(x, v) for x, v in zip(live, value)] if len(live) == len(value) else list(value)
    if type(value) is tuple and isinstance(live, torch.Size):
        return torch.Size(items) if all(type(x) is int for x in items) else tuple(items)
    if type(value) is list:
        return items
    return tuple(items) if type(value) is tuple else value  # a named tuple (a pickled value) as it was
