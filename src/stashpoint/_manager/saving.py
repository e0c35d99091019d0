"""The parts of ``CheckpointManager.save`` around the engine's: the options a manager's save
passes on, and its bookkeeping once the save ends (history, metrics, retention, the clean-up
of a failed save)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._dist.transfer import ReplicaError
from stashpoint._manager.steps import METRICS_KEY, quietly
from stashpoint._save.engine import SaveOptions
from stashpoint._save.handle import SaveStats

if TYPE_CHECKING:
    from stashpoint._manager.manager import CheckpointManager

log = logging.getLogger("stashpoint")


def plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """``metrics`` as JSON scalars: numbers, strings, booleans and None as they are, a NumPy
    scalar as the number it holds; raises ``TypeError`` naming the key of anything else (a
    tensor: its ``.item()`` is the caller's to take, as it waits for the GPU)."""
    out: dict[str, Any] = {}
    for key, value in (metrics or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"metrics keys must be strings, got {key!r}")
        if value is None or isinstance(value, (str, bool, int, float)):
            out[key] = value
        elif type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
            out[key] = value.item()  # a NumPy scalar: the Python number, bool or string it holds
        elif isinstance(value, numbers.Real):  # fractions, decimals
            out[key] = float(value)
        else:
            hint = (
                "pass a number, e.g. loss.item() (which waits for the GPU when the tensor is on one)"
                if hasattr(value, "item")
                else "pass a number, a string, a boolean or None"
            )
            raise TypeError(f"metrics[{key!r}] is a {type(value).__name__}, not a JSON scalar: {hint}")
    return out


def save_options(mgr: CheckpointManager, step: int, metrics: dict[str, float], options: dict[str, Any]) -> SaveOptions:
    """The engine's options for ``mgr``'s save of ``step``: the caller's ``options`` with the
    metrics in the metadata, the node-local plan, and the manager's defaults; raises
    ``ValueError`` for what a manager's save does not support."""
    meta = dict(options.pop("metadata", None) or {})
    meta[METRICS_KEY] = json.dumps(metrics)
    if "timeout" in options:
        options["timeout_s"] = options.pop("timeout")
    if mgr._nodes is not None:
        if options.get("process_group") is not None:
            raise ValueError(
                "a node-local CheckpointManager saves over the whole world; process_group is not supported"
            )
        options["nodes"] = mgr._nodes.for_save(mgr._replicas, mgr.retention.bound())
    if mgr._tier is not None and options.get("process_group") is not None:
        raise ValueError(
            "a CheckpointManager with a remote_root uploads over the whole world; saving over a process_group "
            "is not supported with tiers (use a manager without remote_root)"
        )
    if mgr.overlap:
        options.setdefault("overlap", True)
    if mgr.writer is not None:
        options.setdefault("writer", mgr.writer)
    return SaveOptions(metadata=meta, max_inflight=mgr.max_inflight, on_busy=mgr.on_busy, step=step, **options)


def after_save(
    mgr: CheckpointManager, step: int, metrics: dict[str, float], future: cf.Future[SaveStats], after: cf.Future[None]
) -> None:
    """Once ``mgr``'s save of ``step`` ended: its stats and metrics recorded and the retention
    rules applied in the background, or a failed save's directory removed; ``after`` is set
    done in every case."""
    try:
        error = future.exception()
        if error is not None and not isinstance(error, ReplicaError):
            # node-local: a failed save is no step of the job even where its manifest landed
            if mgr._owner and (mgr._nodes is not None or not mgr._at(step).exists(MANIFEST_NAME)):
                quietly(mgr._at(step).remove_tree)
            return
        if error is not None:  # committed, not copied to other nodes: kept, and raised by wait()
            with mgr._lock:
                mgr._metrics[step] = metrics
                if mgr._owner:
                    mgr._retain_later()
            return
        stats = future.result()
        with mgr._lock:
            mgr.history.append(stats)
            if stats.skipped:
                mgr.skipped += 1
            else:
                mgr._metrics[step] = metrics
                if mgr._owner:
                    mgr._retain_later()
        if mgr.on_save is not None:
            try:
                mgr.on_save(stats)
            except Exception:
                log.exception("stashpoint: the on_save callback raised")
    finally:
        after.set_result(None)
