"""The writer process: the heavy part of every persist, outside the training process.

With ``writer="process"`` a save's writer thread still plans, runs the collectives, agrees and
commits (all small), but hands the writing of this rank's shard files — the I/O and the
checksums — to one persistent child process. The child maps the staging memory itself (the
buffers are ``memfd`` shared memory, see ``_staging``) and receives only small JSON requests:
no tensor byte is copied or pickled, and the training process's GIL is not taken for the
persist at all.

Life cycle:

- started on first use, from the writer thread, as a fresh interpreter (``subprocess``, never a
  ``fork`` of the training process, which may hold CUDA and threads) that imports no torch
  (``_writerchild``): a few MiB and a few tens of milliseconds;
- reused by every later save of the process; each staging buffer's descriptor is sent once, and
  the child is told to unmap a buffer when the training process frees it;
- it runs at the training process's priority, lowered by ``STASHPOINT_WRITER_NICE`` (default 0);
- if it dies (killed, out of memory), the save it was writing fails with a ``CheckpointError``
  (nothing is committed; the writer thread removes the partial files) and the next save starts
  a new one; so does a save during which it writes nothing for ``STASHPOINT_WRITER_STALL_S``
  (stopped, or its storage hangs): it is killed first;
- stopped by ``stashpoint.shutdown()`` and at interpreter exit (the socket is closed, the child exits); when the
  training process dies instead, the child sees its socket close or its parent change and exits;
- a ``fork`` of the training process (a ``DataLoader`` worker) drops its inherited copy.

A storage the child cannot re-create from a description — anything but the built-in local and
S3 backends, e.g. a test's fault-injecting subclass — is written on the writer thread instead
(logged at debug level), as is a save without shared staging memory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stashpoint import _runtime
from stashpoint._save import staging as _staging
from stashpoint._save.shardio import ShardWrite
from stashpoint._save.staging import StagingBuffers
from stashpoint._save.writerchild import BOOT, recv_msg, send_msg
from stashpoint._storage import LocalStorage, Storage
from stashpoint.errors import CheckpointError

log = logging.getLogger("stashpoint")

PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)  # the stashpoint package
WRITERS = ("thread", "process")
CLOSE_TIMEOUT_S = 10.0
NICE_ENV = "STASHPOINT_WRITER_NICE"
DEFAULT_NICE = 0
STALL_ENV = "STASHPOINT_WRITER_STALL_S"
DEFAULT_STALL_S = 300.0
REAP_TIMEOUT_S = 10.0


def writer_nice() -> int:
    """How much lower than the training process's the writer process's priority is (``nice``).

    ``STASHPOINT_WRITER_NICE`` (0 to 19), read when a writer process starts. Default 0: the same
    priority as training, so a checkpoint is durable as soon as the disk allows. A higher value
    makes the writer yield a core the training threads want (it still runs at once on an idle
    one): steadier steps on a busy CPU, later durability (docs/TRAINING.md, "Writer process").
    """
    text = os.environ.get(NICE_ENV, "").strip()
    if not text:
        return DEFAULT_NICE
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ValueError(f"{NICE_ENV}={text!r} must be a whole number from 0 (same priority as training) to 19")
    return value


def writer_stall_s() -> float | None:
    """How long a writer process may write nothing in the middle of a save, in seconds.

    ``STASHPOINT_WRITER_STALL_S``, read at each save; default 300. Past it the writer process is
    taken for stopped or stuck in its storage: it is killed and the save fails, so that the next
    save can go on. The child reports every byte written and every file made durable, so a slow
    disk is not a stall. 0 waits forever.
    """
    text = os.environ.get(STALL_ENV, "").strip()
    if not text:
        return DEFAULT_STALL_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(f"{STALL_ENV}={text!r} must be a number of seconds (0 waits forever)")
    return value or None


def describe(storage: Storage) -> dict[str, Any] | None:
    """What the writer process needs to open ``storage`` itself, or None if it cannot.

    Only the built-in backends qualify, and only exactly them: a subclass may change what a
    write does (fault injection, instrumentation), which a re-created base object would not.
    """
    if type(storage) is LocalStorage:
        root, direct, streams = str(storage.root.absolute()), storage.direct_io, storage.write_streams
        return {"kind": "local", "root": root, "direct_io": direct, "write_streams": streams}
    s3 = sys.modules.get("stashpoint._storage.s3")
    if s3 is not None and type(storage) is getattr(s3, "S3Storage", None):
        s3_storage: Any = storage
        options = s3_storage.options
        if options is None or not dataclasses.is_dataclass(options) or isinstance(options, type):
            return None
        env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        return {"kind": "s3", "url": str(s3_storage.url), "options": dataclasses.asdict(options), "env": env}
    return None


def _how_it_ended(rc: int | None) -> str:
    if rc is None:
        return "stopped answering"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"was killed by {name}"
    return f"exited with code {rc}"


class WriterProcess:
    """One running writer process and the parent's end of its socket."""

    def __init__(self) -> None:
        nice = writer_nice()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        flags = ["-P"] if sys.version_info >= (3, 11) else []  # no script directory on sys.path
        argv = [sys.executable, *flags, "-c", BOOT, PACKAGE_DIR, str(child.fileno()), str(os.getpid()), str(nice)]
        try:
            # a session of its own: a group's SIGTERM or Ctrl-C never reaches it, not even while it
            # starts, before it ignores them (the parent decides; its socket closing ends this one)
            self.proc = subprocess.Popen(
                argv,
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.sock = parent
        self.pid = self.proc.pid
        self.owner = os.getpid()
        self.broken: str | None = None
        self._mapped: set[int] = set()  # regions whose descriptor this child has
        self._request = threading.Lock()  # one write at a time
        self._send = threading.Lock()  # whole messages on the socket
        log.debug("stashpoint: started the writer process (pid %d, nice +%d)", self.pid, nice)

    def usable(self) -> bool:
        return self.broken is None and self.owner == os.getpid() and self.proc.poll() is None

    def _forgotten(self) -> list[int]:
        """Regions this child maps that the training process has freed since the last message."""
        done = _staging.freed[:]
        del _staging.freed[: len(done)]
        gone = [t for t in done if t in self._mapped]
        self._mapped.difference_update(gone)
        return gone

    def forget_freed(self) -> None:
        """Tell the child to unmap the regions freed since the last message (no answer)."""
        with self._send:
            gone = self._forgotten()
            if gone and self.usable():
                try:
                    send_msg(self.sock, {"op": "forget", "forget": gone})
                except OSError as e:  # maybe part of a frame went out: the protocol cannot go on
                    self.broken = f"telling it to unmap freed buffers failed: {e}"
                    log.debug("stashpoint: telling the writer process to unmap freed buffers failed: %s", e)

    def write(
        self, desc: dict[str, Any], location: str, writes: Sequence[ShardWrite], staged: StagingBuffers, *, block: int
    ) -> dict[str, tuple[str, ...]]:
        """Write ``writes`` from ``staged`` in the child; the block checksums by key."""
        region = staged.region
        if region is None:
            raise ValueError("the writer process needs shared staging memory")
        stall = writer_stall_s()
        with self._request:
            if not self.usable():
                raise self._dead(location, "it was no longer running when this save started")
            msg: dict[str, Any] = {
                "op": "write",
                "storage": desc,
                "token": region.token,
                "block": block,
                "writes": [w.to_wire() for w in writes],
            }
            fds: list[int] = []
            new: list[list[int]] = []
            if region.token not in self._mapped:
                fds, new = [region.fd], [[region.token, region.nbytes, region.resident]]
            msg["new"] = new
            try:
                with self._send:
                    self.sock.settimeout(stall)  # each send and receive: a stopped child cannot block either
                    msg["forget"] = self._forgotten()
                    send_msg(self.sock, msg, fds)
                    self._mapped.add(region.token)
                reply = self._answer()
            except TimeoutError:
                cause = f"it wrote nothing for {stall:g} s, stopped or stuck in its storage, and was killed; "
                raise self._dead(location, cause + f"{STALL_ENV} sets how long to wait", kill=True) from None
            except (OSError, EOFError, ValueError) as e:  # ConnectionError and ProtocolError are OSErrors
                raise self._dead(location, f"{type(e).__name__}: {e}") from e
            if reply is None:
                raise self._dead(location, "its socket closed")
            if not reply.get("ok"):
                with self._send:  # send the descriptor again next time, in case mapping it failed
                    self._mapped.discard(region.token)
        if not reply.get("ok"):
            trace = str(reply.get("traceback") or "").rstrip()
            raise CheckpointError(
                f"writing the shards of {location} in the writer process (pid {self.pid}) failed: "
                f"{reply.get('type')}: {reply.get('error')}"
                + (f"\n\nThe writer process's traceback:\n{trace}" if trace else "")
            )
        return {str(k): tuple(str(s) for s in v) for k, v in reply["sums"].items()}

    def _answer(self) -> dict[str, Any] | None:
        """The child's answer to a write, its progress reports skipped."""
        while True:
            reply, fds = recv_msg(self.sock)
            for fd in fds:  # the child sends none
                os.close(fd)
            if reply is None or reply.get("op") != "progress":
                return reply

    def _reap(self) -> int | None:
        """Kill the child and wait for it; None if it does not end (stuck in the kernel)."""
        self.proc.kill()
        try:
            return self.proc.wait(timeout=REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("stashpoint: the writer process (pid %d) did not end after SIGKILL", self.pid)
            return None

    def _dead(self, location: str, cause: str, *, kill: bool = False) -> CheckpointError:
        """Mark this writer dead (reaping or killing the child) and describe what happened."""
        self.broken = cause
        if kill:
            rc = self._reap()
            ended = "stopped answering"
        else:
            try:
                rc = self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:  # alive but out of step: it cannot be trusted any more
                self._reap()
                rc = None
            ended = _how_it_ended(rc)
        with self._send:  # never close the socket under a sender (its descriptor number could be reused)
            self.sock.close()
        return CheckpointError(
            f"the writer process (pid {self.pid}) {ended} while writing the shards of {location} "
            f"({cause}); nothing of this save is committed, and the next save starts a new writer process"
        )

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the child: close the socket (it exits at once when idle), kill it after ``timeout``."""
        self.broken = self.broken or "closed"
        with self._send:
            self.sock.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("stashpoint: the writer process (pid %d) did not exit; killing it", self.pid)
            self._reap()


_SLOT = "save.writer_process"
_start_lock = threading.Lock()


def _new_start_lock() -> None:  # a child forked while a thread held it would wait for ever
    global _start_lock
    _start_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_start_lock)


def _stop(w: WriterProcess) -> None:
    if w.owner == os.getpid():
        w.close()


def _close_copy(w: WriterProcess) -> None:
    w.sock.close()  # a forked child's copy only: the parent keeps talking to its writer


def get() -> WriterProcess:
    """The running writer process of this process, started (or restarted) as needed."""
    with _start_lock:
        w: WriterProcess | None = _runtime.peek(_SLOT)
        if w is not None and w.usable():
            return w
        if w is not None:
            _runtime.drop(_SLOT)
            if w.owner == os.getpid():
                w.close(timeout=2.0)
        _staging.report_freed = True
        return _runtime.slot(_SLOT, WriterProcess, close=_stop, order=20, after_fork=_close_copy)


def current_pid() -> int | None:
    """The pid of this process's writer process while it runs, else None."""
    w: WriterProcess | None = _runtime.peek(_SLOT)
    return w.pid if w is not None and w.usable() else None


def forget_freed() -> None:
    """Have the writer process (if running) unmap the staging buffers freed just now."""
    w: WriterProcess | None = _runtime.peek(_SLOT)
    if w is not None and w.usable():
        w.forget_freed()


@dataclass(frozen=True)
class ProcessWriter:
    """Writes one save's shard files in the writer process (``_persist.Writer``)."""

    description: dict[str, Any]

    def write(
        self, storage: Storage, writes: Sequence[ShardWrite], staged: StagingBuffers, *, block: int
    ) -> dict[str, tuple[str, ...]]:
        return get().write(self.description, storage.location, writes, staged, block=block)


def choose(writer: str, storage: Storage, staged: StagingBuffers) -> ProcessWriter | None:
    """The process writer for a save with option ``writer``, or None for the writer thread."""
    if writer == "thread":
        return None
    if staged.region is None:
        log.debug("stashpoint: no shared staging memory for %s; writing on the writer thread", storage.location)
        return None
    desc = describe(storage)
    if desc is None:
        log.debug(
            "stashpoint: the writer process cannot open %s (a %s, not a built-in backend); writing on the writer "
            "thread",
            storage.location,
            type(storage).__name__,
        )
        return None
    return ProcessWriter(desc)
