"""Savers and loaders: torch.save, DCP (sync and every async configuration) and stashpoint.

A saver's :meth:`Saver.start` is the part that blocks training; it returns a :class:`Pending`
that knows when the live state may change again (:meth:`Pending.wait_staged`; the training loop
runs each optimizer step inside :meth:`Pending.guard`) and when the library is done
(:meth:`Pending.wait`). Whether the library fsyncs is the method's ``fsyncs`` flag; the harness
fsyncs for those that do not. The peers' savers are in :mod:`.peers`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .state import local

Loader = Callable[[Path], dict[str, Any]]


@dataclass(frozen=True)
class Ctx:
    """Where a saver runs: this rank, the world, the state's layout, how long an async save may take."""

    rank: int
    world: int
    layout: str
    op_timeout: float


class Pending:
    """A save in flight. The default: a save that was complete when ``start`` returned."""

    def wait_staged(self) -> None:
        """Block until the live state may be changed without affecting this checkpoint."""

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run an optimizer step inside this: it waits for what the library needs it to wait for."""
        self.wait_staged()
        yield

    def done(self) -> bool:
        return True

    def wait(self) -> dict[str, Any]:
        """Block until the library reports the save finished; return library figures, if any."""
        return {}


class Done(Pending):
    """A save that was complete when ``start`` returned, with the library's own figures."""

    def __init__(self, figures: dict[str, Any] | None = None) -> None:
        self.figures = figures or {}

    def wait(self) -> dict[str, Any]:
        return dict(self.figures)


class FuturePending(Pending):
    """A save whose completion is a ``concurrent.futures.Future`` (and staging maybe another)."""

    def __init__(self, done: Any, timeout: float, staged: Any = None) -> None:
        self._done, self._staged, self._timeout = done, staged, timeout

    def wait_staged(self) -> None:
        if self._staged is not None:
            self._staged.result(timeout=self._timeout)

    def done(self) -> bool:
        return bool(self._done.done())

    def wait(self) -> dict[str, Any]:
        self._done.result(timeout=self._timeout)
        return {}


class Saver:
    """Saves the state to a fresh path each call; see the module doc."""

    def start(self, path: Path) -> Pending:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the saver holds (stagers, writer processes)."""


def pairs(state: dict[str, Any]) -> list[tuple[str, Any, str, Any]]:
    """(module key, module, optimizer key, optimizer) for every module of the state.

    ``model`` goes with ``optim``; any other module ``k`` with ``k + "_optim"``.
    """
    import torch

    out = []
    for k, v in state.items():
        if isinstance(v, torch.nn.Module):
            ok = "optim" if k == "model" else f"{k}_optim"
            out.append((k, v, ok, state[ok]))
    return out


def fqn_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """The state as DCP wants it: ``get_state_dict`` of each (module, optimizer) pair, plus the step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out: dict[str, Any] = {}
    for mk, model, ok, optim in pairs(state):
        out[mk], out[ok] = get_state_dict(model, optim)
    out["step"] = state["step"]
    return out


