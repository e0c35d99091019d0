"""What a run directory of a :class:`~stashpoint.CheckpointManager` holds: its steps, committed or
partial, and the names the manager did not write (which it ignores, and ``verify`` lists)."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from stashpoint._core.naming import LOCK_NAME, MANIFEST_NAME, REWIND_NAME, is_set_aside, parse_step_dir
from stashpoint._storage import LocalStorage, Storage
from stashpoint._storage.oserror import read_failed


@dataclass(frozen=True)
class RunContents:
    """The steps of a run directory (name, step), oldest first; the damaged steps the manager set
    aside; every other name in it."""

    steps: tuple[tuple[str, int], ...]
    set_aside: tuple[str, ...]
    foreign: tuple[str, ...]


def run_contents(root: Storage) -> RunContents | None:
    """What the run directory ``root`` holds, or None if it is no run directory: it holds a
    manifest (a checkpoint), or neither a step nor the manager's lock file."""
    if isinstance(root, LocalStorage):
        try:
            with os.scandir(root.root) as it:
                found = [(e.name, e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False)) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:  # a loop of links: the checkpoint's reading says so; unreadable: the fix named
            if e.errno == errno.ELOOP:
                return None
            raise read_failed(f"the directory {root.location}", e) from None
    else:
        found = [(n, True, False) for n in root.children()] + [(n, False, True) for n in root.list()]
    steps, aside, foreign, lock = [], [], [], False
    for name, is_dir, is_file in found:
        step = parse_step_dir(name) if is_dir else None
        if step is not None:
            steps.append((name, step))
        elif name == LOCK_NAME and is_file:
            lock = True
        elif name == REWIND_NAME and is_file:
            continue
        elif is_dir and is_set_aside(name):
            aside.append(name)
        else:
            foreign.append(name)
    if MANIFEST_NAME in foreign or not (steps or lock):
        return None
    return RunContents(tuple(sorted(steps, key=lambda s: s[1])), tuple(sorted(aside)), tuple(sorted(foreign)))
