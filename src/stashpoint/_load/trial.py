"""Trying an object's own ``load_state_dict`` before anything lands (``load(atomic=True)``):
torch's optimizers and LR schedulers are loaded on a copy that shares nothing the load changes,
so a state they refuse (one that passed the planner's checks) fails the load while the live
state is still as it was. Other objects' loads cannot be tried: they may act outside themselves."""

from __future__ import annotations

import types
from typing import Any

import torch


def optimizer(optim: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """``optim.load_state_dict(sd)`` on a shallow copy of ``optim``: raises where torch would
    refuse ``sd`` (a per-parameter state without the ``step`` its class reads, say), and leaves
    ``optim`` and ``sd`` as they were (torch builds its state and groups anew). Only torch's own
    ``load_state_dict`` without hooks: a wrapper's (Accelerate's) loads into an optimizer the copy
    shares, and a hook would run twice."""
    if type(optim).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        return
    if getattr(optim, "_optimizer_load_state_dict_pre_hooks", None) or getattr(
        optim, "_optimizer_load_state_dict_post_hooks", None
    ):
        return
    dry = object.__new__(type(optim))
    dry.__dict__.update(optim.__dict__)
    dry.load_state_dict(sd)


def is_torch_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is one of torch's LR schedulers loading with torch's own code, its inner
    schedulers (SequentialLR's, ChainedScheduler's) too."""
    if not isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        return False
    if type(obj).load_state_dict.__module__ != torch.optim.lr_scheduler.__name__:
        return False
    inner = obj.__dict__.get("_schedulers")
    return not isinstance(inner, list) or all(is_torch_scheduler(s) for s in inner)


def scheduler(sched: Any, sd: Any) -> None:
    """``sched.load_state_dict(sd)`` on a copy of one of torch's LR schedulers and of ``sd``'s
    containers (LambdaLR's load pops a key from the state it is given; SequentialLR's loads into
    its inner schedulers; CyclicLR's and the lambda ones update their functions' attributes)."""
    if is_torch_scheduler(sched):
        _copy_of(sched).load_state_dict(_containers_copied(sd))


def _copy_of(sched: Any) -> Any:
    dry = object.__new__(type(sched))
    dry.__dict__.update(sched.__dict__)
    if isinstance(sched.__dict__.get("_schedulers"), list):
        dry._schedulers = [_copy_of(s) for s in sched._schedulers]
    if isinstance(sched.__dict__.get("lr_lambdas"), list):
        dry.lr_lambdas = [_stand_in(f) for f in sched.lr_lambdas]
    if "_scale_fn_custom" in sched.__dict__:
        dry._scale_fn_custom = _stand_in(sched._scale_fn_custom)
    return dry


def _stand_in(fn: Any) -> Any:
    """What a scheduler's load may update the attributes of, in place of a callable object: a
    plain function is never updated (its state is saved as None), nor is an object without them."""
    if isinstance(fn, types.FunctionType) or not hasattr(fn, "__dict__"):
        return fn
    stand_in = types.SimpleNamespace()
    stand_in.__dict__.update(vars(fn))
    return stand_in


def _containers_copied(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _containers_copied(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_containers_copied(v) for v in x]
    return x
