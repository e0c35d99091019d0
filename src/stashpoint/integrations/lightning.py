"""PyTorch Lightning: checkpoints saved by stashpoint, switched on with one line.

.. code-block:: python

    from stashpoint.integrations.lightning import StashpointCheckpointIO

    trainer = Trainer(plugins=[StashpointCheckpointIO()], callbacks=[ModelCheckpoint(...)])

Lightning builds its checkpoint dict (weights, optimizer and scheduler states, loops, callbacks,
hyper-parameters) and hands it to the plugin, which stages it and returns: the write, checksums,
fsync and atomic commit run in the background while training goes on. Each ``.ckpt`` path
becomes a stashpoint checkpoint directory. ``ModelCheckpoint`` (``save_top_k``, ``save_last``,
``every_n_train_steps``) and ``Trainer.fit(ckpt_path="last")`` work as with ``torch.save``.

A later save, a load, a removal of the checkpoint being written and ``teardown()`` first wait
for the save in flight; a background failure is raised there, with its cause. Under DDP Lightning
saves on rank 0 alone, and the plugin saves without any collective; every rank loads.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

try:
    from lightning.fabric.plugins import CheckpointIO
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "stashpoint.integrations.lightning needs PyTorch Lightning 2.x: pip install 'stashpoint[lightning]'"
    ) from e

from stashpoint._dist.group import LOCAL
from stashpoint._load.read import read
from stashpoint._save.engine import DEFAULT_MAX_SHARD_BYTES, async_save
from stashpoint._save.handle import SaveHandle
from stashpoint._storage import storage_for
from stashpoint.errors import CheckpointError

__all__ = ["StashpointCheckpointIO", "load_from_checkpoint"]

log = logging.getLogger("stashpoint")


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
        self._pending: SaveHandle | None = None
        self._pending_path: str | None = None
        self._aside: Path | None = None  # a torch.save file at the path being saved, until it commits

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` and return; it is written to ``path`` (a directory) in the background."""
        if storage_options is not None:
            raise TypeError(
                f"StashpointCheckpointIO.save_checkpoint takes no storage_options (got {storage_options!r}); "
                "configure the plugin's constructor instead"
            )
        self.wait()
        target = os.fspath(path)
        if "://" not in target:
            where = Path(target)
            # ModelCheckpoint(save_last="link") links last.ckpt to it as soon as this returns
            where.absolute().parent.mkdir(parents=True, exist_ok=True)
            if where.is_file() and not where.is_symlink():
                # Lightning's own torch.save file at a path it saves again (last.ckpt): replaced,
                # as its own plugin would write over it, once the new one committed
                log.warning("stashpoint: replacing the torch.save checkpoint %s by a stashpoint checkpoint", target)
                self._aside = where.with_name(f"{where.name}.torch-save-{os.getpid()}")
                where.rename(self._aside)
        try:
            self._pending = async_save(
                checkpoint,
                target,
                overwrite=True,  # Lightning saves last.ckpt again and again at one path
                allow_pickle=self.allow_pickle,
                metadata={"framework": "lightning", **self.metadata},
                max_shard_bytes=self.max_shard_bytes,
                process_group=LOCAL,
                writer=self.writer,
            )
        except BaseException:
            self._put_back(target)
            raise
        self._pending_path = target

    def _put_back(self, target: str) -> None:
        """The torch.save file set aside for a save that failed goes back to its path."""
        aside, self._aside = self._aside, None
        if aside is not None:
            with contextlib.suppress(OSError):
                Path(target).rmdir()  # an uncommitted save's empty directory, if any
            with contextlib.suppress(OSError):
                aside.rename(target)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The checkpoint at ``path`` as the dict Lightning saved (tensors on ``map_location``
        when it names a device, else on the CPU; Lightning moves them where they belong).
        Accepts ``map_location`` positionally (older Lightning) or by keyword, and the newer
        keywords (``weights_only``, ``state``): the checkpoint is returned for Lightning to apply."""
        self.wait()
        target = os.fspath(path)
        if "://" not in target and Path(target).is_file():
            raise CheckpointError(
                f"{target} is a file, as Lightning's own plugin writes them (torch.save), not a stashpoint checkpoint: "
                f"convert it once with `python -m stashpoint import {target} {target}.stashpoint` and resume with "
                f'ckpt_path="{target}.stashpoint"'
            )
        device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
        out = read(target, device=device, allow_pickle=self.allow_pickle)
        if not isinstance(out, dict):
            raise CheckpointError(f"{os.fspath(path)} holds a {type(out).__name__}, not a Lightning checkpoint dict")
        return out

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (waiting first if it is the one being written)."""
        target = os.fspath(path)
        if self._pending is not None and self._pending_path == target:
            self.wait()
        storage_for(target).remove_tree()

    def teardown(self) -> None:
        """Wait for the save in flight (raising its failure, if any)."""
        self.wait()

    def wait(self) -> None:
        """Block until the save in flight is committed; raise :class:`CheckpointError` if it failed."""
        handle, self._pending = self._pending, None
        if handle is None:
            return
        try:
            handle.wait(self.timeout)
        except BaseException:
            if self._pending_path is not None:
                self._put_back(self._pending_path)
            raise
        aside, self._aside = self._aside, None
        if aside is not None:  # the new checkpoint committed: the torch.save file it replaced goes
            with contextlib.suppress(OSError):
                aside.unlink()


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
    checkpoint = read(os.fspath(path), device=device, allow_pickle=allow_pickle)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{os.fspath(path)} holds a {type(checkpoint).__name__}, not a Lightning checkpoint dict")
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if not issubclass(cls, LightningModule):
        return _load_state(cls, checkpoint, **kwargs)
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)
    return model.to(device) if isinstance(model, LightningModule) else model
