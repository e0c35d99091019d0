"""The writer process itself, and the framing both ends of its socket use.

Started by ``_writerproc`` as ``python -c BOOT PACKAGE_DIR FD PARENT_PID NICE``: the bootstrap
registers ``stashpoint`` as a bare package (its ``__init__`` is not run), so only this module,
``_shardio`` and ``_storage`` are imported — no torch. The process then serves one request at a
time over the Unix socket ``FD`` until the parent closes it, and exits as soon as its parent is
gone (a watchdog thread checks the parent's pid, so a parent killed in the middle of a write
leaves no orphan).

Framing, parent to child: ``b"F"`` with one file descriptor attached (``SCM_RIGHTS``), or
``b"J"`` + 8-byte little-endian length + a JSON document; the file descriptors sent before a
document belong to it. Child to parent: ``b"J"`` frames only. Requests:

- ``{"op": "write", "storage": DESCRIPTION, "token": T, "new": [[T, SIZE, RESIDENT], ...],
  "forget": [...], "block": N, "writes": [ShardWrite.to_wire(), ...]}`` — map the new regions
  (one descriptor each, in order; the first RESIDENT bytes of each hold its pages), unmap the
  forgotten ones, write the files from region ``T``; the answer is
  ``{"ok": true, "sums": {key: [checksums]}}`` or ``{"ok": false, "type", "error", "traceback"}``,
  after ``{"op": "progress", "bytes": N}`` at most every ``PROGRESS_INTERVAL_S`` while bytes are
  written or files made durable (the parent gives up on a writer that stays silent too long);
- ``{"op": "forget", "forget": [...]}`` — unmap regions whose memory the parent freed (no answer);
- ``{"op": "ping"}`` — answered with ``{"ok": true, "pid": PID}``.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from stashpoint._save.shardio import ShardWrite, write_files
from stashpoint._storage import LocalStorage, Storage

_LEN = struct.Struct("<Q")
MAX_DOC = 1 << 30  # a request's JSON (headers included); far beyond any real plan
WATCH_INTERVAL_S = 0.2
PROGRESS_INTERVAL_S = 1.0
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_POPULATE_READ = 22  # MADV_POPULATE_READ (Linux 5.14+; not in Python's mmap module)


class ProtocolError(ConnectionError):
    """The other end sent something that is not a frame of this protocol."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError(f"the socket closed after {got} of {n} bytes of a frame")
        got += k
    return bytes(buf)


