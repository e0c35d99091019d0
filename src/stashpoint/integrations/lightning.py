"""PyTorch Lightning: checkpoints saved by stashpoint, switched on with one line.

.. code-block:: python

    from stashpoint.integrations.lightning import StashpointCheckpointIO

    trainer = Trainer(plugins=[StashpointCheckpointIO()], callbacks=[ModelCheckpoint(...)])

Lightning builds its checkpoint dict (weights, optimizer and scheduler states, loops, callbacks,
hyper-parameters) and hands it to the plugin, which stages it and returns: the write, checksums,
fsync and atomic commit run in the background while training goes on. Each ``.ckpt`` path
becomes a stashpoint checkpoint directory. ``ModelCheckpoint`` (``save_top_k``, ``save_last``,
``every_n_train_steps``) and ``Trainer.fit(ckpt_path="last")`` work as with ``torch.save``.

Two saves may be in flight (``ModelCheckpoint`` saves a top-k checkpoint and ``last.ckpt`` back
to back); a third save, a load and ``teardown()`` first wait for them, and a background failure
is raised there, with its cause. A checkpoint Lightning removes while a save is in flight (the
top-k one it replaces) goes only once that save has committed, so a crash in between still
leaves a committed checkpoint; a ``last.ckpt`` link (``save_last="link"``) to one that never
committed loads the newest committed checkpoint beside it, with a warning. Under DDP Lightning
saves on rank 0 alone, and the plugin saves without any collective; every rank loads.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

try:
    from lightning.fabric.plugins import CheckpointIO
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "stashpoint.integrations.lightning needs PyTorch Lightning 2.x: pip install 'stashpoint[lightning]'"
    ) from e

from stashpoint._core.naming import MANIFEST_NAME, looks_like_shard
from stashpoint._core.policy import seconds_or_none
from stashpoint._dist.group import LOCAL
from stashpoint._load.manifest import read_summary
from stashpoint._load.read import read
from stashpoint._save.engine import get_engine
from stashpoint._save.handle import SaveHandle
from stashpoint._save.options import DEFAULT_MAX_SHARD_BYTES, SaveOptions
from stashpoint._storage import storage_for, user_path
from stashpoint._storage.localwrite import make_root
from stashpoint.errors import CheckpointError, UnsupportedStateError

__all__ = ["StashpointCheckpointIO", "load_from_checkpoint"]

log = logging.getLogger("stashpoint")

_IN_FLIGHT = 2  # a top-k checkpoint and last.ckpt, saved back to back by ModelCheckpoint


@dataclass
class _Save:
    handle: SaveHandle
    path: str
    aside: Path | None  # a torch.save file at the path, deleted once the save commits
    doomed: list[str] = field(default_factory=list)  # removed by Lightning after it: go once it commits
    kept: list[str] = field(default_factory=list)  # those, when it failed
    ended: bool = False


class StashpointCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves with :func:`stashpoint.async_save` and loads
    with :func:`stashpoint.read`.

    Args:
        allow_pickle: values of the checkpoint dict that are not tensors, numbers, strings,
            ``None`` or containers of them (custom objects in ``hyper_parameters``, a callback's
            state) fail the save with an error naming their keys; ``True`` pickles them instead,
            and loading then unpickles them (only for checkpoints you trust).
        timeout: seconds a save may wait for the previous one (default: as long as it takes).
        writer: ``"thread"`` or ``"process"``, as in :func:`stashpoint.async_save`.
        max_shard_bytes: the largest data section of one shard file.
        metadata: strings stored in every checkpoint's manifest.
    """

    def __init__(
        self,
        *,
        allow_pickle: bool = False,
        timeout: float | None = None,
        writer: str = "thread",
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        self.timeout = timeout
        self.writer = writer
        self.max_shard_bytes = max_shard_bytes
        self.metadata = dict(metadata or {})
        self._options()  # refused here, not at the first save (with last.ckpt moved aside)
        seconds_or_none("timeout", timeout, zero=True)  # 0: a save never waits for the previous one
        self._saves: list[_Save] = []
        self._lock = threading.RLock()  # the saves' doomed lists, also used on the engine's thread

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` and return; it is written to ``path`` (a directory) in the background."""
        if storage_options is not None:
            raise TypeError(
                f"StashpointCheckpointIO.save_checkpoint takes no storage_options (got {storage_options!r}); "
                "configure the plugin's constructor instead"
            )
        target = user_path(path)
        storage = storage_for(target)  # a path refused (a URL pathlib folded) before any directory is made
        self._settle_done()
        with self._lock:  # saved again: not to be deleted once an earlier save commits
            for save in self._saves:
                save.doomed = [d for d in save.doomed if d != target]
        same = [i for i, s in enumerate(self._saves) if s.path == target]
        if same:  # the same path again (last.ckpt): the saves up to its previous one first
            self._settle(keep=len(self._saves) - 1 - same[-1])
        self._settle(keep=_IN_FLIGHT - 1)
        opts = self._options()
        aside = None
        if "://" not in target:
            where = Path(target)
            where.absolute().parent.mkdir(parents=True, exist_ok=True)
            if where.is_file() and not where.is_symlink():
                # Lightning's own torch.save file at a path it saves again (last.ckpt): replaced,
                # as its own plugin would write over it, once the new one committed
                log.warning("stashpoint: replacing the torch.save checkpoint %s by a stashpoint checkpoint", target)
                aside = where.with_name(f"{where.name}.torch-save-{os.getpid()}")
                where.rename(aside)
        try:
            if "://" not in target and not os.path.lexists(target):
                # ModelCheckpoint(save_last="link") links last.ckpt to it as soon as this returns,
                # and a resume drops a link to nothing: the directory exists from now on (durably)
                make_root(Path(target))
            handle = get_engine().submit(checkpoint, storage, opts)
        except UnsupportedStateError as e:
            _put_back(target, aside)
            if self.allow_pickle:
                raise
            raise UnsupportedStateError(
                str(e).replace("pass allow_pickle=True", "pass StashpointCheckpointIO(allow_pickle=True)", 1)
            ) from None
        except BaseException:
            _put_back(target, aside)
            raise
        save = _Save(handle, target, aside)
        self._saves.append(save)
        handle._future.add_done_callback(lambda _: self._ended(save))

    def _ended(self, save: _Save) -> None:
        """As soon as a save ends (on the engine's thread; again, harmlessly, when it is settled):
        once it committed, the checkpoints Lightning removed after it go, while a crash would
        leave them for good; if it failed, they are kept."""
        with self._lock:
            save.ended = True
            doomed, save.doomed = save.doomed, []
            if save.handle._future.exception() is not None:
                save.kept += doomed
                return
            for path in doomed:
                try:
                    storage_for(path).remove_tree()
                except Exception as e:
                    log.warning("stashpoint: could not remove %s: %s", path, e)

    def _options(self) -> SaveOptions:
        return SaveOptions(
            overwrite=True,  # Lightning saves last.ckpt again and again at one path
            allow_pickle=self.allow_pickle,
            metadata={"framework": "lightning", **self.metadata},
            max_shard_bytes=self.max_shard_bytes,
            process_group=LOCAL,
            writer=self.writer,
            max_inflight=_IN_FLIGHT,
        )

    def load_checkpoint(self, path: Any, map_location: Any | None = None, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The checkpoint at ``path`` as the dict Lightning saved (tensors on ``map_location``
        when it names a device, else on the CPU; Lightning moves them where they belong).
        Accepts ``map_location`` positionally (older Lightning) or by keyword, and the newer
        keywords (``weights_only``, ``state``): the checkpoint is returned for Lightning to apply."""
        self.wait()
        return _read_checkpoint(_through_link(user_path(path)), map_location, self.allow_pickle)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path``: once the saves in flight have committed (Lightning
        removes the checkpoint a new one replaces as soon as the new one is staged), or at once
        when none is (waiting first if it is the one being written)."""
        target = user_path(path)
        self._settle_done()
        with self._lock:
            newest = self._saves[-1] if self._saves else None
            if newest is not None and newest.path != target:  # goes once the newest save committed
                if not newest.ended:
                    newest.doomed.append(target)
                    return
                if newest.handle._future.exception() is not None:
                    newest.kept.append(target)  # it failed: nothing committed in its stead
                    return
        if newest is not None and newest.path == target:
            self.wait()  # the checkpoint being written: removed once it is
        storage_for(target).remove_tree()

    def teardown(self) -> None:
        """Wait for the saves in flight (raising the first failure, if any)."""
        self.wait()

    def wait(self) -> None:
        """Block until the saves in flight are committed (and the checkpoints removed meanwhile
        deleted); raise :class:`CheckpointError` if one failed."""
        self._settle(keep=0)

    def _settle_done(self) -> None:
        """Settle the saves at the head of the queue that have ended, without waiting."""
        ended = 0
        for save in self._saves:
            if not save.handle.done():
                break
            ended += 1
        if ended:
            self._settle(keep=len(self._saves) - ended)

    def _settle(self, keep: int) -> None:
        """Wait for the oldest saves in flight until at most ``keep`` remain: put back what each
        that failed replaced (what each that committed replaced went as it committed, _ended).
        A wait that times out (or is interrupted) leaves its save in flight, tracked."""
        first: Exception | None = None
        while len(self._saves) > keep:
            save = self._saves[0]
            failed: Exception | None = None
            try:
                save.handle.wait(self.timeout)
            except Exception as e:
                if not save.handle.done():  # timed out: still running
                    raise
                failed = e if save.handle._future.exception() is not None else None  # else committed just then
            self._saves.pop(0)
            self._ended(save)  # its callback may not have run yet: the future wakes waiters first
            if failed is None:
                if save.aside is not None:  # the new checkpoint committed: the torch.save file it replaced goes
                    with contextlib.suppress(OSError):
                        save.aside.unlink()
                continue
            _put_back(save.path, save.aside)
            with self._lock:
                kept, save.kept = save.kept + save.doomed, []
            if kept:  # nothing committed in their stead
                log.warning(
                    "stashpoint: keeping %s, which Lightning removed: the save that replaced them failed",
                    ", ".join(kept),
                )
            first = first or failed
        if first is not None:
            raise first


def _read_checkpoint(target: str, map_location: Any, allow_pickle: bool) -> dict[str, Any]:
    """The Lightning checkpoint dict at ``target`` (a file given in its place named for what it is)."""
    if "://" not in target and Path(target).is_file():
        if (Path(target).parent / MANIFEST_NAME).is_file():
            raise CheckpointError(
                f"{target} is a file inside the stashpoint checkpoint {Path(target).parent}: give that directory"
            )
        raise CheckpointError(
            f"{target} is a file, as Lightning's own plugin writes them (torch.save), not a stashpoint checkpoint: "
            f"convert it once with `python -m stashpoint import {target} {target}.stashpoint` and resume with "
            f'ckpt_path="{target}.stashpoint"'
        )
    device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
    out = read(target, device=device, allow_pickle=allow_pickle)
    if not isinstance(out, dict):
        raise CheckpointError(f"{target} holds a {type(out).__name__}, not a Lightning checkpoint dict")
    for state in out.get("lr_schedulers") or ():
        _milestones_counted(state)
    return out


def _milestones_counted(state: Any) -> None:
    """A scheduler's state as read (no live object to take types from): a MultiStepLR's
    ``milestones`` a ``Counter`` again (its ``step(epoch)`` calls ``milestones.elements()``), in
    the schedulers a SequentialLR or ChainedScheduler holds too. Only a state shaped as torch's
    MultiStepLR's: a user's scheduler with a dict of milestones keeps its dict (a Counter's 0 for
    a missing key would change its learning rate)."""
    if not isinstance(state, dict):
        return
    milestones = state.get("milestones")
    if (
        isinstance(milestones, dict)
        and {"gamma", "base_lrs", "last_epoch"} <= state.keys()
        and all(type(k) is int and type(v) is int and v > 0 for k, v in milestones.items())
    ):
        state["milestones"] = collections.Counter(milestones)
    for inner in state.get("_schedulers") or ():
        _milestones_counted(inner)


def _through_link(target: str) -> str:
    """``target``, or where it is Lightning's ``last.ckpt`` that never committed, the run having
    stopped while writing it (the first ``save_last=True`` save; or the checkpoint directory a
    ``save_last="link"`` link points to, made as soon as a save is staged): the newest committed
    checkpoint beside it, with a warning."""
    link = Path(target)
    if "://" in target or not link.name.startswith("last"):  # Lightning's rule
        return target
    pointed = link.resolve() if link.is_symlink() else link
    if not pointed.is_dir() or (pointed / MANIFEST_NAME).exists():
        return target  # a file or a checkpoint: the load says what it is
    try:  # only what a save cut short leaves (another format's directory: the load names it)
        names = [p.name for p in pointed.iterdir()]
        if not all(looks_like_shard(n) or n.startswith(f".{MANIFEST_NAME}") for n in names):
            return target
    except OSError:
        return target
    try:
        found = [
            p
            for p in pointed.parent.iterdir()
            if p.suffix == pointed.suffix and p != pointed and not p.is_symlink() and (p / MANIFEST_NAME).is_file()
        ]
    except OSError:
        return target
    beside = [(when, p) for p in found if (when := _created(p)) is not None]
    if not beside:
        return target
    newest = max(beside)[1]
    what = f"{target} links to {pointed}, which" if pointed != link else target
    log.warning(
        "stashpoint: %s holds no committed checkpoint (the run stopped while writing it): loading %s, the newest "
        "committed checkpoint beside it",
        what,
        newest,
    )
    return str(newest)


def _created(ckpt: Path) -> str | None:
    """When ``ckpt`` was saved, as its sealed manifest says (a copy or a download keeps it, not
    the files' times; UTC, so later sorts later); None where it cannot be read."""
    try:
        return str(read_summary(storage_for(ckpt))["created"])
    except (OSError, CheckpointError):
        return None


def _put_back(target: str, aside: Path | None) -> None:
    """After a save that failed: the torch.save file it was to replace goes back to its path.
    (Otherwise its empty directory stays: a last.ckpt link may point to it, and a resume through
    that link then loads the newest committed checkpoint beside it.)"""
    if aside is None:
        return
    with contextlib.suppress(OSError):
        Path(target).rmdir()  # only if empty
    with contextlib.suppress(OSError):
        aside.rename(target)


with contextlib.suppress(ImportError):  # the standalone pytorch_lightning package checks its own base class
    from lightning_fabric.plugins import CheckpointIO as _StandaloneCheckpointIO

    _StandaloneCheckpointIO.register(StashpointCheckpointIO)


def load_from_checkpoint(
    cls: type[Any],
    path: str | os.PathLike[str],
    *,
    map_location: Any = None,
    strict: bool = True,
    allow_pickle: bool = False,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path)`` for a checkpoint written by
    :class:`StashpointCheckpointIO` (Lightning's reads the path with ``torch.load``, which a
    directory is not): a new ``cls`` (a ``LightningModule`` or ``LightningDataModule``) built from
    the saved hyper-parameters (``kwargs`` override them), with the saved weights on
    ``map_location`` (a device; default: the CPU).

    .. code-block:: python

        model = load_from_checkpoint(Regressor, "ckpts/last.ckpt")
    """
    from lightning.pytorch import LightningModule
    from lightning.pytorch.core.saving import _load_state

    device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
    checkpoint = _read_checkpoint(os.fspath(path), device, allow_pickle)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if not issubclass(cls, LightningModule):
        return _load_state(cls, checkpoint, **kwargs)
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)
    return model.to(device) if isinstance(model, LightningModule) else model
