"""Adapters between live stateful objects and the trees stashpoint saves.

Three kinds of stateful objects are told apart:

* ``module``: an ``nn.Module``; its ``state_dict()`` tensors alias the parameters and buffers.
* ``optimizer``: a ``torch.optim.Optimizer``; its state is re-keyed from integer ids to parameter
  names (fully qualified names, FQNs) found in the modules of the same state, so a checkpoint
  survives a change in parameter order.
* ``object``: anything else with ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import logging
import sys
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import torch

from stashpoint.errors import UnsupportedStateError

log = logging.getLogger("stashpoint")

T = TypeVar("T")

# What checkpoints saved before 2026-12-06 stripped from optimizer parameter names: "module" anywhere,
# also a user's own submodule of that name (a load still matches those names).
_LEGACY_WRAPPER_PARTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "module")


# Parts that wrappers nested inside a model put into its state_dict() keys (a block compiled on
# its own: ``layers.0._orig_mod.w``); never a name of the user's. A module's keys are saved without them.
_INNER_WRAPPER_PARTS = frozenset(("_orig_mod", "_checkpoint_wrapped_module"))


def module_keys(keys: Iterable[str]) -> dict[str, str] | None:
    """Each of a module state dict's ``keys`` as saved: without the parts inner wrappers add
    (``torch.compile`` of a block), so the same model saves the same keys however it is
    wrapped, as DCP's ``get_model_state_dict`` does. Returns ``{saved key: key}``, or None where
    every key is saved as it is (most models; asked on every save: a scan, not a split per key)
    or where two keys would become one."""
    keys = list(keys)
    joined = "\n".join(keys)
    if not any(part in joined for part in _INNER_WRAPPER_PARTS):
        return None
    out = {".".join(p for p in k.split(".") if p not in _INNER_WRAPPER_PARTS): k for k in keys}
    return out if len(out) == len(keys) else None


def kind_of(obj: Any) -> str | None:
    """Return the stateful kind of ``obj``, or None if it is not stateful.

    Raises :class:`UnsupportedStateError` for ``ZeroRedundancyOptimizer``, whose state lives on
    the ranks that own it and is gathered over the training's process group."""
    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        zero: Any = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
        if zero is not None and isinstance(obj, zero.ZeroRedundancyOptimizer):
            raise UnsupportedStateError(
                "ZeroRedundancyOptimizer is not supported: its state_dict() needs consolidate_state_dict(), which "
                "gathers over the training's process group, and its load then runs on every rank alike. Use FSDP2 "
                "(torch.distributed.fsdp.fully_shard), whose optimizer state is sharded as DTensors stashpoint "
                "saves shard by shard, or a plain optimizer under DDP"
            )
        return "optimizer"
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        if isinstance(obj, type):  # its state_dict is an unbound function: torch's TypeError told nothing
            raise UnsupportedStateError(
                f"{obj.__qualname__} is a class, not an object of it: pass the instance whose state to keep "
                f"(model = {obj.__qualname__}(...))"
            )
        return "object"
    return None


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside wrappers that only prefix its keys: DistributedDataParallel (``module.``)
    and ``torch.compile`` (``_orig_mod.``), so a checkpoint's keys do not depend on them.

    Raises :class:`UnsupportedStateError` for FSDP1 (``FullyShardedDataParallel``), whose
    ``state_dict()`` runs collectives on the training's process group."""
    while True:
        refuse_fsdp1(module)
        inner = (
            getattr(module, "module", None) if isinstance(module, torch.nn.parallel.DistributedDataParallel) else None
        )
        if inner is None and type(module).__name__ == "OptimizedModule":
            inner = getattr(module, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner


_no_fsdp1: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # modules whose tree was scanned once
_watching: list[Any] = []


def _watch_wrapping(cls: type) -> None:
    """Forget the scans once an FSDP1 module is set into any module (a model wrapped in place,
    as FSDP1's auto-wrap policy does, after a save scanned it)."""
    if _watching:
        return

    def seen(module: torch.nn.Module, name: str, sub: Any) -> None:
        if isinstance(sub, cls):
            _no_fsdp1.clear()

    _watching.append(torch.nn.modules.module.register_module_module_registration_hook(seen))


def refuse_fsdp1(module: torch.nn.Module) -> None:
    """Raise :class:`UnsupportedStateError` if ``module`` or any module inside it is FSDP1's
    (wrapped around a part of the model, or under ``torch.compile``): its ``state_dict()``
    gathers over the training's group. Each module's tree is scanned once per process."""
    # only a program that imported FSDP has FSDP modules: the others skip its costly import
    fsdp: Any = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FullyShardedDataParallel", None)
    if cls is None or module in _no_fsdp1:
        return
    _watch_wrapping(cls)
    if any(isinstance(m, cls) for m in module.modules()):
        raise UnsupportedStateError(
            "FullyShardedDataParallel (FSDP1) is not supported: its state_dict() gathers or reshards over the "
            "training's process group, which a background save must not touch. Use FSDP2 "
            "(torch.distributed.fsdp.fully_shard), whose parameters and optimizer state are DTensors that "
            "stashpoint saves shard by shard and loads on any number of ranks."
        )
    _no_fsdp1.add(module)


def find_all(state: Any, cls: type[T]) -> list[T]:
    """Every instance of ``cls`` reachable through the containers of ``state`` (dicts, lists,
    tuples), in traversal order; an instance is not looked into."""
    found: list[T] = []
    stack = [state]
    seen: set[int] = set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, cls):
            found.append(obj)
        elif isinstance(obj, Mapping):
            stack.extend(reversed(list(obj.values())))
        elif isinstance(obj, (list, tuple)):
            stack.extend(reversed(obj))
    return found


