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
        f"stashpoint.integrations.torchtitan needs torchtitan 0.3 and a torch it runs on ({e}): "
        "pip install 'stashpoint[torchtitan]', with the torch torchtitan's release names"
    ) from e

from stashpoint._core.naming import MANIFEST_NAME, parse_step_dir, step_dir
from stashpoint._load.loader import load
from stashpoint._manager.manager import CheckpointManager as StepManager
from stashpoint._manager.steps import committed_steps
from stashpoint._save.engine import save
from stashpoint._state.validate import structure_problem
from stashpoint._storage import storage_for
from stashpoint.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["StashpointCheckpointManager", "use_stashpoint"]

log = logging.getLogger("stashpoint")
_MODEL_ONLY = "model-only"
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class _Part:
    """Hands stashpoint a part's ``state_dict()`` as it is: torchtitan's optimizer container is a
    ``torch.optim.Optimizer`` whose state dict is already flat and keyed by name."""

    def __init__(self, inner: Any, hint: str = "") -> None:
        self.inner = inner
        self.hint = hint
        self._last: Any = None  # the state dict a load planned with, not built twice

    def state_dict(self) -> Any:
        self._last = self.inner.state_dict()
        return self._last

    def _stashpoint_check(self, sd: Any) -> str | None:
        live = self._last if self._last is not None else self.inner.state_dict()
        problem = structure_problem(sd, live)
        return f"{problem}; {self.hint}" if problem and self.hint else problem

    def load_state_dict(self, sd: Any) -> None:
        self.inner.load_state_dict(sd)


_HINTS = {
    MODEL: "a model-only save in another --checkpoint.export_dtype than the model's loads only into a model of that "
    "dtype",
    DATALOADER: "a dataloader's position loads only on as many data-parallel ranks as saved it: add "
    "--checkpoint.exclude_from_loading dataloader",
}


class StashpointCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager interface, implemented with :class:`stashpoint.CheckpointManager`.

    Checkpoints go to ``<dump_folder>/<checkpoint.folder>/step-NNNNNNNN``; ``keep_latest_k``
    keeps the newest k (0: all). A model-only save (the last step's, with
    ``last_save_model_only``, or the seed checkpoint of step 0) goes to ``model-step-NNNNNNNN``
    beside them: it is no resumable step.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        writer: str = "thread"
        """Where each rank's shards are written: "thread" or "process" (see stashpoint.async_save)."""

        remote_folder: str = ""
        """A second, durable tier (s3://bucket/run or a shared file system): every step is
        copied there in the background, and a restart falls back to it."""

        timeout: float = 600.0
        """Seconds a save's or a load's collective steps may wait for the other ranks."""

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
                "(checkpoint.last_save_in_hf / initial_load_in_hf): use torchtitan's own CheckpointManager for that run"
            )
        self.config = config
        # a URL (s3://...) or an absolute path stands alone, as with torchtitan's own manager
        self.folder = config.folder if "://" in config.folder else str(Path(base_folder) / config.folder)
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, LR_SCHEDULER: lr_schedulers})
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        for key in config.exclude_from_loading:
            if key not in self.states and key != DATALOADER:
                raise ValueError(
                    f"checkpoint.exclude_from_loading names {key!r}, which is not one of {sorted(self.states)}"
                )
        self.root = storage_for(self.folder)
        # load_only (an evaluation job, say) reads a folder a training job may own: no manager
        self.manager = None if config.load_only else StepManager(
            self.folder,
            keep_last=config.keep_latest_k or None,
            remote_root=config.remote_folder or None,
            writer=config.writer,
        )  # fmt: skip

    # -- saving ---------------------------------------------------------------------------------

    def _state(self, keys: Any) -> dict[str, Any]:
        return {k: _Part(v, _HINTS.get(k, "")) for k, v in self.states.items() if k in keys}

    def _should_save(self, step: int, last_step: bool) -> bool:
        c = self.config
        if c.load_only:
            return False
        return (step == 1 and c.enable_first_step_checkpoint) or last_step or step % c.interval == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        assert self.manager is not None
        if curr_step == 0 or (last_step and self.config.last_save_model_only):
            # the finished model, for evaluation or another job's initial_load_path, or the seed
            # (step 0: torchtitan loads it model only, whatever last_save_model_only says); durable
            # before training returns
            self.manager.wait()
            # the seed keeps its dtypes: it is the next run's start, not an export
            dtype = _DTYPES[self.config.export_dtype] if curr_step != 0 else None
            model = {k: _cast(v, dtype) for k, v in self.states[MODEL].state_dict().items()}
            where = self.root.child(_model_dir(curr_step))
            meta = {"torchtitan": _MODEL_ONLY}
            save({MODEL: model}, where, overwrite=True, metadata=meta, timeout=self.config.timeout)
            return True
        handle = self.manager.save(curr_step, self._state(self.states), timeout=self.config.timeout)
        self.save_future = handle  # type: ignore[assignment]  # only compared with None by torchtitan
        if last_step:
            self.manager.wait()
        return True

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: a save returns once its state is staged."""

    def _wait_for_saving(self) -> None:
        self.save_future = None
        if self.manager is not None:
            self.manager.wait()

    def _close(self) -> None:
        self.save_future = None
        if self.manager is not None:
            try:
                self.manager.wait()
            finally:
                self.manager.close()

    # -- loading --------------------------------------------------------------------------------

    def _load(self, step: int = -1) -> bool:
        full = set(self.states) - set(self.config.exclude_from_loading)
        options: dict[str, Any] = {"partial": True, "timeout": self.config.timeout}
        t0 = time.monotonic()
        seed = self.root.child(_model_dir(0))
        steps = committed_steps(self.root) if self.manager is None else self.manager.steps()
        if step == 0 and 0 not in steps:  # --checkpoint.load_step 0: the seed, as torchtitan loads step 0
            if not seed.exists(MANIFEST_NAME):
                raise CheckpointNotFoundError(
                    f"--checkpoint.load_step 0 loads the seed checkpoint, and {seed.location} holds none "
                    f"(--checkpoint.create_seed_checkpoint writes it); the committed steps there are "
                    f"{', '.join(map(str, steps)) or 'none'}"
                )
            load(self._state({MODEL}), seed, **options)
            if self.manager is not None:  # loaded: a seed that does not fit leaves the steps where they are
                self._roll_back_past(0)
            self._loaded({MODEL}, seed.location, t0)
            return True
        if (steps[-1] if step == -1 and steps else step) == 0:
            full = {MODEL}  # a full step 0 (an earlier seed save): torchtitan loads step 0 model only
        if self.manager is None:  # load_only: read what is committed, change nothing
            chosen = steps[-1] if step == -1 and steps else step
            if chosen != -1:
                load(self._state(full), self.root.child(step_dir(chosen)), **options)
        else:
            if step == -1 and steps:
                self._refuse_a_finished_run()
            try:
                restored = self.manager.restore(self._state(full), None if step == -1 else step, **options)
            except CheckpointNotFoundError as e:  # in the launcher's words
                raise CheckpointNotFoundError(
                    str(e).replace("restore(state) loads the newest", "--checkpoint.load_step -1 loads the newest")
                ) from None
            if step != -1:  # loaded: one that failed leaves the newer steps where they are
                self._roll_back_past(step)
            chosen = -1 if restored is None else restored
        if chosen != -1:
            self._loaded(full, f"step {chosen} of {self.folder}", t0)
            return True
        if seed.exists(MANIFEST_NAME):  # a seed checkpoint (--checkpoint.create_seed_checkpoint)
            load(self._state({MODEL}), seed, **options)
            self._loaded({MODEL}, seed.location, t0)
            return True
        self._refuse_dcp_steps()
        if not self.config.initial_load_path:
            return False
        keys = {MODEL} if self.config.initial_load_model_only else full
        load(self._state(keys), self.config.initial_load_path, **options)
        self._loaded(keys, self.config.initial_load_path, t0)
        return True

    def _loaded(self, keys: Any, what: str, t0: float) -> None:
        log.info("stashpoint: loaded %s of %s in %.2f s", ", ".join(sorted(keys)), what, time.monotonic() - t0)

    def _roll_back_past(self, step: int) -> None:
        """--checkpoint.load_step older than the newest step: training will reach the newer
        steps again, so they are moved aside (``step-N.rolled-back-<time>``), as DCP would
        overwrite them; rank 0 does it once the step is loaded, before its first save (which the
        other ranks' saves wait for)."""
        assert self.manager is not None
        newer = [s for s in self.manager.steps() if s > step]
        if newer and (step in self.manager.steps() or step == 0) and self.manager.rank == 0:  # 0: the seed
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for s in newer:
                moved = self.root.child(step_dir(s)).move(f"{step_dir(s)}.rolled-back-{stamp}")
                log.warning("stashpoint: loading step %d, so step %d is moved aside to %s", step, s, moved.location)

    def _refuse_a_finished_run(self) -> None:
        assert self.manager is not None
        newest = self.manager.steps()[-1]
        done = [n for n in (_model_step(c) for c in self.root.children()) if n is not None and n > newest]
        if done:
            raise CheckpointError(
                f"{self.folder} holds the model-only save of a finished run (step {max(done)}), newer than its newest "
                f"resumable step ({newest}): to train on from step {newest}, move {_model_dir(max(done))} away; to "
                "start a new run from that model, give it as --checkpoint.initial_load_path with another "
                "--checkpoint.folder"
            )

    def _refuse_dcp_steps(self) -> None:
        for name in self.root.children():
            if name.startswith("step-") and self.root.child(name).exists(".metadata"):
                raise CheckpointError(
                    f"{self.folder} holds torchtitan DCP checkpoints ({name}/.metadata), which this manager does not "
                    "read: keep torchtitan's own manager for this run, or give the stashpoint run a new "
                    "--checkpoint.folder"
                )


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    if dtype and isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def _model_dir(step: int) -> str:
    return f"model-{step_dir(step)}"


def _model_step(name: str) -> int | None:
    return parse_step_dir(name[len("model-") :]) if name.startswith("model-") else None


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
