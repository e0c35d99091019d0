"""The peers' savers and loaders: torchsnapshot, torch-checkpointing and Hugging Face Accelerate.

Each is configured as its documentation says for this case (a CPU machine, one or two gloo
ranks); the deviations from their defaults are in each method's ``note`` (``methods.py``). None
of the three fsyncs: the harness does it after they report a save finished.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .savers import Ctx, Done, Loader, Pending, Saver, fqn_state_dict, pairs, set_fqn_state_dict

# ---------------------------------------------------------------------------------------------
# torchsnapshot


def _snapshot_app_state(state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """torchsnapshot's app_state: every module and optimizer (Stateful) and a StateDict for the step."""
    import torchsnapshot

    extra = torchsnapshot.StateDict(step=state["step"])
    app: dict[str, Any] = {"extra": extra}
    for mk, model, ok, optim in pairs(state):
        app[mk], app[ok] = model, optim
    return app, extra


class _SnapshotPending(Pending):
    def __init__(self, pending: Any) -> None:
        self.pending = pending

    def done(self) -> bool:
        return bool(self.pending.done())

    def wait(self) -> dict[str, Any]:
        self.pending.wait()
        return {}


class TorchSnapshot(Saver):
    """``Snapshot.take`` or ``Snapshot.async_take``; a replicated (DDP) state is marked ``replicated``."""

    def __init__(self, state: dict[str, Any], ctx: Ctx, asynchronous: bool) -> None:
        self.state, self.ctx, self.asynchronous = state, ctx, asynchronous

    def start(self, path: Path) -> Pending:
        import torchsnapshot

        app, _ = _snapshot_app_state(self.state)
        replicated = ["**"] if self.ctx.layout == "ddp" else None
        if self.asynchronous:
            return _SnapshotPending(torchsnapshot.Snapshot.async_take(str(path), app, replicated=replicated))
        torchsnapshot.Snapshot.take(str(path), app, replicated=replicated)
        return Done()


def snapshot_loader(state: dict[str, Any]) -> Loader:
    def load(path: Path) -> dict[str, Any]:
        import torchsnapshot

        t0 = time.perf_counter()
        app, extra = _snapshot_app_state(state)
        torchsnapshot.Snapshot(str(path)).restore(app)
        state["step"] = int(extra["step"])
        return {"load_s": time.perf_counter() - t0}

    return load


# ---------------------------------------------------------------------------------------------
# torch-checkpointing (PyPI package `torch-checkpointing`, module torch_checkpointing)


def _tc_manager(op_timeout: float, asynchronous: bool) -> Any:
    """A CheckpointManager with the CPU settings: no pinned memory or non-blocking copies (CUDA
    only, their troubleshooting guide), and buffered writes: its O_DIRECT writer fails on ext4
    (``OSError: [Errno 22]`` when the unaligned end of a file is flushed)."""
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    timeout = int(op_timeout)
    save: Any
    if asynchronous:
        staging = CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False)
        save = AsyncCheckpointSaverConfig(staging_config=staging, wait_timeout_secs=timeout)
    else:
        save = SyncCheckpointSaverConfig(wait_timeout_secs=timeout)
    storage = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(CheckpointManager.Config(save=save, storage_config=storage))


class _TcPending(Pending):
    def __init__(self, manager: Any, future: Any, timeout: float) -> None:
        self.manager, self.future, self.timeout = manager, future, timeout

    def wait_staged(self) -> None:
        with self.manager.lock():  # held while staging copies the state
            pass

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        with self.manager.lock():  # what its tutorial wraps optimizer.step() in
            yield

    def done(self) -> bool:
        return self.future is None or bool(self.future.done())

    def wait(self) -> dict[str, Any]:
        if self.future is not None:
            self.future.result(timeout=self.timeout)
        return {}


class TorchCheckpointing(Saver):
    def __init__(self, state: dict[str, Any], ctx: Ctx) -> None:
        self.state, self.ctx = state, ctx
        self.manager = _tc_manager(ctx.op_timeout, asynchronous=True)

    def start(self, path: Path) -> Pending:
        future = self.manager.save(str(path), fqn_state_dict(self.state))
        return _TcPending(self.manager, future, self.ctx.op_timeout)

    def close(self) -> None:
        self.manager.close()


def tc_loader(state: dict[str, Any], ctx: Ctx) -> Loader:
    manager = _tc_manager(ctx.op_timeout, asynchronous=False)

    def load(path: Path) -> dict[str, Any]:
        t0 = time.perf_counter()
        loaded = manager.load(str(path), into=fqn_state_dict(state))
        t1 = time.perf_counter()
        set_fqn_state_dict(state, dict(loaded))
        t2 = time.perf_counter()
        return {"load_s": t2 - t0, "set_state_dict_s": t2 - t1}

    return load


# ---------------------------------------------------------------------------------------------
# Hugging Face Accelerate

_accelerators: dict[tuple[int, tuple[str, ...]], Any] = {}


class _Step:
    """The step counter as a checkpointable object (``Accelerator.register_for_checkpointing``)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.state["step"]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.state["step"] = int(sd["step"])


def _accelerator(state: dict[str, Any]) -> Any:
    """One Accelerator per state and set of keys (the training loop adds a module), with the
    modules and optimizers prepared and the step registered."""
    key = (id(state), tuple(state))
    acc = _accelerators.get(key)
    if acc is None:
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        objs = [o for mk, model, ok, optim in pairs(state) for o in (model, optim)]
        acc.prepare(*objs)  # on one CPU process: the modules unchanged, the optimizers wrapped
        acc.register_for_checkpointing(_Step(state))
        _accelerators[key] = acc
    return acc


class AccelerateSave(Saver):
    def __init__(self, state: dict[str, Any]) -> None:
        self.accelerator = _accelerator(state)

    def start(self, path: Path) -> Pending:
        self.accelerator.save_state(str(path))
        return Done()


def accelerate_loader(state: dict[str, Any]) -> Loader:
    acc = _accelerator(state)

    def load(path: Path) -> dict[str, Any]:
        t0 = time.perf_counter()
        acc.load_state(str(path))
        return {"load_s": time.perf_counter() - t0}

    return load


# ---------------------------------------------------------------------------------------------


def make_saver(method: str, state: dict[str, Any], ctx: Ctx) -> Saver:
    if method in ("torchsnapshot_take", "torchsnapshot_async"):
        return TorchSnapshot(state, ctx, asynchronous=method == "torchsnapshot_async")
    if method == "torch_checkpointing":
        return TorchCheckpointing(state, ctx)
    if method == "accelerate":
        return AccelerateSave(state)
    raise ValueError(f"unknown save method {method!r}")


def make_loader(method: str, state: dict[str, Any], ctx: Ctx) -> Loader | None:
    if method == "torchsnapshot_take":
        return snapshot_loader(state)
    if method == "torch_checkpointing":
        return tc_loader(state, ctx)
    if method == "accelerate":
        return accelerate_loader(state)
    return None
