"""One rank of tests/test_read_errors.py and tests/test_dist_mistakes.py (run by
tests/dist_util.run_world as a real process).

    python readerror_worker.py SCENARIO ROOT   (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)

The rank named by ``NO_DAC_RANK`` runs without the power to override file permissions: as root
(this project's test host) it drops ``CAP_DAC_OVERRIDE`` and ``CAP_DAC_READ_SEARCH`` from its
bounding set and starts itself again, so that a file of mode 000 is really unreadable to it,
as it is to any other user. Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import shutil
import sys
import time
from pathlib import Path
from typing import Any

RANK = int(os.environ["RANK"])
_PR_CAPBSET_DROP = 24
_DAC_CAPS = (1, 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH


def _without_dac_override() -> None:
    """Start this process again without the capabilities that let root read any file."""
    if os.environ.get("NO_DAC_RANK") != str(RANK) or os.environ.get("NO_DAC_DONE") or os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in _DAC_CAPS:
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")
    os.environ["NO_DAC_DONE"] = "1"
    os.execv(sys.executable, [sys.executable, *sys.argv])


_without_dac_override()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import stashpoint  # noqa: E402
from stashpoint._core.naming import step_dir  # noqa: E402


def _set_aside(root: str) -> list[str]:
    """The steps a manager set aside (damaged, or incomplete on the nodes) anywhere under ``root``."""
    return [p.name for p in Path(root).rglob("step-*") if ".damaged-" in p.name or ".incomplete-" in p.name]


def result(**kw: object) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def main() -> None:
    scenario, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    globals()["scenario_" + scenario](root)
    sys.stdout.flush()
    os._exit(0)  # no gloo teardown after DTensor collectives (tests/dist_worker.py says why)


def _state(value: float) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {"w": distribute_tensor(torch.full((8, 4), value), mesh, [Shard(0)]), "step": int(value)}


def _restore_after(root: str, spoil: str) -> None:
    """Steps 1 and 2 saved; then the last rank spoils its file of step 2 (``spoil``: its "shard"
    or "index", or the "manifest", made unreadable; "index-damage": a byte of its index flipped)
    and every rank restores."""
    with stashpoint.CheckpointManager(root, keep_last=None) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(float(step))).wait()
    dist.barrier()
    last = dist.get_world_size() - 1
    if spoil and last == RANK:
        prefix = {"shard": f"shard-r{RANK:05d}", "manifest": "manifest.json"}.get(spoil, f"index-r{RANK:05d}")
        mine = next(p for p in Path(root, step_dir(2)).rglob(f"{prefix}*"))
        if spoil == "index-damage":
            data = bytearray(mine.read_bytes())
            data[len(data) // 2] ^= 0x20
            mine.write_bytes(bytes(data))
        else:
            mine.chmod(0)
    dist.barrier()
    state = _state(0.0)
    out: dict = {}
    try:
        with stashpoint.CheckpointManager(root, keep_last=None) as mgr:
            out["step"] = mgr.restore(state)
        out["value"] = float(state["w"].to_local()[0, 0])
    except Exception as e:
        out["error"], out["message"] = type(e).__name__, str(e)
    dist.barrier()  # rank 0 sets damaged steps aside once its restore returned
    out["set_aside"] = sorted(p.name for p in Path(root).iterdir() if ".damaged-" in p.name or ".incomplete-" in p.name)
    result(**out)


def scenario_unreadable_shard(root: str) -> None:
    _restore_after(root, "shard")


def scenario_unreadable_index(root: str) -> None:
    _restore_after(root, "index")


def scenario_damaged_index(root: str) -> None:
    _restore_after(root, "index-damage")


def scenario_unreadable_manifest(root: str) -> None:
    """Read before any agreement: one rank failing there must not restore another step alone."""
    _restore_after(root, "manifest")


def _node_manager(root: str) -> stashpoint.CheckpointManager:
    os.environ["STASHPOINT_NODE"], os.environ["STASHPOINT_LOCAL_RANK"] = str(RANK), "0"  # a node per rank
    replicas = 1 if dist.get_world_size() > 1 else 0
    return stashpoint.CheckpointManager(Path(root, f"node-{RANK}"), node_local=True, replicas=replicas, keep_last=None)


def _two_steps_then_node_1_lost(root: str) -> None:
    """Steps 1 and 2 saved on two nodes with a replica each; then node 1 is lost with its disk."""
    import shutil

    with _node_manager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(float(step))).wait()
    dist.barrier()
    if RANK == 1:
        shutil.rmtree(Path(root, "node-1"))
    dist.barrier()


def scenario_node_replica_unreadable(root: str) -> None:
    """Two nodes with a replica each; node 1 is lost with its disk, and node 0 may not read its
    replica of node 1's shard: the restore raises on both, node 1 keeps no copy taken for whole,
    and once the file is readable again the restore loads the newest step."""
    os.environ["STASHPOINT_FETCH_MEMORY"] = "off"  # land on the disk, where a torn copy would stay
    _two_steps_then_node_1_lost(root)
    replica = next(Path(root, "node-0", step_dir(2)).rglob("shard-r00001*"))
    if RANK == 0:
        replica.chmod(0)
    dist.barrier()
    out: dict = {}
    for attempt in ("denied", "fixed"):
        state = _state(0.0)
        try:
            with _node_manager(root) as mgr:
                out[attempt] = [mgr.restore(state), float(state["w"].to_local()[0, 0])]
        except Exception as e:
            out[attempt] = [type(e).__name__, str(e)[:3000]]
        dist.barrier()
        if attempt == "denied" and RANK == 1:  # what landed of rank 1's files, if any, is known as partial
            landed = Path(root, "node-1", step_dir(2))
            shards = list(landed.glob("shard-r00001*")) if landed.is_dir() else []
            out["taken_for_whole"] = bool(shards) and not (landed / "partial-r00001").exists()
        if attempt == "denied" and RANK == 0:
            replica.chmod(0o644)
        out.setdefault("set_aside", []).extend(_set_aside(root))
        dist.barrier()
    result(**out)


def scenario_node_planning_out_of_memory(root: str) -> None:
    """Node 1 is lost; rank 1 runs out of memory planning what its load reads (injected: the
    planning raises MemoryError once): every rank raises, none waits out its timeout, and the
    next restore loads the newest step."""
    from stashpoint._manager import nodefetch

    _two_steps_then_node_1_lost(root)
    planned = nodefetch.writers_needed

    def short(*args: object, **kw: object) -> object:
        nodefetch.writers_needed = planned  # once
        raise MemoryError

    if RANK == 1:
        nodefetch.writers_needed = short
    out: dict = {}
    for attempt in ("short", "again"):
        t0 = time.monotonic()
        state = _state(0.0)
        try:
            with _node_manager(root) as mgr:
                out[attempt] = [mgr.restore(state), float(state["w"].to_local()[0, 0])]
        except Exception as e:
            out[attempt] = [type(e).__name__, isinstance(e, MemoryError), str(e)[:2000]]
        out[f"{attempt}_s"] = time.monotonic() - t0
        dist.barrier()
    result(**out)


def scenario_node_replicas_differ(root: str) -> None:
    """Node 0's manager keeps no replicas, node 1's one: refused at once on both (before: step 1
    committed, then node 1 waited for ever to send its copy and node 0 in the next save)."""
    os.environ["STASHPOINT_NODE"], os.environ["STASHPOINT_LOCAL_RANK"] = str(RANK), "0"
    t0 = time.monotonic()
    try:
        with stashpoint.CheckpointManager(Path(root, f"node-{RANK}"), node_local=True, replicas=RANK) as mgr:
            for step in (1, 2):
                mgr.save(step, _state(float(step))).wait()
        got = "saved"
    except stashpoint.CheckpointError as e:
        got = str(e)
    result(got=got, seconds=time.monotonic() - t0)


def scenario_preempted_while_opening(root: str) -> None:
    """Rank 1 ends (preempted) while the managers create their preemption group: rank 0 fails
    after stashpoint's timeout (8 s here), naming the cause; before, it waited 30 minutes."""
    from stashpoint._dist import group
    from stashpoint._manager import preemptgroup

    group.DEFAULT_TIMEOUT_S = 8.0
    if os.environ.get("LAZY"):  # as from 256 ranks: the group's creation waits for no rank
        from stashpoint._dist import gloo

        gloo.LAZY_FROM_RANKS = 1
    if RANK == 1:
        preemptgroup.gloo_group = lambda **kw: os._exit(0)
    t0 = time.monotonic()
    try:
        stashpoint.CheckpointManager(Path(root, "run"), preemption_deadline=5).close()
        got = "opened"
    except stashpoint.CheckpointError as e:
        got = f"{type(e).__name__}: {e}"
    result(got=got, seconds=time.monotonic() - t0)


