"""Checks that a saved state has the structure its live object produces, before any of it is
handed to the object's ``load_state_dict``: what a file says is never trusted to fit."""

from __future__ import annotations

import numbers
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

_MAX_PROBLEM = 200


def _kind(v: Any) -> str:
    if v is None:
        return "None"
    if isinstance(v, torch.Tensor):
        return "tensor"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, numbers.Real):
        return "number"
    if isinstance(v, (str, bytes)):
        return type(v).__name__
    if isinstance(v, Mapping):
        return "dict"
    if isinstance(v, (list, tuple)):
        return "sequence"
    return type(v).__qualname__


def _scalars(seq: Sequence[Any]) -> bool:
    return all(x is None or _kind(x) == "number" or (_kind(x) == "tensor" and x.dim() == 0) for x in seq)


def structure_problem(saved: Any, live: Any, where: str = "", *, per_group: bool = False) -> str | None:
    """Why ``saved`` cannot stand in for ``live`` (None when it can): the same keys, the same
    sequence lengths, and leaves of the same kind (numbers for numbers, tensors of the same dtype
    and shape for tensors); None on either side matches anything (a value not set yet), and an
    empty dict or list on the object's side any dict or list (a fresh object's history, its
    best scores so far: what grows as it runs). ``per_group``: lists of numbers on both sides
    may differ in length (an LR scheduler's values per parameter group, of which a run may add
    some after the scheduler was built, as torch's own load takes them)."""
    stack = [(saved, live, where)]
    while stack:
        s, v, at = stack.pop()
        if s is None or v is None:
            continue
        ks, kv = _kind(s), _kind(v)
        if {ks, kv} <= {"number", "tensor"} and (ks == "number" or s.dim() == 0) and (kv == "number" or v.dim() == 0):
            continue  # a scalar saved as a number or a 0-d tensor (lr, step)
        here = at or "the root"
        if ks != kv:
            return f"{here} holds a {ks} where the object has a {kv}"
        if ks in ("dict", "sequence") and len(v) == 0:
            continue
        if ks == "dict":
            if set(s) != set(v):
                extra, missing = sorted(map(str, set(s) - set(v))), sorted(map(str, set(v) - set(s)))
                text = f"{here}: the keys differ (only saved: {extra[:5]}, only the object's: {missing[:5]})"
                return text[:_MAX_PROBLEM]
            stack.extend((s[k], v[k], f"{at}/{k}") for k in v)
        elif ks == "sequence":
            if per_group and _scalars(s) and _scalars(v):
                continue
            if len(s) != len(v):
                return f"{here} holds {len(s)} items where the object has {len(v)}"
            stack.extend((x, y, f"{at}/{i}") for i, (x, y) in enumerate(zip(s, v)))
        elif ks == "tensor" and (s.dtype != v.dtype or s.shape != v.shape):
            return f"{here} is a {s.dtype}{list(s.shape)} tensor where the object has {v.dtype}{list(v.shape)}"
    return None


def named_optimizer_problem(sd: Mapping[str, Any]) -> str | None:
    """Why a parameter-name-keyed optimizer state dict is malformed (None if it is not)."""
    for i, g in enumerate(sd["param_groups"]):
        if not isinstance(g, Mapping) or not isinstance(g.get("params"), list):
            return f"parameter group {i} is not a dict with a list of params"
        if not all(isinstance(n, str) for n in g["params"]) or len(set(g["params"])) != len(g["params"]):
            return f"parameter group {i} does not name its parameters once each"
    state = sd.get("state", {})
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        return "the optimizer's per-parameter state is not a dict keyed by parameter names"
    return None


_NOT_HYPER = ("params", "param_names", "initial_lr")  # initial_lr: an LR scheduler's, set at its start


def _hyper(group: Mapping[str, Any], keys: Collection[str] | None) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPER and (keys is None or k in keys)}


