"""Constants, logging, files and the page cache, and the facts about the machine."""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GB = 1e9
COLD_SLEEP_S = 10.0  # memory freed >= 10 s ago is "cold" (benchmarks/README.md, page-cache regimes)


def log(msg: str, who: str = "bench") -> None:
    """One progress line on stderr (stdout carries the tables)."""
    rank = f" rank {os.environ['RANK']}" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    print(f"[{who}{rank} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def tree_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def files_of(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and every directory, ``path``'s parent included.

    Used after a library that does not fsync reports a save as finished, so that every
    method's "until durable" means the same thing.
    """
    dirs = {path.parent}
    for f in files_of(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dirs.add(f.parent)
    if path.is_dir():
        dirs.update(p for p in path.rglob("*") if p.is_dir())
        dirs.add(path)
    for d in dirs:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict_cache(path: Path) -> None:
    """Drop this checkpoint's pages from the page cache (fsync, then POSIX_FADV_DONTNEED).

    Touches no other file. Pages of a file written with direct I/O are not cached anyway.
    """
    for f in files_of(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def default_scratch_base() -> Path:
    """A temp folder on the same filesystem as the repository (so the disk measured is its disk)."""
    dev = REPO.stat().st_dev
    for cand in (Path("/var/tmp"), Path(tempfile.gettempdir()), Path("/tmp")):
        try:
            if cand.is_dir() and os.access(cand, os.W_OK) and cand.stat().st_dev == dev:
                return cand
        except OSError:
            continue
    return REPO / "benchmarks" / "out" / "scratch"


def git_commit() -> str:
    """The checkout's short commit, with "+dirty" when src/ has uncommitted changes."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def read_sys(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """CPUs, memory, platform and load average: enough to tell whether a run was on a quiet machine."""
    import psutil

    return {
        "cpus": os.cpu_count(),
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg": os.getloadavg(),
        "transparent_hugepage": read_sys("/sys/kernel/mm/transparent_hugepage/enabled"),
    }


def versions() -> dict[str, str]:
    """torch, stashpoint and the peers' versions (those installed)."""
    from importlib import metadata

    out: dict[str, str] = {}
    for dist in ("torch", "stashpoint", "torchsnapshot", "torch-checkpointing", "accelerate"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out