def scenario_node_copy_damaged(root: str) -> None:
    """Two nodes without replicas; node 1's copy of step 2 is damaged (``SPOIL``: a byte of its
    manifest, or its shard deleted): both nodes restore step 1 and set step 2 aside as damaged,
    not as incomplete (which blamed a lost node and said to rename it back)."""
    os.environ["STASHPOINT_NODE"], os.environ["STASHPOINT_LOCAL_RANK"] = str(RANK), "0"

    def manager() -> stashpoint.CheckpointManager:
        return stashpoint.CheckpointManager(Path(root, f"node-{RANK}"), node_local=True, keep_last=None)

    with manager() as mgr:
        for step in (1, 2):
            mgr.save(step, _state(float(step))).wait()
    dist.barrier()
    if RANK == 1:
        at = Path(root, "node-1", step_dir(2))
        if os.environ["SPOIL"] == "manifest":
            data = bytearray((at / "manifest.json").read_bytes())
            data[len(data) // 2] ^= 1
            (at / "manifest.json").write_bytes(bytes(data))
        else:
            for shard in at.rglob("shard-r00001*"):
                shard.unlink()
    dist.barrier()
    state = _state(0.0)
    with manager() as mgr:
        got = [mgr.restore(state), float(state["w"].to_local()[0, 0])]
    dist.barrier()
    result(got=got, set_aside=_set_aside(root))


def scenario_node_manifest_unreadable(root: str) -> None:
    """One node whose newest manifest it may not read: an error, not an older step."""
    with _node_manager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(float(step))).wait()
    dist.barrier()
    if RANK == 0:
        Path(root, "node-0", step_dir(2), "manifest.json").chmod(0)
    dist.barrier()
    try:
        with _node_manager(root) as mgr:
            got: list = [mgr.restore(_state(0.0))]
    except Exception as e:
        got = [type(e).__name__, str(e)[:3000]]
    result(got=got)


