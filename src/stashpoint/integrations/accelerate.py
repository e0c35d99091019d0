"""Hugging Face Accelerate: ``Accelerator.save_state`` / ``load_state``, staged and written in the background.

.. code-block:: python

    from stashpoint.integrations.accelerate import load_state, save_state

    save_state(accelerator, "ckpt/step-100")   # returns once staged; written in the background
    load_state(accelerator, "ckpt/step-100")   # in a fresh process, after accelerator.prepare(...)

What is saved is what ``Accelerator.save_state`` saves: the prepared models, optimizers and
schedulers, the gradient scaler, the dataloaders' positions, every process's RNG states
(Python, NumPy, torch on the CPU and CUDA; not XPU, NPU, MLU or HPU generators), the
objects given to ``register_for_checkpointing`` and the accelerator's step counters. Unlike
``save_state`` nothing is pickled, the models' and optimizers' shards are written once in total
across DDP ranks, and FSDP2 (``fully_shard``) models are saved shard by shard and load on any
number of processes (Accelerate runs FSDP on GPUs only; this path is tested without
Accelerate). :func:`accelerator_state` gives the same objects as a dict, for
:class:`stashpoint.CheckpointManager` (retention, tiers) or :func:`stashpoint.async_save`.

Why functions and not Accelerate's ``register_save_state_pre_hook``: those hooks only see the
models' weights; the optimizers, schedulers, samplers and RNG states would still go through
``torch.save`` (pickle, synchronous, on every process), so they cannot make a save asynchronous.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

try:
    from accelerate import Accelerator
    from accelerate.data_loader import SeedableRandomSampler
    from accelerate.utils import DistributedType
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "stashpoint.integrations.accelerate needs Hugging Face Accelerate: pip install 'stashpoint[accelerate]'"
    ) from e

from stashpoint._load.loader import load
from stashpoint._save.engine import async_save
from stashpoint._save.handle import SaveHandle
from stashpoint._state.perrank import as_plain, as_tensors
from stashpoint._state.rng import RNGState
from stashpoint.errors import CheckpointError, CheckpointNotFoundError, UnsupportedStateError
from stashpoint.integrations._accelerate_folder import (
    accelerates_own,
    checkpoints,
    committed,
    held,
    none_to_load,
    only_accelerates_own,
    then,
)

__all__ = ["accelerator_state", "load_state", "save_state"]

log = logging.getLogger("stashpoint")

_REFUSED = {
    DistributedType.DEEPSPEED: "DeepSpeed saves its engine's state itself (model.save_checkpoint)",
    DistributedType.MEGATRON_LM: "Megatron-LM saves its model, optimizer and scheduler itself",
    DistributedType.XLA: "XLA tensors are not staged by stashpoint",
}


def accelerator_state(accelerator: Accelerator) -> dict[str, Any]:
    """The live objects ``Accelerator.save_state`` checkpoints, as a state for stashpoint.

    Keys: ``models``, ``optimizers``, ``schedulers``, ``dataloaders`` and ``custom`` (lists, in
    the order they were prepared or registered), ``scaler`` (when mixed precision uses one),
    ``rng`` (this process's generators) and ``accelerator`` (``step`` and the checkpoint
    ``iteration``). Saving reads them at that moment; loading restores them in place. Build it
    after ``accelerator.prepare(...)``.

    Raises:
        UnsupportedStateError: for DeepSpeed, Megatron-LM and XLA runs, which checkpoint their
            engines themselves, and for FSDP1 models (use FSDP2, ``fsdp_version=2``).
    """
    refused = _REFUSED.get(accelerator.distributed_type)
    if refused is not None:
        raise UnsupportedStateError(
            f"stashpoint cannot checkpoint an Accelerator of type {accelerator.distributed_type.value}: {refused}. "
            "Use accelerator.save_state for it, or run with DDP or FSDP2."
        )
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    if accelerator.distributed_type == DistributedType.FSDP and getattr(fsdp, "fsdp_version", 2) != 2:
        raise UnsupportedStateError(
            "stashpoint checkpoints FSDP2 models, not FSDP1 (its state_dict() runs collectives on the training's "
            "process group): use FullyShardedDataParallelPlugin(fsdp_version=2)"
        )
    state: dict[str, Any] = {
        "models": list(accelerator._models),
        "optimizers": [getattr(o, "optimizer", o) for o in accelerator._optimizers],
        "schedulers": [getattr(s, "scheduler", s) for s in accelerator._schedulers],
        "dataloaders": [_LoaderPosition(dl, accelerator.num_processes) for dl in accelerator._dataloaders],
        "custom": list(accelerator._custom_objects),
        "rng": RNGState(),
        "accelerator": _Counters(accelerator),
    }
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    return state


def save_state(
    accelerator: Accelerator,
    path: str | os.PathLike[str] | None = None,
    *,
    overwrite: bool | None = None,
    safe_serialization: bool = True,
    **options: Any,
) -> SaveHandle:
    """Checkpoint what ``accelerator.save_state`` would, to the directory ``path``, asynchronously.

    Returns once the state is staged in host memory; training may go on while it is written,
    checksummed and committed. Every process calls it (the save is collective). ``handle.wait()``
    returns the :class:`stashpoint.SaveStats` or raises the failure; the next save and
    :func:`stashpoint.shutdown` (run at exit) wait for it too. Like ``save_state`` it counts the
    accelerator's checkpoint ``iteration`` up by one.

    Args:
        accelerator: the ``Accelerator`` after ``prepare(...)``.
        path: the checkpoint directory to create (or a storage URL such as ``s3://bucket/run/step-100``).
            None with ``ProjectConfiguration(automatic_checkpoint_naming=True)``: as Accelerate
            names it, ``project_dir/checkpoints/checkpoint_<iteration>``; with ``total_limit``
            the oldest beyond it are deleted once this one has committed.
        overwrite: replace a committed checkpoint at ``path``, as ``Accelerator.save_state``
            writes over its directory (the old one stays loadable until the new one commits);
            ``False`` refuses instead. Default: True for a ``path`` given, False under automatic
            naming, where a committed ``checkpoint_<iteration>`` is another run's (Accelerate
            refuses it too): call ``load_state(accelerator)`` first to continue that run.
        safe_serialization: accepted for ``Accelerator.save_state``'s signature; stashpoint's
            shards are always safetensors files.
        **options: passed on to :func:`stashpoint.async_save` (``metadata``, ``writer``,
            ``overlap``, ``timeout``, ``allow_pickle``, ...).
    """
    _warn_hooks(accelerator._save_model_state_pre_hook, "register_save_state_pre_hook", "save")
    path = _accelerates_name(path, options, "output_dir")
    metadata = {"framework": "accelerate", **dict(options.pop("metadata", None) or {})}
    config = accelerator.project_configuration
    folder = checkpoints(accelerator) if path is None else None
    target = folder / f"checkpoint_{config.iteration}" if folder is not None else path
    assert target is not None
    if overwrite is None:
        overwrite = folder is None
    if own := accelerates_own(target):
        # beside them, Accelerator.load_state would silently load the old files, not this save
        raise CheckpointError(
            f"{target} holds a checkpoint written by Accelerator.save_state ({own}): give stashpoint's save_state "
            "another directory, or remove that one first"
        )
    if folder is not None and not overwrite and (there := held(folder / f"checkpoint_{config.iteration}")):
        raise CheckpointError(
            f"{target} already holds {there}: this run's automatic checkpoint naming is at iteration "
            f"{config.iteration}, where an earlier run saved. Call load_state(accelerator) first to continue that "
            "run (it sets the iteration), give this run its own project_dir, or pass overwrite=True to replace it"
        )
    config.iteration += 1  # before staging, so that the checkpoint holds the count a resume continues from
    try:
        handle = async_save(accelerator_state(accelerator), target, overwrite=overwrite, metadata=metadata, **options)
    except BaseException:
        config.iteration -= 1
        raise
    if folder is not None and config.total_limit is not None and accelerator.is_main_process:
        saved = config.iteration - 1
        handle._future = then(handle._future, folder, config.total_limit, saved)  # wait() waits for it too
    return handle


def load_state(accelerator: Accelerator, path: str | os.PathLike[str] | None = None, **options: Any) -> None:
    """Restore a checkpoint written by :func:`save_state` into the prepared objects, in place.

    Call it in every process, after ``accelerator.prepare(...)`` with the same models,
    optimizers, schedulers and dataloaders (and the same ``register_for_checkpointing`` objects)
    as the run that saved; the optimizers may be fresh. The number of processes may differ:
    tensors are resharded and process ``r`` gets the RNG states saved by process ``r mod N``;
    a position within an epoch (stateful dataloaders) loads only on the number of processes that
    saved it, since each process's share of the data depends on it.

    Args:
        accelerator: the ``Accelerator`` after ``prepare(...)``.
        path: the checkpoint directory. None with ``automatic_checkpoint_naming``: the newest
            committed ``project_dir/checkpoints/checkpoint_<n>``.
        **options: passed on to :func:`stashpoint.load` (``strict``, ``verify``, ``allow_pickle``, ...).

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError: as :func:`stashpoint.load`.
    """
    _warn_hooks(accelerator._load_model_state_pre_hook, "register_load_state_pre_hook", "load")
    path = _accelerates_name(path, options, "input_dir")
    if path is None:
        folder = checkpoints(accelerator)
        found = committed(folder)
        if not found:
            raise CheckpointNotFoundError(none_to_load(folder))
        path = folder / f"checkpoint_{found[-1]}"
    elif own := only_accelerates_own(path):
        raise CheckpointNotFoundError(
            f"{path} holds a checkpoint written by Accelerator.save_state ({own}), not by stashpoint: load it with "
            "accelerator.load_state"
        )
    load(accelerator_state(accelerator), path, **options)


def _accelerates_name(path: Any, options: dict[str, Any], name: str) -> Any:
    """``path``, or the same given under Accelerate's own keyword (``output_dir``, ``input_dir``)."""
    given = options.pop(name, None)
    if given is not None and path is not None:
        raise TypeError(f"give the checkpoint's path once: path={path!r} and {name}={given!r}")
    return given if path is None else path