def set_fqn_state_dict(state: dict[str, Any], sd: dict[str, Any]) -> None:
    """Put a loaded :func:`fqn_state_dict` back into the live modules and optimizers."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    for mk, model, ok, optim in pairs(state):
        set_state_dict(model, optim, model_state_dict=sd[mk], optim_state_dict=sd[ok])
    state["step"] = int(sd["step"])


# ---------------------------------------------------------------------------------------------
# torch.save


def _local_tree(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return local(obj)
    if isinstance(obj, dict):
        return {k: _local_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_local_tree(v) for v in obj]
    return obj


class TorchSave(Saver):
    """``torch.save`` of every module's and optimizer's state dict into one file, then fsync.

    One file per rank for sharded (FSDP) states, local shards only; a replicated (DDP) state is
    written by rank 0 alone, as DDP users do.
    """

    def __init__(self, state: dict[str, Any], ctx: Ctx) -> None:
        self.state, self.ctx = state, ctx

    def start(self, path: Path) -> Pending:
        import torch

        if self.ctx.layout == "ddp" and self.ctx.rank != 0:
            return Pending()
        sd: dict[str, Any] = {"step": self.state["step"]}
        for mk, model, ok, optim in pairs(self.state):
            sd[mk], sd[ok] = _local_tree(model.state_dict()), _local_tree(optim.state_dict())
        path.mkdir(parents=True, exist_ok=True)
        with (path / f"rank{self.ctx.rank}.pt").open("wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        return Pending()


def torch_loader(state: dict[str, Any], ctx: Ctx) -> Loader:
    """``torch.load(mmap=True, weights_only=True)`` and a copy into the live tensors."""
    import torch

    def load(path: Path) -> dict[str, Any]:
        t0 = time.perf_counter()
        rank = 0 if ctx.layout == "ddp" else ctx.rank
        loaded = torch.load(path / f"rank{rank}.pt", mmap=True, weights_only=True, map_location="cpu")
        with torch.no_grad():
            for mk, model, ok, optim in pairs(state):
                live = model.state_dict()
                for k, v in loaded[mk].items():
                    local(live[k]).copy_(v)
                live_o = optim.state_dict()  # references to the live state tensors
                for idx, saved in loaded[ok]["state"].items():
                    for k, v in saved.items():
                        dst = live_o["state"][idx][k]
                        if isinstance(v, torch.Tensor) and isinstance(dst, torch.Tensor):
                            local(dst).copy_(v)
                for g_live, g_saved in zip(optim.param_groups, loaded[ok]["param_groups"], strict=True):
                    g_live.update({k: v for k, v in g_saved.items() if k != "params"})
        state["step"] = loaded["step"]
        del loaded
        return {"load_s": time.perf_counter() - t0}

    return load


# ---------------------------------------------------------------------------------------------
# DCP


class DcpSave(Saver):
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def start(self, path: Path) -> Pending:
        from torch.distributed.checkpoint import state_dict_saver

        state_dict_saver.save(fqn_state_dict(self.state), checkpoint_id=str(path))
        return Pending()


class DcpAsync(Saver):
    """``dcp.async_save`` with the executor and stager of the method (see ``methods.py``)."""

    def __init__(self, state: dict[str, Any], ctx: Ctx, method: str) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.state, self.ctx = state, ctx
        self.kwargs: dict[str, Any] = {}
        if method in ("dcp_async_process", "dcp_async_process_shm"):
            self.kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        # StagingOptions(use_pinned_memory, use_shared_memory, use_async_staging, use_non_blocking_copy)
        options = {
            "dcp_async_stager": StagingOptions(False, False, False, False),
            "dcp_async_async_staging": StagingOptions(False, False, True, False),
            "dcp_async_process_shm": StagingOptions(False, True, False, False),
            "dcp_async_pinned": StagingOptions(True, False, True, True),
        }.get(method)
        self.stager = DefaultStager(options) if options is not None else None
        if self.stager is not None:
            self.kwargs["async_stager"] = self.stager

    def start(self, path: Path) -> Pending:
        from torch.distributed.checkpoint import state_dict_saver

        res = state_dict_saver.async_save(fqn_state_dict(self.state), checkpoint_id=str(path), **self.kwargs)
        # An AsyncSaveResponse (staging + upload futures) with async staging, else a Future.
        staged = getattr(res, "staging_completion", None)
        return FuturePending(getattr(res, "upload_completion", res), self.ctx.op_timeout, staged)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def dcp_loader(state: dict[str, Any]) -> Loader:
    def load(path: Path) -> dict[str, Any]:
        from torch.distributed.checkpoint import state_dict_loader

        t0 = time.perf_counter()
        sd = fqn_state_dict(state)
        sd["step"] = -1
        state_dict_loader.load(sd, checkpoint_id=str(path))
        t1 = time.perf_counter()
        set_fqn_state_dict(state, sd)
        t2 = time.perf_counter()
        return {"load_s": t2 - t0, "set_state_dict_s": t2 - t1}

    return load


# ---------------------------------------------------------------------------------------------
# stashpoint


class StashPending(Pending):
    def __init__(self, handle: Any, timeout: float) -> None:
        self.handle, self.timeout = handle, timeout

    def wait_staged(self) -> None:
        self.handle.wait_staged(self.timeout)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        yield  # overlap mode's own step hooks hold the optimizer step back

    def done(self) -> bool:
        return bool(self.handle.done())

    def wait(self) -> dict[str, Any]:
        s = self.handle.wait(self.timeout)
        return {
            "lib_blocking_s": s.blocking_s,
            "lib_staging_s": s.staging_s,
            "lib_staged_s": s.staged_s,
            "lib_persist_s": s.persist_s,
            "lib_step_wait_s": s.step_wait_s,
            "lib_bytes_written": s.bytes_written,
            "lib_staging_allocations": _pool_allocations(),
        }


def _pool_allocations() -> int:
    """Fresh staging buffers stashpoint has allocated in this process so far."""
    from stashpoint._save import engine as _save

    return engine.pool.allocations if (engine := _save.current_engine()) is not None else 0


class StashSave(Saver):
    def __init__(self, state: dict[str, Any], ctx: Ctx, method: str) -> None:
        self.state, self.ctx = state, ctx
        self.kwargs: dict[str, Any] = {}
        if method == "stashpoint_overlap":
            self.kwargs["overlap"] = True
        if method == "stashpoint_process":
            self.kwargs["writer"] = "process"
        self.sync = method in ("stashpoint_save", "stashpoint_atomic")

    def start(self, path: Path) -> Pending:
        import stashpoint

        if self.sync:
            s = stashpoint.save(self.state, str(path))
            return Done({"lib_staging_s": s.staging_s, "lib_persist_s": s.persist_s})
        return StashPending(stashpoint.async_save(self.state, str(path), **self.kwargs), self.ctx.op_timeout)

    def close(self) -> None:
        from stashpoint._save import engine as _save

        _save.wait_all()


def stash_loader(state: dict[str, Any], atomic: bool = False) -> Loader:
    def load(path: Path) -> dict[str, Any]:
        import stashpoint

        t0 = time.perf_counter()
        stashpoint.load(state, str(path), atomic=atomic)
        return {"load_s": time.perf_counter() - t0}

    return load


# ---------------------------------------------------------------------------------------------
# the I/O floor (a reference, not a checkpoint)


def saved_bytes(state: dict[str, Any]) -> int:
    """The bytes this rank holds of what the savers save: every module's state dict (parameters
    and buffers) and its optimizer's state tensors (the MLP of the training loop included)."""
    import torch

    tensors: dict[int, Any] = {}
    for _, model, _, optim in pairs(state):
        for t in model.state_dict().values():
            tensors[local(t).data_ptr()] = local(t)
        for per_param in optim.state.values():
            for v in per_param.values():
                if isinstance(v, torch.Tensor):
                    tensors[local(v).data_ptr()] = local(v)
    return sum(t.numel() * t.element_size() for t in tensors.values())


