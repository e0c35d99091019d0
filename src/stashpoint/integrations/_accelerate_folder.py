"""Accelerate's automatic checkpoint naming under stashpoint: ``project_dir/checkpoints/
checkpoint_<n>``, what a save there may replace, and ``total_limit``'s retention."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stashpoint._core.naming import MANIFEST_NAME, is_group_dir, written_by_a_save
from stashpoint._storage import storage_for, user_path

if TYPE_CHECKING:
    from accelerate import Accelerator

log = logging.getLogger("stashpoint")


def checkpoints(accelerator: Accelerator) -> Path:
    """Where Accelerate's automatic checkpoint naming puts them; a clear error without it."""
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming or not config.project_dir:
        raise ValueError(
            "give the checkpoint's path, or set ProjectConfiguration(project_dir=..., "
            "automatic_checkpoint_naming=True) for checkpoints named project_dir/checkpoints/checkpoint_<n>"
        )
    if "://" in str(config.project_dir):  # pathlib would fold s3://b/k into a local directory "s3:"
        raise ValueError(
            f"automatic checkpoint naming keeps checkpoints in a local project_dir, not {config.project_dir!r}: "
            "give save_state and load_state the checkpoint's URL (path=...), or a CheckpointManager with "
            "remote_root=... for a remote tier"
        )
    return Path(user_path(config.project_dir)) / "checkpoints"


def committed(folder: Path) -> list[int]:
    """The numbers of the committed ``checkpoint_<n>`` in ``folder``, oldest first."""
    found = []
    for entry in folder.glob("checkpoint_*") if folder.is_dir() else ():
        number = entry.name.removeprefix("checkpoint_")
        if number.isdigit() and (entry / MANIFEST_NAME).is_file():
            found.append(int(number))
    return sorted(found)


def held(step: Path) -> str | None:
    """What a ``checkpoint_<n>`` directory holds that a save there would replace: a committed
    checkpoint, or files that are no save's of stashpoint (Accelerate's own save_state's);
    None for nothing, or what a stashpoint save cut short left."""
    if (step / MANIFEST_NAME).is_file():
        return "a committed checkpoint"
    try:
        foreign = [p.name for p in step.iterdir() if not _a_saves(p)]
    except OSError:
        return None
    shown = ", ".join(sorted(foreign)[:3]) + (", ..." if len(foreign) > 3 else "")
    return f"files of another kind ({shown})" if foreign else None


def accelerates_own(step: str | os.PathLike[str]) -> str | None:
    """The files of ``Accelerator.save_state``'s own checkpoint in the local directory ``step``
    (it always writes ``random_states_<process>.pkl``), shown; None where there are none."""
    if not isinstance(step, (str, os.PathLike)) or "://" in str(step):  # a URL, a Storage given
        return None
    try:
        where = Path(user_path(step))
        names = sorted(p.name for p in where.iterdir()) if where.is_dir() else []
    except OSError:
        return None
    if not any(n.startswith("random_states_") and n.endswith(".pkl") for n in names):
        return None
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def only_accelerates_own(path: str | os.PathLike[str]) -> str | None:
    """:func:`accelerates_own`, where no stashpoint checkpoint is beside them (one is loaded)."""
    own = accelerates_own(path)  # None for anything not a local path
    return own if own and not (Path(user_path(path)) / MANIFEST_NAME).exists() else None


def none_to_load(folder: Path) -> str:
    """Why load_state found nothing to load in the automatic naming's ``folder``."""
    names = sorted(p.name for p in folder.glob("checkpoint_*")) if folder.is_dir() else []
    own = [name for name in names if accelerates_own(folder / name)]
    why = f" ({', '.join(own[:3])} hold Accelerator.save_state's own: use accelerator.load_state)" if own else ""
    return f"{folder} holds no committed checkpoint_<n> to load{why}"


def _a_saves(entry: Path) -> bool:
    """Whether ``entry`` of a step directory is what a stashpoint save writes there (a group
    directory of ranks' files included), or what one cut short leaves."""
    if is_group_dir(entry.name) and entry.is_dir() and not entry.is_symlink():
        return all(written_by_a_save(f"{entry.name}/{f.name}") for f in entry.iterdir())
    return written_by_a_save(entry.name)


def keep_newest(folder: Path, limit: int, saved: int) -> None:
    """Delete the oldest committed checkpoints beyond ``limit`` after ``checkpoint_<saved>``
    committed, among those numbered below it: never that one, nor an earlier run's numbered
    above it (which a later save of this run is refused over, on every process alike)."""
    found = committed(folder)
    older = [n for n in found if n < saved]
    for n in older[: max(0, len(found) - limit)]:
        try:
            storage_for(folder / f"checkpoint_{n}").remove_tree()
        except OSError as e:  # best effort, as a retention
            log.warning("stashpoint: could not delete %s: %s", folder / f"checkpoint_{n}", e)


def then(saved: cf.Future[Any], folder: Path, limit: int, number: int) -> cf.Future[Any]:
    """``saved``'s outcome, once the oldest checkpoints beyond ``limit`` went after its commit
    (``checkpoint_<number>``, the one saved, stays)."""
    done: cf.Future[Any] = cf.Future()

    def finish(f: cf.Future[Any]) -> None:
        error = f.exception()
        if error is not None:
            done.set_exception(error)
            return
        keep_newest(folder, limit, number)
        done.set_result(f.result())

    saved.add_done_callback(finish)
    return done