def scenario_unshared_root(root: str) -> None:
    """Each rank's manager on a directory of its own, as on node-local disks without node_local."""
    out: dict = {}
    try:
        with stashpoint.CheckpointManager(Path(root, f"rank-{RANK}")) as mgr:
            mgr.save(1, _state(1.0))
        out["saved"] = True
    except stashpoint.CheckpointError as e:
        out["error"] = str(e)
    out["committed"] = sorted(p.parent.name for p in Path(root).rglob("manifest.json"))
    result(**out)


def scenario_restore_agrees(root: str) -> None:
    """Ranks whose roots hold different steps (rank 1's lacks step 2) restore the same step."""
    import shutil

    with stashpoint.CheckpointManager(Path(root, "shared"), keep_last=None) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(float(step))).wait()
    dist.barrier()
    mine = Path(root, f"rank-{RANK}")
    shutil.copytree(Path(root, "shared"), mine)
    if RANK == 1:
        shutil.rmtree(mine / step_dir(2))
    dist.barrier()
    state = _state(0.0)
    with stashpoint.CheckpointManager(mine, keep_last=None) as mgr:
        got = mgr.restore(state)
    result(step=got, value=float(state["w"].to_local()[0, 0]))


def scenario_wrong_group(root: str) -> None:
    """A group this rank is not in, and a DeviceMesh given as the process group."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    only_0 = dist.new_group([0])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for what, group in (("non_member", only_0), ("mesh", mesh)):
        if what == "non_member" and RANK == 0:
            continue
        try:
            stashpoint.save({"w": torch.ones(3)}, Path(root, f"{what}-{RANK}"), process_group=group)
            out[what] = "saved"
        except Exception as e:
            out[what] = f"{type(e).__name__}: {e}"
    result(**out)


def scenario_subgroups_then_world(root: str) -> None:
    """Ranks 0 and 1 in a group of their own (saving with it), rank 2 in none, then saves over
    the world: torch's name for a group made with use_local_synchronization counts the groups
    each process holds, which differ here."""
    pair = dist.new_group([0, 1])
    alone = dist.new_group([2])
    out: dict[str, object] = {}
    t0 = time.monotonic()
    try:
        if RANK < 2:
            stashpoint.save({"w": torch.full((3,), 1.0)}, Path(root, "pair"), process_group=pair, timeout=30)
        stashpoint.save({"w": torch.full((3,), 5.0)}, Path(root, "world"), timeout=30)
        if RANK == 2:
            stashpoint.save({"w": torch.ones(1)}, Path(root, "alone"), process_group=alone)
        if RANK < 2:
            stashpoint.save({"w": torch.full((3,), 2.0)}, Path(root, "pair2"), process_group=pair, timeout=30)
        target = {"w": torch.zeros(3)}
        stashpoint.load(target, Path(root, "world"), timeout=30)
        out["loaded"] = target["w"].tolist()
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - t0
    result(**out)


def scenario_manager_mismatches(root: str) -> None:
    """Ranks saving different steps with one manager, and ranks giving managers different roots."""
    out: dict[str, object] = {}
    with stashpoint.CheckpointManager(Path(root, "run")) as mgr:
        try:
            mgr.save(1 + RANK, _state(1.0)).wait()
        except stashpoint.CheckpointError as e:
            out["steps"] = str(e)
    try:
        with stashpoint.CheckpointManager(Path(root, f"own-{RANK}")) as mgr:
            mgr.save(1, _state(1.0)).wait()
    except stashpoint.CheckpointError as e:
        out["roots"] = str(e)
    result(**out)


def scenario_load_kinds(root: str) -> None:
    """One rank's load fails (its state does not fit; its path does not exist): the class raised
    on every rank."""
    stashpoint.save({"w": torch.ones(4)}, Path(root, "ck"))
    if RANK == 1:  # a copy whose save never committed
        shutil.copytree(Path(root, "ck"), Path(root, "uncommitted"))
        Path(root, "uncommitted", "manifest.json").unlink()
    dist.barrier()
    out = {}
    for case in ("mismatch", "missing", "incomplete", "mixed"):  # mixed: rank 0's state, rank 1's path
        state = {"w": torch.zeros(5 if (RANK == 1 and case == "mismatch") or (RANK == 0 and case == "mixed") else 4)}
        odd = RANK == 1 and case != "mismatch"
        path = Path(root, {"missing": "nowhere", "mixed": "nowhere"}.get(case, "uncommitted") if odd else "ck")
        try:
            stashpoint.load(state, path)
            out[case] = "loaded"
        except stashpoint.CheckpointError as e:
            out[case] = type(e).__name__
            if case == "mismatch":  # rank 0's, agreed, names the checkpoint and pickles as rank 1's does
                out["mismatch_path"] = Path(getattr(e, "path", "")).name
                out["mismatch_pickles"] = str(pickle.loads(pickle.dumps(e))) == str(e)
    result(**out)


def scenario_retention_unreadable(root: str) -> None:
    """keep_best: the best step's manifest cannot be read when a fresh manager applies retention."""
    run = Path(root, "run")
    with stashpoint.CheckpointManager(run, keep_last=1, keep_best=(1, "loss")) as mgr:
        mgr.save(1, _state(1.0), metrics={"loss": 0.1})
        mgr.save(2, _state(2.0), metrics={"loss": 0.5})
    Path(run, step_dir(1), "manifest.json").chmod(0)
    with stashpoint.CheckpointManager(run, keep_last=1, keep_best=(1, "loss")) as mgr:
        mgr.save(3, _state(3.0), metrics={"loss": 0.9})
    Path(run, step_dir(1), "manifest.json").chmod(0o644)
    with stashpoint.CheckpointManager(run, keep_last=1, keep_best=(1, "loss")) as mgr:
        result(steps=mgr.steps())