def _warn_hooks(hooks: Mapping[Any, Any], register: str, what: str) -> None:
    """Hooks registered for Accelerate's own save_state / load_state (a library writing its own
    files, e.g. save_pretrained) do not run here: say so rather than drop their files silently."""
    if hooks:
        msg = (
            f"stashpoint: {len(hooks)} hook(s) registered with accelerator.{register} do not run in stashpoint's "
            f"{what}_state (they belong to Accelerator.{what}_state); call what they do yourself"
        )
        warnings.warn(msg, stacklevel=3)
        log.info(msg)  # for logs kept; a warning too would print the text twice without logging set up


class _Counters:
    """The accelerator's ``step`` (gradient accumulation) and checkpoint ``iteration``."""

    _stashpoint_what = "accelerator's counters"

    def __init__(self, accelerator: Accelerator) -> None:
        self._acc = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self._acc.step), "iteration": int(self._acc.project_configuration.iteration)}

    def _stashpoint_check(self, sd: Any) -> str | None:
        if not (isinstance(sd, dict) and set(sd) == {"step", "iteration"} and all(_is_int(v) for v in sd.values())):
            return "the accelerator's counters are two integers, 'step' and 'iteration'"
        return None

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self._acc.step = int(sd["step"])
        self._acc.project_configuration.iteration = int(sd["iteration"])