def send_msg(sock: socket.socket, doc: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    """Send ``doc`` (JSON), after one ``b"F"`` frame per file descriptor in ``fds``."""
    for fd in fds:
        socket.send_fds(sock, [b"F"], [fd])
    body = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    sock.sendall(b"J" + _LEN.pack(len(body)) + body)


def recv_msg(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next document and the descriptors sent before it; ``(None, [])`` at a clean end
    of the stream (the other end closed between messages)."""
    fds: list[int] = []
    while True:
        kind, got, _, _ = socket.recv_fds(sock, 1, 1)
        if not kind:
            for fd in fds:
                os.close(fd)
            if fds:
                raise EOFError("the socket closed between a file descriptor and its message")
            return None, []
        if kind == b"F":
            fds.extend(got)
            continue
        for fd in got:  # descriptors only travel with b"F"
            os.close(fd)
        if kind != b"J":
            raise ProtocolError(f"unexpected frame kind {kind!r} on the writer socket")
        (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
        if n > MAX_DOC:
            raise ProtocolError(f"a frame of {n} bytes on the writer socket (at most {MAX_DOC})")
        doc = json.loads(_recv_exact(sock, n))
        if not isinstance(doc, dict):
            raise ProtocolError(f"a frame holding a {type(doc).__name__}, not a JSON object")
        return doc, fds


def storage_from(desc: Mapping[str, Any]) -> Storage:
    """Re-create a storage from ``_writerproc.describe``'s description."""
    kind = desc.get("kind")
    if kind == "local":
        streams = int(desc.get("write_streams", 2))
        return LocalStorage(str(desc["root"]), direct_io=bool(desc["direct_io"]), write_streams=streams)
    if kind == "s3":
        for k, v in dict(desc.get("env", {})).items():  # the parent's AWS_* at the time of the save
            os.environ[str(k)] = str(v)
        for k in [k for k in os.environ if k.startswith("AWS_") and k not in desc.get("env", {})]:
            del os.environ[k]
        from stashpoint._storage.s3 import S3Storage  # imports torch (through _format): only for S3 saves
        from stashpoint._storage.s3config import S3Options

        return S3Storage(str(desc["url"]), S3Options(**desc["options"]))
    raise ValueError(f"the writer process cannot open a storage described as {dict(desc)!r}")


def map_region(fd: int, size: int, resident: int) -> mmap.mmap:
    """Map a staging region of ``size`` bytes whose first ``resident`` bytes hold its pages.

    Those are populated in one pass instead of a fault per page. The rest (given back by the
    training process, ``SharedRegion.trim``) is left alone: populating it would allocate it again.
    """
    if resident >= size:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if resident > 0:
        try:
            mm.madvise(_POPULATE_READ, 0, -(-resident // mmap.PAGESIZE) * mmap.PAGESIZE)
        except (OSError, ValueError):  # before Linux 5.14: the pages are mapped on first use instead
            pass
    return mm


class _Reporter:
    """Tells the parent, at most every ``PROGRESS_INTERVAL_S``, that a write moves on.

    Only progress is reported, never a heartbeat: a write stuck in the storage (a hung mount)
    must look to the parent like a stopped process does.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.bytes = 0
        self.events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stashpoint-progress", daemon=True)

    def add(self, n: int) -> None:
        self.bytes += n  # a lost update under a race only delays a report
        self.events += 1

    def _run(self) -> None:
        sent = 0
        while not self._stop.wait(PROGRESS_INTERVAL_S):
            if self.events != sent:
                sent = self.events
                try:
                    send_msg(self.sock, {"op": "progress", "bytes": self.bytes})
                except OSError:  # the parent is gone; the main thread finds out
                    return

    def __enter__(self) -> _Reporter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()  # before the answer goes out: whole frames only on the socket


def _write(msg: Mapping[str, Any], regions: Mapping[int, mmap.mmap], sock: socket.socket) -> dict[str, Any]:
    try:
        storage = storage_from(msg["storage"])
        token = int(msg["token"])
        if token not in regions:
            raise ProtocolError(f"staging region {token} was never sent to this writer process")
        writes = [ShardWrite.from_wire(w) for w in msg["writes"]]
        with _Reporter(sock) as reporter:
            sums = write_files(
                storage, writes, memoryview(regions[token]), block=int(msg["block"]), progress=reporter.add
            )
        return {"ok": True, "sums": {k: list(v) for k, v in sums.items()}}
    except Exception as e:
        # a storage's error (a full disk) says all in its message, as on the writer thread: the
        # traceback, a screenful in the log at every failed save, only for what is not one
        trace = "" if isinstance(e, OSError) and not isinstance(e, ProtocolError) else traceback.format_exc()
        return {"ok": False, "type": type(e).__name__, "error": str(e), "traceback": trace}


def _watch_parent(ppid: int) -> None:
    while os.getppid() == ppid:
        time.sleep(WATCH_INTERVAL_S)
    os._exit(3)  # the parent is gone (maybe mid-write): nobody will commit what we write


def serve(sock: socket.socket) -> None:
    """Answer requests until the parent closes the socket."""
    regions: dict[int, mmap.mmap] = {}
    while True:
        msg, fds = recv_msg(sock)
        if msg is None:
            return
        for t in msg.get("forget", ()):
            regions.pop(int(t), None)  # unmapped once no view of it is left
        new = msg.get("new", [])
        if len(new) != len(fds):
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"{len(fds)} descriptors came with {len(new)} new regions")
        failed = None
        for (token, size, *resident), fd in zip(new, fds):
            try:
                regions[int(token)] = map_region(fd, int(size), int(resident[0]) if resident else int(size))
            except OSError as e:  # e.g. out of address space: this request fails, the process lives on
                failed = {"ok": False, "type": type(e).__name__, "error": f"mapping the staging memory: {e}"}
                failed["traceback"] = traceback.format_exc()
            finally:
                os.close(fd)  # the mapping keeps the memory alive
        op = msg.get("op")
        if op == "forget":
            continue
        if op == "write":
            send_msg(sock, failed or _write(msg, regions, sock))
        elif op == "ping":
            send_msg(sock, {"ok": True, "pid": os.getpid()})
        else:
            send_msg(sock, {"ok": False, "type": "ProtocolError", "error": f"unknown op {op!r}", "traceback": ""})


def main(fd: int, ppid: int, nice: int = 0) -> None:
    """The writer process: serve the parent on socket ``fd`` while the process ``ppid`` lives,
    at scheduling priority ``nice`` (added to the inherited one)."""
    sock = socket.socket(fileno=fd)
    if os.getppid() != ppid:
        return  # the parent died before we got here
    # A scheduler's SIGTERM or a Ctrl-C reaches the whole process group: the parent decides what
    # happens (a preemption save needs this process), and its socket closing ends this one.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if nice:
        try:
            os.nice(nice)
        except OSError as e:
            print(f"stashpoint writer process {os.getpid()}: could not lower its priority: {e}", file=sys.stderr)
    threading.Thread(target=_watch_parent, args=(ppid,), name="stashpoint-parent-watch", daemon=True).start()
    try:
        serve(sock)
    except (EOFError, ConnectionError) as e:  # the parent went away mid-message
        print(f"stashpoint writer process {os.getpid()}: {e}", file=sys.stderr)
    finally:
        sock.close()


#: How ``_writerproc`` starts this module without importing torch (argv: package dir, fd, ppid, nice).
BOOT = (
    "import sys\n"
    # Python 3.10 has no -P: the working directory, first on sys.path, must not shadow the stdlib
    "if sys.path and sys.path[0] == '': del sys.path[0]\n"
    "import types\n"
    "pkg = types.ModuleType('stashpoint')\n"
    "pkg.__path__ = [sys.argv[1]]\n"
    "sys.modules['stashpoint'] = pkg\n"
    "from stashpoint._save.writerchild import main\n"
    "main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))\n"
)