def scenario_unreadable_dir(root: str) -> None:
    """A checkpoint directory this process may not read, loaded; a manager whose root it may not make."""
    stashpoint.save(_state(3.0), Path(root, "ckpt"))
    Path(root, "ckpt").chmod(0)
    Path(root, "locked").mkdir(mode=0o500)
    out = {}
    for what, call in (
        ("load", lambda: stashpoint.load(_state(0.0), Path(root, "ckpt"))),
        ("manager", lambda: stashpoint.CheckpointManager(Path(root, "locked", "run"))),
    ):
        try:
            call()
            out[what] = "no error"
        except Exception as e:
            out[what] = f"{type(e).__name__}: {e}"
    Path(root, "ckpt").chmod(0o755)
    result(**out)


def scenario_rank0_only_save(root: str) -> None:
    """``if rank == 0: save(...)``, torch.save's idiom: rank 0 is told which ranks it waits for
    long before its timeout, then fails naming them."""
    import logging
    import time

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(f"{time.monotonic() - t0:.1f} s: {record.getMessage()}")

    logging.getLogger("stashpoint").addHandler(Keep(logging.WARNING))
    out: dict = {}
    for when in ("first", "later"):
        if when == "later":  # the group exists: rank 0 waits in a collective on it
            stashpoint.save({"w": torch.ones(3)}, Path(root, "both"))
            seen.clear()
        t0 = time.monotonic()
        if RANK == 0:
            try:
                stashpoint.save({"w": torch.ones(3)}, Path(root, when), timeout=8)
                out[when] = "no error"
            except Exception as e:
                out[when] = f"{type(e).__name__}: {e}"
            out[f"{when}_s"] = time.monotonic() - t0
            out[f"{when}_logged"] = list(seen)
        dist.barrier()
    result(**out)


