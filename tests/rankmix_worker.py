"""One rank of tests/test_rank_mismatch.py (run by tests/dist_util.run_world as a real process):
ranks that make different stashpoint calls, open different checkpoints, or fail apart.

    python rankmix_worker.py SCENARIO ROOT   (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)

Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stashpoint

RANK = int(os.environ["RANK"])
TIMEOUT = 20.0  # a call that waits for a peer that never comes fails after this long


def result(**kw: object) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """What a call did: its result, or the class and message of what it raised, and how long it took."""
    t0 = time.monotonic()
    try:
        got = fn()
        out: dict[str, Any] = {"ok": True, "got": repr(got)[:200]}
    except Exception as e:
        out = {"ok": False, "error": type(e).__name__, "message": str(e)[:2000]}
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((64,), value), "n": int(value)}


def scenario_different_checkpoints(root: str) -> None:
    """Each rank given its own checkpoint to load (each picked its own newest): with and
    without the exchange of what every rank reads."""
    for v in (1, 2):
        stashpoint.save(_state(float(v)), f"{root}/ck{v}", timeout=TIMEOUT)
    out: dict[str, Any] = {}
    for exchange in (False, True):
        state = _state(0.0)
        out[f"exchange={exchange}"] = attempt(
            lambda s=state, e=exchange: stashpoint.load(s, f"{root}/ck{RANK + 1}", timeout=TIMEOUT, exchange=e)
        )
        out[f"exchange={exchange}"]["state"] = [float(state["w"][0]), state["n"]]
    state = _state(0.0)
    out["same"] = attempt(lambda: stashpoint.load(state, f"{root}/ck2", timeout=TIMEOUT))
    out["same"]["state"] = [float(state["w"][0]), state["n"]]
    result(**out)


def scenario_different_calls(root: str) -> None:
    """Rank 0 restores through its manager while rank 1 loads the step by its path; then both
    save in step."""
    run = Path(root, "run")
    with stashpoint.CheckpointManager(run, keep_last=None) as mgr:
        mgr.save(1, _state(1.0), timeout=TIMEOUT).wait()
        state = _state(0.0)
        if RANK == 0:
            out = attempt(lambda: mgr.restore(state, timeout=TIMEOUT))
        else:
            out = attempt(lambda: stashpoint.load(state, str(run / "step-00000001"), timeout=TIMEOUT))
        out["after"] = attempt(lambda: mgr.save(2, _state(2.0), timeout=TIMEOUT).wait())
    result(**out)


def scenario_exchange_given_on_one_rank(root: str) -> None:
    """``exchange=True`` on one rank and the default on the other."""
    stashpoint.save(_state(3.0), f"{root}/ck", timeout=TIMEOUT)
    state = _state(0.0)
    out = attempt(lambda: stashpoint.load(state, f"{root}/ck", timeout=TIMEOUT, exchange=True if RANK else None))
    result(**out, state=[float(state["w"][0]), state["n"]])


class _Refuses:
    """A user object whose ``load_state_dict`` refuses value 2 on rank 1 alone."""

    def __init__(self) -> None:
        self.v = 0

    def state_dict(self) -> dict[str, int]:
        return {"v": self.v}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        if RANK == 1 and sd["v"] == 2:
            raise RuntimeError("rank 1 cannot take v=2")
        self.v = sd["v"]


def scenario_object_fails_on_one_rank(root: str) -> None:
    """An object's own load_state_dict raises on rank 1 only: in a load, and in a manager's restore."""
    run = Path(root, "run")
    with stashpoint.CheckpointManager(run, keep_last=None) as mgr:
        for step in (1, 2):
            obj = _Refuses()
            obj.v = step
            mgr.save(step, {"w": torch.full((8,), float(step)), "obj": obj}, timeout=TIMEOUT).wait()
        state = {"w": torch.zeros(8), "obj": _Refuses()}
        out = {"load": attempt(lambda: stashpoint.load(state, str(run / "step-00000002"), timeout=TIMEOUT))}
        state = {"w": torch.zeros(8), "obj": _Refuses()}
        out["restore"] = attempt(lambda: mgr.restore(state, timeout=TIMEOUT))
        out["after"] = attempt(lambda: mgr.save(3, {"w": torch.ones(8), "obj": _Refuses()}, timeout=TIMEOUT).wait())
    result(**out)


def scenario_bad_argument_on_one_rank(root: str) -> None:
    """Rank 1 gives a save an argument it refuses; then both save in step, alone and through a manager."""
    state = _state(1.0)
    bad = {"max_shard_bytes": 0} if RANK == 1 else {}
    out = {"refused": attempt(lambda: stashpoint.save(state, f"{root}/b", timeout=TIMEOUT, **bad))}
    out["next"] = attempt(lambda: stashpoint.save(state, f"{root}/c", timeout=TIMEOUT))
    with stashpoint.CheckpointManager(Path(root, "run")) as mgr:
        bad = {"on_busy": "later"} if RANK == 1 else {}
        out["manager"] = attempt(lambda: mgr.save(1, state, timeout=TIMEOUT, **bad).wait())
        out["manager_next"] = attempt(lambda: mgr.save(2, state, timeout=TIMEOUT).wait())
    result(**out)


class _Frozen(collections.UserDict):
    """A container of the state's own that refuses new values on rank 1."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if RANK == 1 and getattr(self, "frozen", False):
            raise TypeError("config is frozen")
        super().__setitem__(key, value)