def find_modules(state: Any) -> list[torch.nn.Module]:
    """Every ``nn.Module`` reachable through the containers of ``state``, in traversal order."""
    return find_all(state, torch.nn.Module)


def param_names(modules: Iterable[torch.nn.Module], *, legacy: bool = False) -> dict[int, str]:
    """Map ``id(parameter)`` to its name in the first module that holds it: its key in the
    module's saved state (a DDP or ``torch.compile`` wrapper around it adds nothing; DCP's
    ``get_optimizer_state_dict`` names them alike). ``legacy``: as checkpoints saved before
    2026-12-06 named them (every ``module`` part left out)."""
    names: dict[int, str] = {}
    for module in modules:
        inner = unwrap(module)
        _reshard_fsdp2(inner)
        drop = _LEGACY_WRAPPER_PARTS if legacy else _INNER_WRAPPER_PARTS
        for name, param in (module if legacy else inner).named_parameters(remove_duplicate=False):
            names.setdefault(id(param), ".".join(p for p in name.split(".") if p not in drop))
    return names


def names_as_saved(modules: list[torch.nn.Module], saved: Iterable[object]) -> dict[int, str]:
    """:func:`param_names` as the checkpoint whose optimizer names ``saved`` named them: today's,
    or the legacy naming where that matches more of them (a model with a child called ``module``)."""
    names = param_names(modules)
    legacy = param_names(modules, legacy=True)
    wanted = {n for n in saved if isinstance(n, str)}
    if legacy != names and len(wanted & set(legacy.values())) > len(wanted & set(names.values())):
        names = legacy
    if len(modules) < 2:  # a parameter has one name
        return names
    # a parameter held by several modules of the state is named by the first; a state listing
    # them in another order than at the save (the head before the model holding it) named it
    # otherwise then: each parameter takes the one name of it that the checkpoint holds
    found = dict(names)
    open_ = {pid: spelled & wanted for pid, spelled in _every_name(modules).items() if pid in names}
    while settled := {pid: next(iter(hits)) for pid, hits in open_.items() if len(hits) == 1}:
        found.update(settled)  # and no other parameter can take its name
        gone = set(settled.values())
        open_ = {pid: hits - gone for pid, hits in open_.items() if pid not in settled}
    _say_ambiguous({pid: hits for pid, hits in open_.items() if len(hits) > 1}, names)
    taken = [n for n in found.values() if n in wanted]
    better = len(set(taken)) == len(taken) and len(taken) >= len(wanted & set(names.values()))
    return found if better else names


def _say_ambiguous(left: dict[int, set[str]], names: Mapping[int, str]) -> None:
    """Warn where a parameter could take either of two names the checkpoint holds: the state's
    order of its modules decides, and an order other than the save's swaps optimizer states
    of equal shapes without an error."""
    if left:
        took = sorted(names[pid] for pid in left)[0]
        other = sorted(next(h for pid, h in left.items() if names[pid] == took) - {took})[0]
        warnings.warn(
            f"stashpoint: a parameter is {took!r} in the first module of the state that holds it and {other!r} in "
            f"another, and the checkpoint holds both names ({len(left)} such parameter(s)): its optimizer state is "
            f"read from {took!r}; if the state listed its modules in another order when saved, list them as then",
            stacklevel=3,
        )