class RawWrite(Saver):
    """A bare direct-I/O write of this rank's share of the state's bytes, on a thread (``os.write``
    releases the GIL): one reused, page-aligned 64 MiB buffer written again and again with
    ``O_DIRECT``, then fsync. No copy, no checksum, no Python work per tensor: what the bytes
    alone cost a training loop on this machine. A replicated (DDP) state's bytes are shared
    over the ranks, as the libraries that write them once do."""

    def __init__(self, state: dict[str, Any], ctx: Ctx) -> None:
        import concurrent.futures as cf

        from .disk import _buffer

        self.ctx = ctx
        nbytes = saved_bytes(state) // (ctx.world if ctx.layout == "ddp" else 1)
        self.nbytes = -(-nbytes // 4096) * 4096
        self.buf = _buffer()
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="io-floor")

    def start(self, path: Path) -> Pending:
        from .disk import _write

        path.mkdir(parents=True, exist_ok=True)
        future = self.pool.submit(_write, path / f"raw-{self.ctx.rank}.bin", self.nbytes, self.buf, True)
        return FuturePending(future, self.ctx.op_timeout)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.buf.close()


# ---------------------------------------------------------------------------------------------


def make_saver(method: str, state: dict[str, Any], ctx: Ctx) -> Saver:
    """The saver of ``method`` (any name of ``methods.METHODS``)."""
    if method == "torch_save":
        return TorchSave(state, ctx)
    if method == "io_floor":
        return RawWrite(state, ctx)
    if method == "dcp_save":
        return DcpSave(state)
    if method.startswith("dcp_async"):
        return DcpAsync(state, ctx, method)
    if method.startswith("stashpoint"):
        return StashSave(state, ctx, method)
    from . import peers

    return peers.make_saver(method, state, ctx)


def make_loader(method: str, state: dict[str, Any], ctx: Ctx) -> Loader | None:
    """The loader measured on ``method``'s checkpoints, or None if the method has no load row."""
    if method == "torch_save":
        return torch_loader(state, ctx)
    if method == "dcp_save":
        return dcp_loader(state)
    if method in ("stashpoint_save", "stashpoint_atomic"):
        return stash_loader(state, atomic=method == "stashpoint_atomic")
    from . import peers

    return peers.make_loader(method, state, ctx)