def scenario_manifest_asked_once(root: str) -> None:
    """A manager on a shared root: how many times each rank asks for the step's manifest in a
    save (one per rank per save, 16,384 HEADs a save at that scale on S3), and a save of a step
    already there while this rank's answer lags (rank 1 sees no manifest: it once submitted the
    save while rank 0 refused it alone, and waited out the timeout)."""
    import time

    from stashpoint._core.naming import MANIFEST_NAME
    from stashpoint._storage import LocalStorage

    asked = [0]
    real = LocalStorage.exists

    def counted(self: LocalStorage, name: str | None = None) -> bool:
        if name == MANIFEST_NAME and "step-" in str(self.root):
            asked[0] += 1
            if RANK == 1 and os.environ.get("LAGGING"):
                return False
        return real(self, name)

    LocalStorage.exists = counted  # type: ignore[method-assign]
    out: dict = {"rank": RANK}
    with stashpoint.CheckpointManager(Path(root, "run"), keep_last=5) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.ones(4) * step}, timeout=30).wait()
        out["asked"] = asked[0]
        os.environ["LAGGING"] = "1"
        t0 = time.monotonic()
        out["raised_by"] = "save()"
        try:
            handle = mgr.save(2, {"w": torch.zeros(4)}, timeout=30)
            out["raised_by"] = "wait()"
            handle.wait()
            out["again"] = "no error"
        except Exception as e:
            out["again"] = f"{type(e).__name__}: {e}"
        out["again_s"] = time.monotonic() - t0
    result(**out)