def _every_name(modules: Iterable[torch.nn.Module]) -> dict[int, set[str]]:
    """Each parameter's names in every module of ``modules`` that holds it, both namings."""
    out: dict[int, set[str]] = {}
    for module in modules:
        for legacy in (False, True):
            for pid, name in param_names([module], legacy=legacy).items():
                out.setdefault(pid, set()).add(name)
    return out


def resized_on_load(module: torch.nn.Module) -> set[str]:
    """The state-dict keys of the buffers of ``module`` that their own module's
    ``load_state_dict`` resizes: quantization's per-channel observers and fake quantizers size
    their ranges and scales at the first forward ([0] or [1] before), and take a checkpoint's of
    any size. Empty where quantization was never imported."""
    quant: Any = sys.modules.get("torch.ao.quantization")
    kinds = tuple(k for k in (getattr(quant, "ObserverBase", None), getattr(quant, "FakeQuantizeBase", None)) if k)
    if not kinds:
        return set()
    return {
        f"{name}.{b}" if name else b
        for name, m in module.named_modules()
        if isinstance(m, kinds)
        for b, _ in m.named_buffers(recurse=False)
        if b in _SIZED_AT_FIRST_FORWARD
    }


#: The observers' and fake quantizers' buffers their own load resizes (a histogram's is fixed)
_SIZED_AT_FIRST_FORWARD = frozenset(("min_val", "max_val", "scale", "zero_point"))


def _reshard_fsdp2(module: torch.nn.Module) -> None:
    """FSDP2 modules back in their sharded state (as their ``state_dict()`` does): after a forward
    that kept them unsharded (``reshard_after_forward=False``), their parameters are the full
    tensors, not the DTensors the optimizer holds, and would go unnamed."""
    fsdp: Any = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FSDPModule", None)
    if cls is None:
        return
    for m in module.modules():
        if isinstance(m, cls):
            m.reshard()


def optimizer_to_tree(optim: torch.optim.Optimizer, names: Mapping[int, str]) -> tuple[str, dict[str, Any]]:
    """The optimizer's ``state_dict()`` keyed by parameter names when every parameter has one.

    Returns ``(keyed_by, state_dict)`` where ``keyed_by`` is ``"name"`` or, when some parameter
    belongs to no module of the state, ``"index"`` (the optimizer's own integer ids).
    """
    sd = optim.state_dict()
    params = [p for group in optim.param_groups for p in group["params"]]
    pnames = [names.get(id(p)) for p in params]
    if any(n is None for n in pnames) or len(set(pnames)) != len(pnames):
        return "index", sd
    # state_dict() numbers parameters in param_groups order, starting at 0.
    by_index = dict(enumerate(pnames))
    state = {by_index[i]: v for i, v in sd["state"].items()}
    groups = [{**g, "params": [by_index[i] for i in g["params"]]} for g in sd["param_groups"]]
    return "name", {"state": state, "param_groups": groups}


def shard_shaped_state(optim: torch.optim.Optimizer, names: Mapping[int, str]) -> str | None:
    """What is wrong, if anything, with an optimizer's plain-tensor state shaped like its
    sharded DTensor parameter's local shard (an optimizer of one's own keeping ``zeros_like(
    p.grad.to_local())``): each rank's is another part of the whole, but a plain tensor under
    one key is one value on every rank, so all but one rank's would be lost (or, where the
    shards differ in size, the ranks would disagree)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    # no DTensor made in this process; torch's own optimizers keep a DTensor parameter's state as
    # DTensors (a save of 10k parameters would pay ~30 ms here on every call otherwise)
    if dtensor is None or type(optim).__module__.startswith("torch.optim"):
        return None
    for param, entry in getattr(optim, "state", {}).items():
        if not isinstance(entry, dict):
            continue
        # a step count of shape [1] is one number for the parameter, not a part of it
        plain = [(k, v) for k, v in entry.items() if type(v) is torch.Tensor and v.dim() > 0 and k != "step"]
        if not plain or not isinstance(param, dtensor):
            continue
        local = param._local_tensor.shape  # FSDP2's unpadded shard; to_local() would go through autograd
        if local == param.shape:
            continue
        for key, value in plain:
            if value.shape == local:
                name = names.get(id(param), "<a parameter of no module in the state>")
                return (
                    f"the optimizer's state {key!r} of parameter {name!r} is a plain tensor shaped like this "
                    f"rank's shard {list(local)} of the DTensor parameter {list(param.shape)}: a plain tensor under "
                    "one key is one value on every rank, so one rank's is saved. If each rank's is its part of "
                    "the whole, the others' are lost: keep it as a DTensor placed like the parameter "
                    "(torch.distributed.tensor.DTensor.from_local(t, p.device_mesh, p.placements)), as torch's "
                    "optimizers do under FSDP2. If it is the same on every rank, nothing is lost"
                )
    return None


_said_shard_shaped: set[type] = set()


def say_shard_shaped(optim: torch.optim.Optimizer, key: str, problem: str) -> None:
    """Warn of :func:`shard_shaped_state`'s finding once per optimizer class, on rank 0 (a
    warning, not a refusal: state the same on every rank may have a shard's shape too, and a
    refused save would leave the run with no checkpoint at all)."""
    dist = torch.distributed
    if type(optim) in _said_shard_shaped or (dist.is_available() and dist.is_initialized() and dist.get_rank()):
        return
    _said_shard_shaped.add(type(optim))
    log.warning("stashpoint: at key %r: %s (said once)", key or "<root>", problem)


def optimizer_current_names(optim: torch.optim.Optimizer, names: Mapping[int, str]) -> list[str | None]:
    """Names of the optimizer's parameters in its own order (None where a parameter has none)."""
    return [names.get(id(p)) for group in optim.param_groups for p in group["params"]]