def scenario_plain_value_refused_on_one_rank(root: str) -> None:
    """Rank 1's state holds a container that refuses the plain value the load puts back."""
    stashpoint.save({"w": torch.ones(4), "cfg": {"lr": 1}}, f"{root}/ck", timeout=TIMEOUT)
    cfg = _Frozen(lr=0)
    cfg.frozen = True  # type: ignore[attr-defined]
    out = {"load": attempt(lambda: stashpoint.load({"w": torch.zeros(4), "cfg": cfg}, f"{root}/ck", timeout=TIMEOUT))}
    out["next"] = attempt(lambda: stashpoint.save({"w": torch.ones(4)}, f"{root}/next", timeout=TIMEOUT))
    result(**out)


def scenario_bad_argument_with_a_remote_tier(root: str) -> None:
    """Rank 1 refuses a manager's save for its arguments; the manager uploads to a remote tier."""
    state = _state(1.0)
    with stashpoint.CheckpointManager(Path(root, "run"), remote_root=Path(root, "remote")) as mgr:
        mgr.save(1, state, timeout=TIMEOUT).wait()
        bad = {"on_busy": "later"} if RANK == 1 else {}
        out = {"refused": attempt(lambda: mgr.save(2, state, timeout=TIMEOUT, **bad).wait())}
        for step in (3, 4):
            mgr.save(step, state, timeout=TIMEOUT).wait()
        out["wait"] = attempt(mgr.wait)
        out["remote"] = mgr.remote_steps()
    result(**out)


def scenario_late_to_a_load(root: str) -> None:
    """Rank 1 comes to a load after its timeout ran out on rank 0; then both save in step."""
    stashpoint.save(_state(1.0), f"{root}/a", timeout=TIMEOUT)
    if RANK == 1:
        time.sleep(8)
    out = {"late": attempt(lambda: stashpoint.load(_state(0.0), f"{root}/a", timeout=4))}
    out["next"] = attempt(lambda: stashpoint.save(_state(2.0), f"{root}/b", timeout=TIMEOUT))
    result(**out)


def scenario_manager_refused_on_one_rank(root: str) -> None:
    """Rank 1's CheckpointManager refuses its arguments (caught: the rank goes on) while rank 0's
    opens with preemption handling, whose group every rank creates."""
    import logging

    from stashpoint._dist import group

    group.DEFAULT_TIMEOUT_S = 8.0
    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("stashpoint").addHandler(handler)
    out = attempt(
        lambda: stashpoint.CheckpointManager(
            Path(root, "run"), keep_last=-1 if RANK == 1 else 2, preemption_deadline=5
        ).close()
    )
    if RANK == 1:
        time.sleep(10)  # alive, past rank 0's wait
    result(**out, warned=[w for w in warned if "has waited" in w])


def main() -> None:
    scenario, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    globals()["scenario_" + scenario](root)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