def scenario_dies_of_an_exception(root: str) -> None:
    """Rank 1 ends on an exception nothing caught while rank 0 saves: its exit waited 60 s in
    the shutdown barrier of stashpoint's groups, and rank 0 in its save until then."""
    stashpoint.save({"w": torch.ones(4)}, Path(root, "a"))
    if RANK == 1:
        raise RuntimeError("a bug in rank 1's training step")
    t0 = time.monotonic()
    try:
        stashpoint.save({"w": torch.ones(4)}, Path(root, "b"), timeout=300)
        out = "no error"
    except Exception as e:
        out = f"{type(e).__name__}: {e}"
    result(error=out, took=time.monotonic() - t0)


def scenario_node_disk_full(root: str) -> None:
    """Node 1's disk is full when step 2 is written: every rank's error names node 1's directory
    (it named the save's path on the rank reporting it, node 0's on node 0)."""
    import errno

    from stashpoint._save import job

    with _node_manager(root) as mgr:
        mgr.save(1, {"w": torch.ones(1024) * RANK}).wait()
        if RANK == 1:

            def full(*args: Any, **kwargs: Any) -> Any:
                raise OSError(errno.ENOSPC, "No space left on device")

            job.write_shards = full  # type: ignore[assignment]
        try:
            mgr.save(2, {"w": torch.ones(1024) * RANK}).wait()
            out = "no error"
        except Exception as e:
            out = f"{type(e).__name__}: {e}"
    result(error=out)


def scenario_peer_gone_under_preemption(root: str) -> None:
    """With preemption on, every maybe_save asks the ranks for a signal; rank 1 ends after step 3
    (a preempted rank that reached no safe point in its deadline): rank 0's next maybe_save got
    gloo's own "Connection closed by peer" and a traceback through torch."""
    with stashpoint.CheckpointManager(Path(root, "run"), every_steps=100, preemption_deadline=10) as mgr:
        for step in range(1, 6):
            if step == 4 and RANK == 1:
                os._exit(0)
            try:
                mgr.maybe_save(step, {"w": torch.ones(4)})
            except Exception as e:
                result(error=f"{type(e).__name__}: {e}")
                os._exit(0)
            time.sleep(0.3)
    result(error="no error")


def scenario_destroyed_under_save(root: str) -> None:
    """The program destroys torch.distributed's groups while a background save is in flight,
    through ``dist.destroy_process_group()``, which waits for it."""
    _destroy_under_save(root, lambda: dist.destroy_process_group())  # looked up as a program calls it


def scenario_destroyed_bare_under_save(root: str) -> None:
    """The same through torch's own function (not stashpoint's wrapper), which does not wait:
    the save fails, naming the fix."""
    from torch.distributed import distributed_c10d

    def late_on_rank_1() -> None:  # a peer's teardown fails the collective here before this rank's own
        time.sleep(0.5 * distributed_c10d.get_rank())
        distributed_c10d.destroy_process_group()

    _destroy_under_save(root, late_on_rank_1)


def scenario_destroyed_under_upload(root: str) -> None:
    """A manager with a remote tier saves, and the program destroys the groups at once, without
    ``close()``: the save commits and so does its upload (it runs on stashpoint's own groups)."""
    mgr = stashpoint.CheckpointManager(Path(root, "run"), remote_root=Path(root, "remote"))
    mgr.save(1, {"w": torch.ones(16 << 20 >> 2)})
    dist.destroy_process_group()
    result(remote=(Path(root, "remote", "step-00000001", "manifest.json")).is_file())


def _destroy_under_save(root: str, destroy: Any) -> None:
    handle = stashpoint.async_save({"w": torch.ones(64 << 20 >> 2)}, Path(root, "ckpt"))
    destroy()
    try:
        handle.wait()
        out = "no error"
    except Exception as e:
        out = f"{type(e).__name__}: {e}"
    result(error=out)