class _LoaderPosition:
    """A prepared dataloader's position: its epoch (``iteration``), the seedable sampler's seed
    and, with ``DataLoaderConfiguration(use_stateful_dataloader=True)``, the batch within the
    epoch. Kept as plain values, so each process saves and restores its own."""

    _stashpoint_what = "dataloader's position"

    def __init__(self, loader: Any, processes: int) -> None:
        self._loader = loader
        self._processes = processes

    def state_dict(self) -> dict[str, Any]:
        dl = self._loader
        # at an epoch's last batch the loader still counts that epoch (it counts up once the loop
        # ends): a resume there starts the next epoch, from its first batch
        done = _at_last_batch(dl)
        sd: dict[str, Any] = {"epoch": int(getattr(dl, "iteration", 0)) + done, "processes": self._processes}
        sampler = _seedable(dl)
        if sampler is not None:
            sd["sampler"] = {"initial_seed": int(sampler.initial_seed), "epoch": int(sampler.epoch)}
        if getattr(dl, "use_stateful_dataloader", False) and not done:
            sd["batches"] = as_plain(dl.state_dict())
        return sd

    def _stashpoint_check(self, sd: Any) -> str | None:
        keys = {"epoch", "processes", "sampler", "batches"}
        if not (isinstance(sd, dict) and all(_is_int(sd.get(k)) for k in ("epoch", "processes")) and set(sd) <= keys):
            return "a dataloader's position holds integers 'epoch' and 'processes', optionally 'sampler' and 'batches'"
        sampler = sd.get("sampler")
        if sampler is not None and not (
            isinstance(sampler, dict) and all(_is_int(sampler.get(k)) for k in ("initial_seed", "epoch"))
        ):
            return "the sampler's position is two integers, 'initial_seed' and 'epoch'"
        if "batches" not in sd:
            return None
        if not getattr(self._loader, "use_stateful_dataloader", False):
            return (
                "the checkpoint holds a position within the epoch, but this dataloader is not stateful: prepare it "
                "with DataLoaderConfiguration(use_stateful_dataloader=True), as the run that saved it did"
            )
        if sd["processes"] != self._processes:
            return (
                f"the position within the epoch was saved by {sd['processes']} processes and each process's share of "
                f"the data depends on their number ({self._processes} now): resume on {sd['processes']} processes, "
                "or from a checkpoint taken at the end of an epoch"
            )
        try:
            as_tensors(sd["batches"])
        except ValueError as e:
            return f"the position within the epoch cannot be read: {e}"
        return None

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        problem = self._stashpoint_check(sd)
        if problem is not None:
            raise ValueError(problem)
        dl = self._loader
        if hasattr(dl, "set_epoch"):
            dl.set_epoch(int(sd["epoch"]))
        sampler = _seedable(dl)
        saved = sd.get("sampler")
        if sampler is not None and saved is not None:
            sampler.initial_seed = int(saved["initial_seed"])
            sampler.epoch = int(saved["epoch"])
        if "batches" in sd:
            dl.load_state_dict(as_tensors(sd["batches"]))


def _at_last_batch(loader: Any) -> bool:
    """Whether ``loader`` has given its epoch's last batch and its loop has not ended yet."""
    if not getattr(loader, "end_of_dataloader", False):
        return False
    gradient_state = getattr(loader, "gradient_state", None)
    return loader in (getattr(gradient_state, "dataloader_references", None) or ())


def _seedable(loader: Any) -> SeedableRandomSampler | None:
    get = getattr(loader, "get_sampler", None)
    sampler = get() if callable(get) else None
    return sampler if isinstance(sampler, SeedableRandomSampler) else None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
