"""torchtitan: a checkpoint manager that saves with stashpoint, selected by configuration.

On the command line of any torchtitan (0.3) job::

    --checkpoint.enable --override.imports stashpoint.integrations.torchtitan.use_stashpoint

or in a config function: ``config.checkpoint = StashpointCheckpointManager.Config(enable=True, ...)``.

The usual ``--checkpoint.*`` settings keep their meaning (``folder``, ``interval``,
``keep_latest_k``, ``load_step``, ``initial_load_path`` / ``initial_load_model_only``,
``exclude_from_loading``, ``last_save_model_only`` / ``export_dtype``,
``enable_first_step_checkpoint``, ``load_only``). Every save but the last is asynchronous: the
model, optimizer, scheduler, dataloader and train state are staged into host buffers (training
waits only for that) and written, checksummed and committed in the background, on stashpoint's
own gloo group; each rank writes its own shards, and a checkpoint loads on another number of
ranks or another sharding. The newest committed step is what a restart loads: a save a crash
interrupted is never taken for one. Saving in Hugging Face format (``last_save_in_hf``,
``initial_load_in_hf``) is left to torchtitan's own manager and refused here.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

try:
    from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager, ModelWrapper
    from torchtitan.components.checkpointer.base import DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER
    from torchtitan.config.override import derive, override
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "stashpoint.integrations.torchtitan needs torchtitan 0.3: pip install 'stashpoint[torchtitan]'"
    ) from e

from stashpoint._load.loader import load
from stashpoint._load.manifest import read_head
from stashpoint._manager.manager import CheckpointManager as StepManager
from stashpoint._storage import storage_for
from stashpoint.errors import CheckpointNotFoundError

__all__ = ["StashpointCheckpointManager", "use_stashpoint"]

log = logging.getLogger("stashpoint")
_MODEL_ONLY = "model-only"
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class _AsObject:
    """Hands stashpoint an object's ``state_dict()`` as it is: torchtitan's optimizer container
    is a ``torch.optim.Optimizer`` whose state dict is already flat and keyed by name."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def state_dict(self) -> Any:
        return self.inner.state_dict()

    def load_state_dict(self, sd: Any) -> None:
        self.inner.load_state_dict(sd)


class StashpointCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager interface, implemented with :class:`stashpoint.CheckpointManager`.

    Checkpoints go to ``<dump_folder>/<checkpoint.folder>/step-NNNNNNNN``. ``keep_latest_k``
    keeps the newest k committed steps (0: all).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        writer: str = "thread"
        """Where each rank's shards are written: "thread" or "process" (see stashpoint.async_save)."""

        remote_folder: str = ""
        """A second, durable tier (s3://bucket/run or a shared file system): every step is
        copied there in the background, and a restart falls back to it."""

        timeout: float = 600.0
        """Seconds a save's collective steps may wait for the other ranks."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future = None
        if not self.enable:
            return
        if config.last_save_in_hf or config.initial_load_in_hf:
            raise ValueError(
                "StashpointCheckpointManager does not read or write Hugging Face safetensors checkpoints "
                "(checkpoint.last_save_in_hf / initial_load_in_hf): export the final model with "
                "'stashpoint export', or use torchtitan's own CheckpointManager for that run"
            )
        self.config = config
        # a URL (s3://...) or an absolute path stands alone, as with torchtitan's own manager
        self.folder = config.folder if "://" in config.folder else str(Path(base_folder) / config.folder)
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, LR_SCHEDULER: lr_schedulers})
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        for key in config.exclude_from_loading:
            if key not in self.states:
                raise ValueError(
                    f"checkpoint.exclude_from_loading names {key!r}, which is not one of {sorted(self.states)}"
                )
        self.manager = StepManager(
            self.folder,
            keep_last=config.keep_latest_k or None,
            remote_root=config.remote_folder or None,
            writer=config.writer,
        )

    # -- saving ---------------------------------------------------------------------------------

    def _state(self, keys: Any = None) -> dict[str, Any]:
        return {k: _AsObject(v) for k, v in self.states.items() if keys is None or k in keys}

    def _should_save(self, step: int, last_step: bool) -> bool:
        c = self.config
        if c.load_only:
            return False
        return (step == 1 and c.enable_first_step_checkpoint) or last_step or step % c.interval == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        if last_step and self.config.last_save_model_only:
            # the finished model for evaluation or export, durable before training returns
            dtype = _DTYPES[self.config.export_dtype]
            model = {
                k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype else v
                for k, v in self.states[MODEL].state_dict().items()
            }
            self.manager.save(curr_step, {MODEL: model}, metadata={"torchtitan": _MODEL_ONLY}).wait()
            return True
        handle = self.manager.save(curr_step, self._state(), timeout=self.config.timeout)
        self.save_future = handle  # type: ignore[assignment]  # only compared with None by torchtitan
        if last_step:
            self.manager.wait()
        return True

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: a save returns once its state is staged."""

    def _wait_for_saving(self) -> None:
        self.save_future = None
        self.manager.wait()

    def _close(self) -> None:
        try:
            self.manager.wait()
        finally:
            self.save_future = None
            self.manager.close()

    # -- loading --------------------------------------------------------------------------------

    def _load(self, step: int = -1) -> bool:
        steps = self.manager.steps()
        if step != -1 and step not in steps:
            raise CheckpointNotFoundError(
                f"--checkpoint.load_step={step}: no committed checkpoint of that step in {self.folder} "
                f"(committed: {steps[-5:] or 'none'})"
            )
        if steps:  # a restart: the run's own newest step; initial_load_* apply to a fresh run only
            chosen = steps[-1] if step == -1 else step
            where: Any = self.manager.path(chosen)
            model_only = chosen == 0 or _is_model_only(where)
        elif self.config.initial_load_path:
            chosen, where, model_only = None, self.config.initial_load_path, self.config.initial_load_model_only
        else:
            return False
        keys = {MODEL} if model_only else set(self.states) - set(self.config.exclude_from_loading)
        t0 = time.monotonic()
        load(self._state(keys), where, partial=True, timeout=self.config.timeout)
        took = time.monotonic() - t0
        log.info("stashpoint: loaded %s of %s in %.2f s", ", ".join(sorted(keys)), os.fspath(where), took)
        return True


def _is_model_only(path: Any) -> bool:
    """Whether the checkpoint at ``path`` is a final, model-only save (its manifest says so)."""
    return read_head(storage_for(path)).metadata.get("torchtitan") == _MODEL_ONLY


@override(
    target=CheckpointManager.Config,
    exact=True,
    description="checkpoint with stashpoint (staged saves, written in the background)",
)
def use_stashpoint(cfg: CheckpointManager.Config, **kw: Any) -> StashpointCheckpointManager.Config:
    """Swap torchtitan's DCP checkpoint manager for :class:`StashpointCheckpointManager`,
    keeping every shared ``--checkpoint.*`` setting. Select it with
    ``--override.imports stashpoint.integrations.torchtitan.use_stashpoint``; its own settings
    go as JSON: ``--override.imports 'stashpoint.integrations.torchtitan.use_stashpoint={"writer": "process"}'``."""
    return derive(cfg, StashpointCheckpointManager.Config, **kw)