def scenario_node_landing_unwritable(root: str) -> None:
    """Node 1 is lost and comes back with a directory it may not write (``LANDING_FAILS=dir``)
    or where a file may not grow past a byte, as under a quota (``=write``: ``RLIMIT_FSIZE``, so
    the writes fail part-way through the transfer): the fetch of its files from node 0's replica
    fails on both nodes as an error, not as damage, and once that is fixed the restore loads the
    newest step."""
    import resource
    import signal

    how = os.environ["LANDING_FAILS"]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), not the process
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    os.environ["STASHPOINT_FETCH_MEMORY"] = "off"  # land on the disk, in the directory refused
    _two_steps_then_node_1_lost(root)
    out: dict = {}
    for attempt in ("denied", "fixed"):
        state = _state(0.0)
        try:
            with _node_manager(root) as mgr:
                if RANK == 1 and attempt == "denied" and how == "dir":
                    Path(root, "node-1").chmod(0o555)
                if RANK == 1 and attempt == "denied" and how == "write":
                    resource.setrlimit(resource.RLIMIT_FSIZE, (1, limit[1]))
                out[attempt] = [mgr.restore(state), float(state["w"].to_local()[0, 0])]
        except Exception as e:
            out[attempt] = [type(e).__name__, str(e)[:3000]]
        if RANK == 1:
            Path(root, "node-1").chmod(0o755)
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        out.setdefault("set_aside", []).extend(_set_aside(root))
        dist.barrier()
    result(**out)


def scenario_verify_unreadable_shard(root: str) -> None:
    """verify() of a checkpoint one of whose shards this process may not read: listed, not raised."""
    stashpoint.save({"a": torch.ones(4), "b": torch.ones(4)}, Path(root, "ckpt"))
    next(Path(root, "ckpt").glob("shard-*")).chmod(0)
    try:
        report = stashpoint.verify(Path(root, "ckpt"))
        result(ok=report.ok, problems=report.problems)
    except Exception as e:
        result(raised=f"{type(e).__name__}: {e}")


def scenario_arrival_marks(root: str) -> None:
    """Which arrival marks a rank leaves in the job's store: none for collectives that end at
    once, its own for one that waits (rank 1 comes 2.5 s late)."""
    import time

    from stashpoint._dist import group
    from stashpoint._dist.arrival import store

    marks = store()
    for i in range(3):
        stashpoint.save({"w": torch.full((4,), float(i))}, Path(root, f"fast-{i}"))
    ctx = group.context()
    assert ctx is not None
    prefix = ctx._store_prefix()
    fast = [marks.check([f"{prefix}/{c}/{r}"]) for c in range(1, ctx.calls + 1) for r in range(2)]
    dist.barrier()
    if RANK == 1:
        time.sleep(2.5)
    import threading

    start, seen, done = ctx.calls + 1, [], threading.Event()

    def look() -> None:  # while rank 0 waits (its mark goes again two collectives later)
        while not done.is_set() and not seen:
            if any(marks.check([f"{prefix}/{c}/0"]) for c in range(start, start + 8)):
                seen.append(1)
            time.sleep(0.05)

    looking = threading.Thread(target=look)
    looking.start()
    stashpoint.save({"w": torch.ones(4)}, Path(root, "slow"))  # rank 0 waits for rank 1 in it
    done.set()
    looking.join()
    waited = bool(seen)
    dist.barrier()
    result(fast_marks=sum(fast), calls=ctx.calls, rank0_marked_while_waiting=waited)


def scenario_last_rank_skips_a_save(root: str) -> None:
    """The last rank skips one save (``if rank != last: save(...)``): rank 0 names it alone,
    though the others are done with the save's first collective and wait in the next."""
    import logging
    import time

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("stashpoint").addHandler(Keep(logging.WARNING))
    stashpoint.save({"w": torch.ones(3)}, Path(root, "all"))  # the group exists
    out: dict = {}
    if dist.get_world_size() - 1 != RANK:
        try:
            stashpoint.save({"w": torch.ones(3)}, Path(root, "skipped"), timeout=6)
            out["error"] = "no error"
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
    out["warnings"] = [m for m in seen if "has waited" in m]
    time.sleep(3)  # the others' failures reached every rank before any leaves
    result(**out)


if __name__ == "__main__":
    main()