def optimizer_from_named(
    sd: Mapping[str, Any], optim: torch.optim.Optimizer, names: Mapping[int, str], keep_groups: bool = False
) -> dict[str, Any]:
    """Turn a name-keyed optimizer state dict into the integer-keyed form ``optim`` loads.

    Integer ids follow the optimizer's *current* parameter order, and each current group takes
    the hyperparameters of the saved group that held its first parameter, so a checkpoint loads
    correctly after the parameters were reordered within their groups (groups formed otherwise
    are refused beforehand: ``validate.regroup_problem``). An empty group (a no-decay group of a model
    without biases) takes the saved group in its place when the counts agree; a group matched to
    none keeps its own; with ``keep_groups`` (the counts of groups differ: no pairing holds)
    every group keeps its own. The caller checks beforehand that the saved and current names agree.
    """
    saved_groups = sd["param_groups"]
    saved_group_of = {n: gi for gi, g in enumerate(saved_groups) for n in g["params"]}
    same_count = len(saved_groups) == len(optim.param_groups)
    index_of: dict[str, int] = {}
    groups = []
    for gi, group in enumerate(optim.param_groups):
        ids = []
        for p in group["params"]:
            index_of[names[id(p)]] = len(index_of)
            ids.append(index_of[names[id(p)]])
        first = names[id(group["params"][0])] if group["params"] else None
        if keep_groups:
            saved = group
        elif first in saved_group_of:
            saved = saved_groups[saved_group_of[first]]
        elif first is None and same_count and not saved_groups[gi]["params"]:
            saved = saved_groups[gi]
        else:
            saved = group
        # the names of the model as it is, where the optimizer keeps them (built from named_parameters())
        here = {"param_names": group["param_names"]} if "param_names" in group else {}
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, **here, "params": ids})
    state = {index_of[n]: v for n, v in sd["state"].items() if n in index_of}
    return {"state": state, "param_groups": groups}


def class_name(obj: Any) -> str:
    """An object's class as the tree records it for an optimizer: ``module.QualName``."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def saved_from_other_class(saved: object, live: Any) -> bool:
    """Whether an optimizer state recorded as saved from class ``saved`` (None in older
    checkpoints) comes from another class than ``live``: torch's own compared by name alone
    (torch moves them between its modules)."""
    mine = class_name(live)
    if not isinstance(saved, str) or saved == mine:
        return False
    if saved.startswith("torch.optim.") and mine.startswith("torch.optim."):
        return saved.rsplit(".", 1)[-1] != mine.rsplit(".", 1)[-1]
    return True


def optimizer_class_problem(saved: object, live: Any) -> str | None:
    """Why an optimizer state saved from class ``saved`` (the tree's record; None in older
    checkpoints) does not fit ``live``: two of torch's own optimizers that differ (an AdamW
    state loaded into SGD fails at its first step; Adam's into AdamW silently trains as Adam).
    Other classes are not judged: a subclass or a fused version may share a state."""
    mine = class_name(live)
    if not (isinstance(saved, str) and saved.startswith("torch.optim.") and mine.startswith("torch.optim.")):
        return None
    if saved.rsplit(".", 1)[-1] == mine.rsplit(".", 1)[-1]:  # the same class (torch may move its module)
        return None
    return (
        f"the checkpoint holds the state of an optimizer of class {saved.rsplit('.', 1)[-1]}, the state holds one "
        f"of class {type(live).__name__}: load it into the optimizer class it was saved from"
    )
