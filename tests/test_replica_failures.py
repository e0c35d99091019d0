"""Replicas when a node fails around them (issue 21, part 2): a node killed while the replicas
cross, a step whose copies could not be taken, and a replica that a node loss left as the last
copy. Real processes on a real gloo group, one per "node", each node with its own directory;
a node failure is a real SIGKILL, a lost node's directory is deleted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import stashpoint
from conftest import ROOT
from dist_util import rendezvous_store
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._core.nodeplan import Held, orphan_replicas
from stashpoint._manager.holdings import inventory, node_order
from stashpoint._manager.upload import rank_problem
from stashpoint._storage import LocalStorage

JOB = Path(__file__).with_name("replica_job.py")
pytestmark = pytest.mark.xdist_group("nodelocal")


def run(base: Path, dirs: list[str], *args: str, env: dict[int, dict[str, str]] | None = None) -> list[str]:
    """One process per entry of ``dirs``: rank i is node i, alone on it, keeping its files in
    ``base/node-<dirs[i]>``; each one's output."""
    store = rendezvous_store()
    procs = []
    for rank, d in enumerate(dirs):
        penv = {
            **os.environ,
            "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}",
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "RANK": str(rank),
            "WORLD_SIZE": str(len(dirs)),
            "STASHPOINT_NODE": str(rank),
            "STASHPOINT_LOCAL_RANK": "0",
            "STASHPOINT_FETCH_MEMORY": "off",
            "NODE_DIR": d,
            **(env or {}).get(rank, {}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(JOB), str(base), *args],
                env=penv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        return [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def lines(outs: list[str], key: str) -> list[str]:
    return [ln for out in outs for ln in out.splitlines() if ln.startswith(key)]


def restorable(base: Path, dirs: list[str]) -> list[int]:
    by_node = {i: inventory(LocalStorage(base / f"node-{d}")) for i, d in enumerate(dirs)}
    order, _ = node_order(by_node, [], None)
    return [s for s, tier in order if tier == "local"]


@pytest.mark.slow  # about 25 s
def test_a_node_killed_while_the_replicas_cross_leaves_the_step_committed_on_the_others(tmp_path):
    """Step 4 commits on all three nodes; node 2 is killed as its replica of it starts out. The
    survivors' save reports that the copies failed, but keeps the step: the job, restarted with
    a fresh process on every node, resumes at step 4."""
    nodes = ["a", "b", "c"]
    outs = run(tmp_path, nodes, "--steps", "2:4", "--timeout", "20", env={2: {"KILL_AT_REPLICA": "4"}})
    errors = lines(outs, "SAVE_ERROR 4")
    assert len(errors) == 2 and all("ReplicaError" in e and "committed on every node" in e for e in errors), outs
    # logged as it happened, for a loop that does not wait() for its saves
    assert all("stashpoint: the step at" in out for out in outs[:2]), outs
    for d in nodes:
        assert (tmp_path / f"node-{d}" / "step-00000004" / MANIFEST_NAME).is_file(), f"step 4 kept on node {d}"
    outs = run(tmp_path, nodes)
    assert sorted(lines(outs, "RESUMED")) == ["RESUMED 4 4000", "RESUMED 4 4001", "RESUMED 4 4002"], outs
    assert not list(tmp_path.glob("node-*/*damaged*")), "nothing set aside"


@pytest.mark.slow  # about 30 s
def test_a_step_whose_copies_failed_is_still_uploaded_to_the_remote_tier(tmp_path):
    """A replica that cannot be taken (node 1 killed as the copies of step 4 cross) leaves step 4
    committed on the nodes: the restarted job uploads it to the remote tier like any other step."""
    remote = tmp_path / "remote"
    outs = run(
        tmp_path, ["a", "b"], "--steps", "2:4", "--remote", str(remote), "--timeout", "20",
        env={1: {"KILL_AT_REPLICA": "4"}},
    )  # fmt: skip
    assert len(lines(outs, "SAVE_ERROR 4")) == 1, outs
    outs = run(tmp_path, ["a", "b"], "--remote", str(remote))
    assert sorted(lines(outs, "RESUMED")) == ["RESUMED 4 4000", "RESUMED 4 4001"], outs
    assert (remote / "step-00000004" / MANIFEST_NAME).is_file(), sorted(p.name for p in remote.iterdir())


def test_a_replica_left_as_the_last_copy_outlives_the_next_save(tmp_path):
    """Node a is lost with its directory; node b's replicas of a's files are then the only
    copies of them. The job restarts with a fresh node (numbered after b this time) and saves
    step 8, whose copies make older replicas go: step 6, which keep_last=3 keeps, must stay
    restorable."""
    outs = run(tmp_path, ["a", "b"], "--steps", "2:6")
    assert len(lines(outs, "SAVED 6")) == 2, outs
    for p in (tmp_path / "node-a").iterdir():
        subprocess.run(["rm", "-rf", str(p)], check=True)
    assert restorable(tmp_path, ["a", "b"]) == [6]
    outs = run(tmp_path, ["b", "a"], "--steps", "8:8")
    assert sorted(lines(outs, "RESUMED")) == ["RESUMED 6 6000", "RESUMED 6 6001"], outs
    assert len(lines(outs, "SAVED 8")) == 2, outs
    assert restorable(tmp_path, ["a", "b"]) == [8, 6]


def test_keep_last_keeps_the_newest_step_a_node_loss_spares_while_a_newer_ones_copies_failed(tmp_path):
    """keep_last=1: step 4's copies fail (node b killed as they cross), and node b is then lost
    with its directory. Before: the retention after step 4 deleted step 2, the only step whose
    files both nodes held, and the restarted job started from nothing."""
    outs = run(
        tmp_path, ["a", "b"], "--steps", "2:4", "--keep", "1", "--timeout", "20", env={1: {"KILL_AT_REPLICA": "4"}}
    )
    assert len(lines(outs, "SAVE_ERROR 4")) == 1, outs
    assert (tmp_path / "node-a" / "step-00000002" / "recoverable.json").is_file()
    shutil.rmtree(tmp_path / "node-b")
    outs = run(tmp_path, ["a", "b"], "--steps", "6:6", "--keep", "1")
    assert sorted(lines(outs, "RESUMED")) == ["RESUMED 2 2000", "RESUMED 2 2001"], outs
    assert len(lines(outs, "SAVED 6")) == 2, outs  # its copies made: step 6 the one kept now
    assert restorable(tmp_path, ["a", "b"]) == [6]


def test_a_preempted_jobs_emergency_save_commits_without_waiting_for_its_copies(tmp_path):
    """SIGTERM after step 4; the ranks save step 5 and exit within the 8 s deadline. Before: the
    emergency save also sent its copies to the other node (30 s here), the deadline passed, and
    the ranks ended at once saying no new step was committed, though step 5 was."""
    t0 = time.monotonic()
    outs = run(
        tmp_path,
        ["a", "b"],
        "--preempt-at",
        "4",
        "--no-restore",
        env={0: {"SLOW_REPLICA_FROM": "5"}, 1: {"SLOW_REPLICA_FROM": "5"}},
    )
    assert all("preempted by SIGTERM: step 5 committed" in out for out in outs), outs
    assert time.monotonic() - t0 < 25, outs
    outs = run(tmp_path, ["a", "b"])
    assert sorted(lines(outs, "RESUMED")) == ["RESUMED 5 5000", "RESUMED 5 5001"], outs


def test_a_sender_whose_listing_fails_in_any_way_tells_its_receiver(tmp_path):
    """Only an OSError or a CheckpointError while listing the files to send was told to the
    receiver; any other left it, and the save's next collective, waiting for the timeout."""
    t0 = time.monotonic()
    outs = run(tmp_path, ["a", "b"], "--steps", "2:2", "--timeout", "60", env={1: {"LISTING_FAILS_AT": "2"}})
    errors = lines(outs, "SAVE_ERROR 2")
    assert len(errors) == 2 and all("ReplicaError" in e for e in errors), outs
    assert any("a bug while listing" in e for e in errors), outs
    assert time.monotonic() - t0 < 40, outs


def test_a_damaged_copy_on_one_node_is_replaced_by_a_peers_good_replica(tmp_path):
    """A byte of node a's own shard of step 4 flips; node b holds a good replica of it. The
    restart resumes step 4 (not step 2), fetching rank 0's files from b, and a's copy is whole
    again afterwards; nothing is set aside."""
    outs = run(tmp_path, ["a", "b"], "--steps", "2:4", "--keep", "1")
    assert len(lines(outs, "SAVED 4")) == 2, outs
    shard = next((tmp_path / "node-a" / "step-00000004").glob("shard-r00000-*"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    outs = run(tmp_path, ["a", "b"])
    assert sorted(lines(outs, "RESUMED")) == ["RESUMED 4 4000", "RESUMED 4 4001"], outs
    assert rank_problem(LocalStorage(tmp_path / "node-a" / "step-00000004"), 0) is None, "repaired from b"
    assert not list(tmp_path.glob("node-*/*damaged*")), "nothing set aside"


def test_orphan_replicas_are_the_copies_no_node_holds_as_its_own():
    seen = {
        0: (Held(6, "x", 2, ((0, 2),), ((0, 1),)), Held(8, "y", 2, ((0, 2),), ((1, 2),))),
        1: (Held(8, "y", 2, ((1, 2),)),),
        2: (Held(6, "z", 2, ((1, 2),), ((1, 2),)),),  # another save of step 6: its own ranks count apart
    }
    assert orphan_replicas(seen) == {0: [(6, ((0, 1),))], 2: [(6, ((1, 2),))]}
    assert orphan_replicas({0: (Held(4, "x", 1, ((0, 1),)),)}) == {}


def test_steps_caught_up_after_the_nodes_were_numbered_anew_are_uploaded_from_where_they_are(tmp_path):
    """Steps 2 and 4 saved on nodes a, b with no remote tier; the job opens again with a remote
    tier and the nodes numbered the other way round (a new rendezvous): each rank uploads the
    saved ranks its node holds (rank 0 looked for saved rank 0's index on node b, every upload
    failed and the steps were kept from the retention for good)."""
    remote = tmp_path / "remote"
    run(tmp_path, ["a", "b"], "--steps", "2:4", "--replicas", "0")
    outs = run(tmp_path, ["b", "a"], "--replicas", "0", "--remote", str(remote), "--no-restore")
    assert not [ln for out in outs for ln in out.splitlines() if "failed" in ln], outs
    for step in (2, 4):
        report = stashpoint.verify(remote / f"step-{step:08d}")
        assert report.ok, report
    out = {"w": torch.zeros(8192), "step": 0}
    stashpoint.load(out, remote / "step-00000004")
    assert out["w"][0].item() == 4000 and out["w"][4096].item() == 4001 and out["step"] == 4


def test_a_step_one_node_holds_refuses_the_save_on_every_node_together(tmp_path):
    """A new run (no restore) where node b's disk was replaced: node a holds step 2, node b
    nothing. Saving step 2 is refused on every rank at once ("already committed" on node a
    alone left node b waiting in the save's collectives until the timeout), and node a's step 2
    stays whole."""
    run(tmp_path, ["a", "b"], "--steps", "2:2", "--replicas", "0")
    shutil.rmtree(tmp_path / "node-b")
    t0 = time.monotonic()
    outs = run(tmp_path, ["a", "b"], "--steps", "2:2", "--replicas", "0", "--no-restore", "--timeout", "60")
    took = time.monotonic() - t0
    errors = lines(outs, "SAVE_ERROR 2")
    assert len(errors) == 2 and all("already has a committed checkpoint" in e for e in errors), outs
    assert took < 50, f"a rank waited for the others' save: {took:.0f} s"
    assert (tmp_path / "node-a" / "step-00000002" / MANIFEST_NAME).exists()
    assert rank_problem(LocalStorage(tmp_path / "node-a" / "step-00000002"), 0) is None


@pytest.mark.parametrize("failure", ["permissions", "memory short"])
def test_a_copy_that_cannot_be_checked_for_a_cause_that_is_no_damage_is_not_called_damaged(
    tmp_path, monkeypatch, caplog, failure
):
    """A node checks its copy of a rank's files after a failed load: a damaged byte is damage,
    but a read refused (permissions, the open-file limit) or memory short for the index's parse
    says nothing of the copy; marked partial, it would no longer count as held, and a step whose
    other copies were damaged would be torn."""
    from stashpoint._core.sealed import ShortOfMemoryError

    step = LocalStorage(tmp_path / "step")
    stashpoint.save({"w": torch.randn(1000)}, step)
    assert rank_problem(step, 0) is None
    read = LocalStorage.read

    def refused(self, name, *args, **kwargs):
        if name.startswith("index-"):
            if failure == "permissions":
                raise PermissionError(13, "Permission denied (injected)", name)
            raise ShortOfMemoryError("parsing the index ran out of memory (injected)")
        return read(self, name, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "read", refused)
    with caplog.at_level("WARNING", logger="stashpoint"):
        assert rank_problem(step, 0) is None
    assert "could not check rank 0's files" in caplog.text
    monkeypatch.undo()
    shard = next((tmp_path / "step").glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    assert "checksum" in (rank_problem(step, 0) or "")