def _same(a: Any, b: Any) -> bool:
    """Two hyperparameter values alike. Tensors never are: a saved one is read after planning
    (what the plan holds is the live tensor, or memory not yet read)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return False


def regroup_problem(
    saved: Sequence[Mapping[str, Any]], current: Sequence[Mapping[str, Any]], keys: Collection[str] | None = None
) -> str | None:
    """Why a name-keyed optimizer state with the parameter groups ``saved`` (their ``params``
    parameter names) cannot take the groups ``current`` (as many, named alike) without a guess:
    a group holding parameters of saved groups whose hyperparameters differ, groups of differing
    hyperparameters sharing one saved group, or saved groups of differing hyperparameters in
    another order. Each group takes its hyperparameters (lr, weight decay) from a saved group,
    and an LR scheduler keeps its per-group state by position; groups alike in every
    hyperparameter may be formed anew. Empty groups and parameters only one side has are left
    out (reported elsewhere). ``keys``: the hyperparameters compared (the optimizer's defaults;
    None: every key but the parameters, e.g. not a user's label). Pure."""

    def _alike(groups: Sequence[Mapping[str, Any]]) -> bool:
        first = _hyper(groups[0], keys)
        return all(_same(first, _hyper(g, keys)) for g in groups[1:])

    fix = "form the groups as they were saved, or load with strict=False and set the hyperparameters after"
    group_of = {n: gi for gi, g in enumerate(saved) for n in g["params"]}
    taken: dict[int, int] = {}
    for gi, g in enumerate(current):
        came = sorted({group_of[n] for n in g["params"] if n in group_of})
        if len(came) > 1 and not _alike([saved[i] for i in came]):
            return (
                f"parameter group {gi} holds parameters of saved groups {came[0]} and {came[1]}, whose "
                f"hyperparameters differ: which apply would be a guess; {fix}"
            )
        if not came:
            continue
        if came[0] in taken and not _alike([current[taken[came[0]]], g]):
            return (
                f"parameter groups {taken[came[0]]} and {gi} both hold parameters of saved group {came[0]}, and "
                f"their hyperparameters differ: both would take that group's; {fix}"
            )
        taken.setdefault(came[0], gi)
    moved = sorted((gi, si) for si, gi in taken.items() if si != gi and not _alike([saved[si], saved[gi]]))
    if moved:
        gi, si = moved[0]
        return (
            f"parameter group {gi} holds the parameters of saved group {si}, whose hyperparameters differ from "
            f"saved group {gi}'s (the groups are in another order): an LR scheduler keeps its per-group state by "
            f"position; {fix}"
        )
    return None


def lacking_hyperparameters(
    saved: Mapping[str, Any], live: Mapping[str, Any], optim: torch.optim.Optimizer
) -> list[str]:
    """The hyperparameters ``optim``'s group ``live`` holds that the saved group ``saved`` lacks once the
    optimizer's class has filled in its own (torch's load fills a key added by a later torch
    through ``__setstate__``): a group loaded replaces the optimizer's, and one it lacks fails
    the first step. Judged on a throwaway instance; [] where that cannot be made."""
    try:
        shell = object.__new__(type(optim))
        group = {**saved, "params": []}
        type(optim).__setstate__(shell, {"defaults": dict(optim.defaults), "state": {}, "param_groups": [group]})
        filled = set(shell.param_groups[0])
    except Exception:  # a class whose fill-in needs more: not judged
        return []
    return sorted(set(live) - filled - set(_NOT_HYPER))


def optimizer_problem(sd: Any, optim: torch.optim.Optimizer, *, other_class: bool = False) -> str | None:
    """Why the optimizer state dict ``sd`` does not fit ``optim`` (None if it does): its groups
    and their parameter counts, hyperparameters of the kinds the optimizer uses, and
    per-parameter state of tensors and numbers for parameters it lists. Parameters are named by
    index (``state_dict()``'s form) or by any other unique id (DCP's names): torch's
    ``load_state_dict`` pairs them with the optimizer's parameters by position. ``other_class``:
    saved from another optimizer class, whose groups must then hold every hyperparameter this one
    uses (a group loaded replaces the optimizer's: one it lacks fails the first step; within one
    class, a key added by a later torch is filled in by the class itself)."""
    if not isinstance(sd, Mapping) or not isinstance(sd.get("param_groups"), Sequence):
        return "the optimizer state is not a dict with a list of param_groups"
    groups, live = sd["param_groups"], optim.param_groups
    if len(groups) != len(live):
        return f"the checkpoint has {len(groups)} parameter group(s), the optimizer {len(live)}"
    ids: set[Any] = set()
    for i, (g, lg) in enumerate(zip(groups, live)):
        if not isinstance(g, Mapping) or not isinstance(g.get("params"), Sequence):
            return f"parameter group {i} is not a dict with a list of params"
        if len(g["params"]) != len(lg["params"]):
            n, m = len(g["params"]), len(lg["params"])
            return f"parameter group {i} has {n} parameter(s) in the checkpoint, {m} here"
        if any(not isinstance(p, (int, str)) or isinstance(p, bool) or p in ids for p in g["params"]):
            return f"parameter group {i} does not name its parameters once each, by index or name"
        ids.update(g["params"])
        lacking = lacking_hyperparameters(g, lg, optim) if other_class else []
        if lacking:
            return f"parameter group {i} lacks {lacking[0]!r}, which this {type(optim).__name__} uses"
        for k in set(g) & set(lg) - {"params"}:
            problem = structure_problem(g[k], lg[k], f"param_groups/{i}/{k}")
            if problem:
                return problem
    state = sd.get("state", {})
    if not isinstance(state, Mapping):
        return "the optimizer's per-parameter state is not a dict"
    for p, entry in state.items():
        if isinstance(p, bool) or p not in ids:
            return f"the optimizer state names a parameter {str(p)[:80]!r} its groups do not list"
        if not isinstance(entry, Mapping) or not all(isinstance(k, str) for k in entry):
            return f"the state of parameter {p} is not a dict keyed by strings"
        for k, v in entry.items():
            items = v if isinstance(v, (list, tuple)) else (v,)  # LBFGS keeps its history in lists
            if any(isinstance(x, str) for x in items) and any(isinstance(x, torch.Tensor) for x in items):
                return (
                    f"the state {k!r} of parameter {p} mixes strings and tensors, which torch's load_state_dict "
                    "turns into a generator's name; keep them apart"
                )
            if not all(_state_value(x) for x in items):
                return (
                    f"the state {k!r} of parameter {p} is a {type(v).__name__}, not a tensor, a number, a flag, "
                    "a string, None or a list of them"
                )
    return None


def _state_value(v: Any) -> bool:
    """A per-parameter optimizer state value: a tensor, or a plain value an optimizer of its own
    may keep there (a flag, a string, None). Torch's load turns a string into a generator's name:
    the load sets strings apart around it (``optimplan.strings_apart``)."""
    return v is None or isinstance(v, (torch.Tensor, numbers.Real, str))
