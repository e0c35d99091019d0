"""Planning an optimizer's load: its saved state (keyed by parameter name, or by index as
torch's own state dict numbers them) matched against the live optimizer, its missing state
tensors made like their parameters (DTensors read only this rank's slice), and the
``load_state_dict`` call to make once every tensor is read. A part of ``restore.Planner``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from stashpoint._core.nodes import Node
from stashpoint._load import trial
from stashpoint._state import stateful as _stateful
from stashpoint._state.dtypes import torch_dtype
from stashpoint._state.validate import named_optimizer_problem, optimizer_problem, regroup_problem
from stashpoint.errors import CheckpointError, CorruptCheckpointError

if TYPE_CHECKING:
    from stashpoint._core.format import TensorEntry
    from stashpoint._load.restoreplan import RestorePlan


class OptimizerPlanning:
    """The optimizer's part of the planner: it uses the planner's plan, tree walk and names."""

    plan: RestorePlan
    root: Any
    where: str
    partial: bool
    _saved_class: str | None = None  # the class the optimizer being planned was saved from, where another

    def _name(self, key: str) -> str:
        raise NotImplementedError

    def _entry(self, key: str) -> TensorEntry:
        raise NotImplementedError

    def build(self, node: Node, where: str, like: Any = None) -> Any:
        raise NotImplementedError

    def _saved_group_tensors(self, state: Node) -> list[dict[str, str]]:
        """Each saved param group's tensors by the catalog entry holding their bytes: groups
        that shared one tensor when saved name the same entry (the others' are aliases of it)."""
        fields = dict(state.get("dict", ())) if isinstance(state, dict) else {}
        groups = fields.get("param_groups")
        if not (isinstance(groups, dict) and isinstance(groups.get("list"), list)):
            return []
        out = []
        for group in groups["list"]:
            held = {}
            for pair in group.get("dict", ()) if isinstance(group, dict) else ():
                k, v = pair
                if isinstance(v, dict) and isinstance(v.get("tensor"), str):
                    entry = self._entry(v["tensor"])
                    held[k] = entry.alias_of or entry.key
            out.append(held)
        return out

    def _optimizer(self, saved: Node, optim: torch.optim.Optimizer, where: str) -> None:
        n_before = len(self.plan.problems)
        cls = saved.get("class")
        # torch's own classes are told apart beforehand; another's state is judged by its fit
        self._saved_class = cls if _stateful.saved_from_other_class(cls, optim) else None
        by_name = saved.get("keyed_by") == "name"
        modules = _stateful.find_modules(self.root)
        names = _stateful.names_as_saved(modules, saved_param_names(saved["state"]) or ()) if by_name else {}
        # the optimizer's current state (same keying) lends its tensors: loaded in place
        live = _stateful.optimizer_to_tree(optim, names)[1] if by_name else optim.state_dict()
        params = _optimizer_params(optim, names, by_name)
        live = {**live, "state": self._state_like_params(saved["state"], live.get("state", {}), params)}
        live["param_groups"] = _unshared(live.get("param_groups"), self._saved_group_tensors(saved["state"]))
        built = self.build(saved["state"], where, like=live)
        if not (isinstance(built, dict) and isinstance(built.get("param_groups"), list)):
            raise CorruptCheckpointError(f"the optimizer state at {self._name(where)} in {self.where} is malformed")
        if not by_name:
            self._optimizer_finalizer(built, optim, where)
            return
        current = _stateful.optimizer_current_names(optim, names)
        if any(n is None for n in current) and saved.get("raw"):  # as torch pairs them: by position
            self._optimizer_finalizer(built, optim, where)
            return
        if any(n is None for n in current):
            self.plan.problems.append(
                f"{self._name(where)}: the checkpoint keys this optimizer's state by parameter name, but some "
                "of its parameters belong to no module in the state; put the model in the state too (or, if it "
                "is there, build the optimizer after wrapping the model: fully_shard and the like replace its "
                "parameters, and an optimizer built before holds the old ones)"
            )
            return
        malformed = named_optimizer_problem(built)
        if malformed is not None:
            self.plan.problems.append(f"{self._name(where)}: the saved optimizer state is malformed: {malformed}")
            return
        if self.partial:  # parameters the optimizer no longer holds (frozen since) are skipped, as keys are
            held = set(current)
            kept = [g for g in built["param_groups"] if not g["params"] or held & set(g["params"])]
            if len(kept) == len(optim.param_groups):  # a group all of whose parameters went, too
                built = {**built, "param_groups": kept}  # (kept where an empty group stands in its place)
        saved_names = [n for g in built["param_groups"] for n in g["params"]]
        for n in sorted(set() if self.partial else set(saved_names) - set(current), key=str):
            self.plan.problems.append(
                f"unexpected optimizer parameter {n!r} at {self._name(where)}: not in the optimizer"
            )
        for n in sorted(set(current) - set(saved_names), key=str):
            self.plan.problems.append(
                f"missing optimizer parameter {n!r} at {self._name(where)}: not in the checkpoint"
            )
        regroup = len(built["param_groups"]) != len(optim.param_groups)
        if regroup:  # no pairing of groups to trust: a fine-tune's new groups keep their learning rates
            self.plan.problems.append(
                f"{self._name(where)}: the checkpoint has {len(built['param_groups'])} parameter group(s), "
                f"the optimizer {len(optim.param_groups)}"
            )
        elif (
            regrouped := regroup_problem(
                built["param_groups"],
                [{**g, "params": [names[id(p)] for p in g["params"]]} for g in optim.param_groups],
                set(optim.defaults),
            )
        ) is not None:
            self.plan.problems.append(f"{self._name(where)}: {regrouped}")
        # LBFGS keeps its whole state (flat directions, a history) under its first parameter
        shaped = not isinstance(optim, torch.optim.LBFGS)
        for n, state in list(built.get("state", {}).items()):
            odd = _misshapen(state, params.get(n)) if shaped else None
            if odd is not None:  # a resized parameter: its old moments would fail the first step
                del built["state"][n]
                self.plan.problems.append(f"optimizer parameter {n!r} at {self._name(where)}: {odd}")
        # Loaded for the parameters both have: a problem above fails a strict load anyway, and
        # strict=False loads what matches (the others start fresh), as it does for tensors.
        if len(self.plan.problems) != n_before:  # what strict=False does, said once: not a problem of its own
            self.plan.problems[-1] += (
                f" (with strict=False the state of {self._name(where)} is loaded for the parameters the checkpoint "
                "and the optimizer share; the others start fresh"
                + ("; its groups keep their own hyperparameters: lr, weight decay, ...)" if regroup else ")")
            )
        self._optimizer_finalizer(_stateful.optimizer_from_named(built, optim, names, regroup), optim, where)

    def _optimizer_finalizer(self, sd: dict[str, Any], optim: torch.optim.Optimizer, where: str) -> None:
        problem = optimizer_problem(sd, optim, other_class=self._saved_class is not None)
        if problem is not None and self._saved_class is not None:
            problem += (
                f" (the checkpoint holds the state of an optimizer of class {self._saved_class}, the state holds one "
                f"of class {_stateful.class_name(optim)}: load it into the optimizer class it was saved from)"
            )
        if problem is not None:
            self.plan.problems.append(f"{self._name(where)}: the saved optimizer state does not fit: {problem}")
        else:
            plain, strings = strings_apart(sd)
            if strings and not _torch_loads(optim, hooks_after=True):
                (pid, key), _ = next(iter(strings.items()))
                self.plan.problems.append(
                    f"{self._name(where)}: the saved state {key!r} of parameter {pid} holds a string, which torch's "
                    f"load_state_dict (called by the {_stateful.class_name(optim)}'s own, or with load hooks) turns "
                    "into a generator's name; keep it as a number or a flag, or load with strict=False to skip this "
                    "optimizer's state (a fresh optimizer then starts afresh)"
                )
                return
            if not _torch_loads(optim):  # anyone else is handed the dict as it was (they may pickle it)
                self.plan.finalizers.append((where, lambda: optim.load_state_dict(sd)))
                self.plan.checks.append((where, lambda: trial.optimizer(optim, sd)))
                return
            sd = _members_as_sets(plain)
            self.plan.finalizers.append((where, lambda: _load_with_strings(optim, sd, strings)))
            self.plan.checks.append((where, lambda: trial.optimizer(optim, sd)))

    def _state_like_params(
        self, saved: Node, live: Mapping[Any, Any], params: Mapping[Any, torch.Tensor]
    ) -> dict[Any, Any]:
        """The live optimizer's per-parameter state, completed with empty tensors made like their
        parameter for every saved tensor the live optimizer lacks (a fresh optimizer has none).

        A state tensor of its parameter's (global) shape is created like the parameter: a DTensor
        on its mesh with its placements when it is one, on its device, in the saved dtype. Reading
        into it then reads only this rank's slice. Other state (Adam's scalar ``step``) is left to
        be built from the checkpoint as saved.
        """
        out: dict[Any, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in live.items()}
        state = dict(saved.get("dict", ())).get("state") if isinstance(saved, dict) else None
        for pkey, pnode in (state or {}).get("dict", ()):
            param = params.get(pkey)
            if param is None or not isinstance(pnode, dict) or "dict" not in pnode:
                continue
            slot = out.setdefault(pkey, {})
            if not isinstance(slot, dict):
                continue
            for skey, snode in pnode["dict"]:
                if not (isinstance(snode, dict) and "tensor" in snode) or isinstance(slot.get(skey), torch.Tensor):
                    continue
                entry = self._entry(snode["tensor"])
                if tuple(entry.shape) == tuple(param.shape) and len(entry.shape) > 0:
                    slot[skey] = _state_like(param, torch_dtype(entry.dtype, entry.key), entry.key)
        return out


class _Members(list):  # type: ignore[type-arg]
    """A group's ``params`` whose membership test is a set's: torch's ``load_state_dict`` asks
    ``index in group["params"]`` for every state tensor, quadratic in a group's size (1.4 s at
    10k parameters with Adam, minutes at 100k). Torch copies the groups and keeps its own
    parameters' lists, so this list never outlives the load."""

    def __contains__(self, item: object) -> bool:
        members = self.__dict__.get("_set")
        if members is None:
            try:
                members = self.__dict__["_set"] = frozenset(self)
            except TypeError:  # something unhashable in a group: a list's test then
                return list.__contains__(self, item)
        try:
            return item in members
        except TypeError:
            return list.__contains__(self, item)


def _torch_loads(optim: Any, *, hooks_after: bool = False) -> bool:
    """Whether ``optim.load_state_dict`` is torch's own, or a wrapper's (Accelerate's) handing
    the dict to torch's own in its ``optimizer``, with no pre-hook that would see the dict (nor,
    with ``hooks_after``, a post-hook that would see the state before the load's last touch)."""
    inner = _torch_optimizer(optim)
    if inner is None:
        return False
    hooks = ("_optimizer_load_state_dict_pre_hooks",) + (
        ("_optimizer_load_state_dict_post_hooks",) if hooks_after else ()
    )
    return not any(getattr(o, h, None) for o in (optim, inner) for h in hooks)


def _torch_optimizer(optim: Any) -> torch.optim.Optimizer | None:
    """The optimizer whose own ``load_state_dict`` is torch's: ``optim``, or the one a wrapper
    (Accelerate's) hands the dict to in its ``optimizer``; None where neither is."""
    own = torch.optim.Optimizer.load_state_dict
    inner = optim if type(optim).load_state_dict is own else getattr(optim, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) and type(inner).load_state_dict is own else None


def strings_apart(sd: dict[str, Any]) -> tuple[dict[str, Any], dict[tuple[Any, str], Any]]:
    """``sd`` without the per-parameter state values that are strings or lists of plain values
    holding one (a copy where any is taken; ``sd`` as it was), and those values by (parameter
    id, key). Torch's ``load_state_dict`` rebuilds every iterable value by its type, a string
    from a generator: ``"warm"`` would come back as ``"<generator object ...>"``."""
    state = sd.get("state")
    if not isinstance(state, Mapping):
        return sd, {}
    apart = {(p, k): v for p, entry in state.items() for k, v in entry.items() if _stringy(v)}
    if not apart:
        return sd, {}
    kept = {p: {k: v for k, v in entry.items() if (p, k) not in apart} for p, entry in state.items()}
    return {**sd, "state": kept}, apart


def _stringy(v: Any) -> bool:
    """A string, or a list or tuple of plain values holding one (no tensor: torch moves those)."""
    if isinstance(v, (list, tuple)):
        return any(isinstance(x, str) for x in v) and not any(isinstance(x, torch.Tensor) for x in v)
    return isinstance(v, str)


def _load_with_strings(optim: Any, sd: dict[str, Any], strings: Mapping[tuple[Any, str], Any]) -> None:
    """``optim.load_state_dict(sd)``, then the strings set apart put in the state of the
    parameters torch paired their ids with: by position in the groups, as torch pairs them."""
    optim.load_state_dict(sd)
    if not strings:
        return
    inner = _torch_optimizer(optim) or optim  # (always torch's: planned only where _torch_loads)
    saved_ids = [p for g in sd["param_groups"] for p in g["params"]]
    params = dict(zip(saved_ids, (p for g in inner.param_groups for p in g["params"])))
    for (pid, key), value in strings.items():  # each built anew from the checkpoint: no copy needed
        inner.state[params[pid]][key] = value


def _members_as_sets(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` with each group's ``params`` a ``_Members`` (a shallow copy; ``sd`` as it was)."""
    groups = sd.get("param_groups")
    if not isinstance(groups, list):
        return sd
    fast = [
        {**g, "params": _Members(g["params"])} if isinstance(g, dict) and isinstance(g.get("params"), list) else g
        for g in groups
    ]
    return {**sd, "param_groups": fast}


def _unshared(groups: Any, saved: list[dict[str, str]]) -> Any:
    """The live groups, a hyperparameter tensor that several hold (a tensor lr given as the
    optimizer's default is one object in every group) copied where the checkpoint holds apart
    what they share (``saved``: each saved group's tensors, by the catalog entry holding their
    bytes), and shared where it holds one tensor for them. Read in place, groups saved apart
    would all get the last one's value; groups saved as one must stay one (a scheduler's
    in-place update of one group's lr is every group's, and a resume must go on so)."""
    if not isinstance(groups, list):
        return groups
    by_entry: dict[int, dict[str, torch.Tensor]] = {}  # per live tensor: its copy per saved entry
    out = []
    for gi, group in enumerate(groups):
        if not isinstance(group, dict):
            out.append(group)
            continue
        own = {}
        for k, v in group.items():
            if not isinstance(v, torch.Tensor):
                own[k] = v
                continue
            held = (saved[gi].get(k) if gi < len(saved) else None) or f"#{gi}"  # (none: its own)
            copies = by_entry.setdefault(id(v), {})
            if held not in copies:  # the first holder keeps the live tensor, the others a copy each
                copies[held] = v if not copies else v.clone()
            own[k] = copies[held]
        out.append(own)
    return out


def _state_like(param: torch.Tensor, dtype: torch.dtype, key: str) -> torch.Tensor:
    """A fresh optimizer's state tensor for ``param``, to load ``key`` into; out of memory (a
    GPU full) is a CheckpointError naming the key and the bytes."""
    try:
        with torch.no_grad():
            return torch.empty_like(param, dtype=dtype)
    except (RuntimeError, MemoryError) as e:
        if not isinstance(e, (torch.OutOfMemoryError, MemoryError)) and "memory" not in str(e).lower():
            raise
        raise CheckpointError(
            f"cannot allocate {param.numel() * dtype.itemsize:,} bytes on {param.device} for the optimizer state "
            f"{key!r} (a fresh optimizer's state is made to load into): {str(e)[:200]}"
        ) from None


def names_params(saved: Node) -> bool:
    """Whether a raw optimizer state dict names its parameters (``get_state_dict``'s, DCP's):
    every group's ``params`` a list of strings, one at least."""
    names = saved_param_names(saved)
    return bool(names) and all(isinstance(n, str) for n in names or ())


def saved_param_names(saved: Node) -> list[object] | None:
    """The values of every group's ``params`` in a saved optimizer state dict's node (None where
    it has no groups of that form)."""
    fields = dict(saved.get("dict", ())) if isinstance(saved, dict) else {}
    groups = fields.get("param_groups")
    if not (isinstance(groups, dict) and isinstance(groups.get("list"), list)):
        return None
    names: list[object] = []
    for group in groups["list"]:
        params = dict(group.get("dict", ())).get("params") if isinstance(group, dict) else None
        if not (isinstance(params, dict) and isinstance(params.get("list"), list)):
            return None
        names += [p.get("value") if isinstance(p, dict) else None for p in params["list"]]
    return names


def _optimizer_params(optim: torch.optim.Optimizer, names: Mapping[int, str], by_name: bool) -> dict[Any, torch.Tensor]:
    """The optimizer's parameters by the key its saved state uses: name, or index in its order."""
    params = [p for group in optim.param_groups for p in group["params"]]
    if by_name:
        return {names[id(p)]: p for p in params if id(p) in names}
    return dict(enumerate(params))


def _misshapen(state: Any, param: torch.Tensor | None) -> str | None:
    """Why a parameter's saved state does not fit it, or None: a state tensor (not a scalar) of
    another shape than the parameter's (moments saved for a resized parameter), unless the
    tensors of other shapes are factors of it, each collapsing one of its dimensions, that
    together factor two: torch's Adafactor keeps ``[n, 1]`` and ``[1, m]`` of an ``[n, m]``
    weight (of a ``[1, m]`` weight, ``[1, 1]`` and the weight's own shape), transformers'
    ``[n]`` and ``[m]``."""
    if param is None or not isinstance(state, Mapping):
        return None
    shape = tuple(param.shape)
    shapes = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    odd = {k: s for k, s in shapes.items() if s != shape}
    if not odd:
        return None
    collapsed = [_collapsed(s, shape) for s in odd.values()]
    # a factor of the weight's own shape collapses a dimension of one: it counts as one
    ones = {d for d, n in enumerate(shape) if n == 1} if shape in shapes.values() else set()
    if all(c is not None for c in collapsed):
        dims = set().union(*(c for c in collapsed if c is not None)) | ones
        if len(dims) >= 2 and (len(odd) > 1 or ones):
            return None
    key, s = next(iter(odd.items()))
    return f"the checkpoint's {key!r} is {list(s)}, the parameter {list(shape)}"


def _collapsed(s: tuple[int, ...], shape: tuple[int, ...]) -> set[int] | None:
    """The dimension of ``shape`` a factor of shape ``s`` collapses: ``s`` is ``shape`` with one
    size set to 1, or with one dimension left out (which one may be ambiguous: a square
    weight's row and column factors, any). None: no such factor."""
    if len(s) == len(shape):
        differ = [d for d, (a, b) in enumerate(zip(s, shape)) if a != b]
        return set(differ) if len(differ) == 1 and s[differ[0]] == 1 else None
    left_out = {i for i in range(len(shape) if len(s) == len(shape) - 1 else 0) if s == shape[:i] + shape[i + 1 :]}
    return left_out or None
