"""A program whose saves meet a Ctrl-C or a fork while they are written (slowed down: each
fsync waits ``SLOW`` seconds), printing what it saw as one JSON line.

    python lifecycle_worker.py CASE ROOT
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch

import stashpoint

SLOW = 0.5
_fsync = os.fsync
syncing = threading.Event()


def slow_fsync(fd: int) -> None:
    if "shard-" in os.readlink(f"/proc/self/fd/{fd}"):
        syncing.set()
    time.sleep(SLOW)
    _fsync(fd)


def ctrl_c_after(seconds: float, event: threading.Event | None = None) -> None:
    """A real SIGINT to the main thread (the one Python raises KeyboardInterrupt in), once
    ``event`` is set (a shard's fsync began) and ``seconds`` more have passed."""
    main = threading.main_thread().ident
    assert main is not None

    def interrupt() -> None:
        if event is not None:
            event.wait(30)
        time.sleep(seconds)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()


STATE = {"w": torch.arange(1 << 20, dtype=torch.float32)}


def close_interrupted(root: str) -> dict:
    out: dict = {}
    mgr = stashpoint.CheckpointManager(root)
    mgr.save(1, STATE).wait()
    os.fsync = slow_fsync
    mgr.save(2, STATE)
    try:
        ctrl_c_after(0.2)
        mgr.close()
        out["interrupted"] = False
    except KeyboardInterrupt:
        out["interrupted"] = True
    try:
        stashpoint.CheckpointManager(root).close()
        out["second"] = "opened"
    except stashpoint.CheckpointError as e:
        out["second"] = str(e)
    mgr.close()
    with stashpoint.CheckpointManager(root) as again:
        out["steps"] = again.steps()
    return out


def save_interrupted(root: str) -> dict:
    os.fsync = slow_fsync
    try:
        ctrl_c_after(0.1, syncing)  # the save is being written: the call waits for it
        stashpoint.save(STATE, f"{root}/ck")
        return {"interrupted": False}
    except KeyboardInterrupt:
        stashpoint.shutdown()  # the program's exit would wait for it too
        return {"interrupted": True, "committed": os.path.exists(f"{root}/ck/manifest.json")}


def forked(root: str) -> dict:
    """A child forked while the manager's save is written: what its copies of the manager and
    the handle do (before: wait() and close() waited for ever, and save() wrote into the
    parent's root without its lock), and which of the parent's files it holds open."""
    os.fsync = slow_fsync
    mgr = stashpoint.CheckpointManager(root, keep_last=1)
    handle = mgr.save(1, STATE)
    assert syncing.wait(30)  # the shard is written, its fsync under way: the file is open
    reply_r, reply_w = os.pipe()
    go_r, go_w = os.pipe()
    held, forked_now = threading.Event(), threading.Event()

    def hold_the_managers_lock() -> None:  # as its bookkeeping thread may at the fork
        with mgr._lock:
            held.set()
            forked_now.wait(30)

    threading.Thread(target=hold_the_managers_lock, daemon=True).start()
    assert held.wait(30)
    pid = os.fork()
    forked_now.set()
    if pid == 0:
        seen = {}
        for what, call in (
            ("handle_wait", lambda: handle.wait(timeout=5)),
            ("mgr_wait", mgr.wait),
            ("mgr_save", lambda: mgr.save(2, STATE)),
        ):
            try:
                call()
                seen[what] = "returned"
            except Exception as e:
                seen[what] = f"{type(e).__name__}: {e}"
        start = time.monotonic()
        mgr.close()  # the end of a with block: returns, the parent's saves are the parent's
        seen["close_s"] = time.monotonic() - start
        os.write(reply_w, json.dumps(seen).encode() + b"\n")
        os.read(go_r, 1)  # held until the parent looked at this process's files
        os._exit(0)
    child = json.loads(os.fdopen(reply_r).readline())
    os.fsync = _fsync
    handle.wait()
    for step in (2, 3):
        mgr.save(step, STATE).wait()
    mgr.close()
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if root in target:
            held.append(target)
    os.write(go_w, b"x")
    _, status = os.waitpid(pid, 0)
    return {"child": child, "held": held, "exit": os.waitstatus_to_exitcode(status), "steps": os.listdir(root)}


if __name__ == "__main__":
    case, root = sys.argv[1], sys.argv[2]
    cases = {"close_interrupted": close_interrupted, "save_interrupted": save_interrupted, "forked": forked}
    print(json.dumps(cases[case](root)), flush=True)
