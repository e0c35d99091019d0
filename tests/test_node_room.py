"""The room a node's directory needs with replicas (issue 21, part 2): counted per node from
every rank's bytes, checked against the directory before a copy is taken, and a configuration
that cannot fit at the peak of a save refused at the first save, not at the save that fills it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from stashpoint._core.naming import RECOVERABLE_NAME
from stashpoint._core.nodeplan import peak_bytes, replica_bytes
from stashpoint._core.policy import Retention
from stashpoint._dist.nodecommit import tree_children, tree_parent, tree_places
from stashpoint._dist.nodes import NodeMap, NodeSave
from stashpoint._dist.transfer import _room_problem
from stashpoint._storage import LocalStorage
from test_nodelocal import files, ranks_in, run_job

pytestmark = pytest.mark.xdist_group("nodelocal")


def test_each_node_keeps_the_bytes_of_the_nodes_before_it():
    own = {0: 10, 1: 20, 2: 40, 5: 80}
    assert replica_bytes(own, 0) == {0: 0, 1: 0, 2: 0, 5: 0}
    assert replica_bytes(own, 1) == {0: 80, 1: 10, 2: 20, 5: 40}
    assert replica_bytes(own, 2) == {0: 80 + 40, 1: 10 + 80, 2: 20 + 10, 5: 40 + 20}
    assert replica_bytes({3: 7}, 1) == {3: 0}


def test_the_peak_counts_the_step_being_written_and_two_steps_of_copies():
    assert peak_bytes(100, 30, 2) == 3 * 100 + 2 * 30
    assert peak_bytes(100, 30, None) is None


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "keep_best", "bound"),
    [(3, None, None, 3), (2, None, (2, "loss"), 4), (None, None, (2, "loss"), 3), (2, 10, None, None),
     (None, None, None, None)],
)  # fmt: skip
def test_the_retention_bounds_the_steps_it_keeps(keep_last, keep_every, keep_best, bound):
    assert Retention.of(keep_last, keep_every, keep_best).bound() == bound


def test_a_directory_that_cannot_hold_the_peak_is_named_with_the_numbers_and_the_fix(tmp_path):
    step = LocalStorage(tmp_path / "ckpt" / "step-00000002")
    step.prepare()
    (tmp_path / "ckpt" / "step-00000002" / "shard-held").write_bytes(b"x" * 65536)
    ns = NodeSave(1, NodeMap(((0, 0), (1, 1))), replicas=1, keep=2)
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    why = _room_problem(step, (free, free // 4), ns)
    assert why is not None
    assert "node 1's directory" in why and str(tmp_path / "ckpt") in why, why
    assert "2 + 1 steps of its own files" in why, why
    assert "larger directory, a smaller keep_last, or fewer replicas" in why, why
    assert _room_problem(step, (1 << 20, 1 << 20), ns) is None, "a few MiB fit"
    assert _room_problem(step, (free, free), NodeSave(1, ns.nodes, 1, None)) is None, "no bound: no peak"
    assert _room_problem(step, None, ns) is None


def _tmpfs(where: Path, size: int) -> None:
    where.mkdir(parents=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True,
                       capture_output=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {e}")


def test_replicas_into_a_memory_tier_too_small_for_the_peak_are_refused_at_the_first_save(tmp_path):
    """Each node's directory a tmpfs that holds a step and its copy, but not what a node keeps
    at the peak of a later save (keep_last=2: three steps of its own and two of copies): the
    first save commits on both nodes, no copy is taken, and wait() raises naming the numbers;
    training goes on to the end, and every step reaches the remote tier."""
    probe = tmp_path / "probe"
    run_job(probe, 2, "ddp", replicas=1)
    doc = json.loads((probe / "node-0/ckpt/step-00000002" / RECOVERABLE_NAME).read_text())
    own = max(doc["own_bytes"], doc["replica_bytes"])  # a node's own bytes of a step, either node
    base = tmp_path / "tiny"
    mounted = []
    try:
        for node in ("0", "1"):
            _tmpfs(base / f"node-{node}", 4 * own + (64 << 10))  # the peak is 3 + 2 steps' bytes
            mounted.append(base / f"node-{node}")
        remote = tmp_path / "remote"  # the steps go there all the same
        outs = run_job(base, 4, "ddp", replicas=1, extra=("--remote", str(remote)))
        errors = [line for out in outs for line in out.splitlines() if line.startswith("WAIT_ERROR ")]
        assert len(errors) == 2 and all("ReplicaError" in e for e in errors), outs[0][-3000:]
        assert all("cannot hold this configuration" in e and "fewer replicas" in e for e in errors), errors
        for node, rank in (("0", 0), ("1", 1)):
            for step in (2, 4):
                held = files(base, node, step)
                assert "manifest.json" in held, f"step {step} committed on node {node}"
                assert ranks_in(held) == {rank}, "no copy of the other node's files taken"
                assert RECOVERABLE_NAME not in held
        assert sorted(p.parent.name for p in remote.glob("step-*/manifest.json")) == ["step-00000002", "step-00000004"]
    finally:
        for where in mounted:
            subprocess.run(["umount", "-l", str(where)], check=False, timeout=30)
        shutil.rmtree(base, ignore_errors=True)


def test_the_node_scale_benchmark_runs_and_no_node_sends_to_all():
    """benchmarks/bench_nodescale.py at 512 ranks on 64 nodes: the busiest node takes part in
    about 2 log2(nodes) transfers of a restore, not one per node."""
    from benchmarks.bench_nodescale import restore

    r = restore(512, 8)
    assert r["transfers"] == (1, 63, 63), r
    assert r["busiest"] <= 2 * 6 + 2, r


@pytest.mark.parametrize("nodes", [1, 2, 3, 5, 8, 64, 1000, 2048])
def test_the_manifest_reaches_every_leader_through_a_doubling_tree(nodes):
    """Each place but the root receives once, from a place that has it by then; the subtree
    whose rooms a place passes on is itself and its descendants; no leader sends more than
    log2(nodes) copies (rank 0 sent one to every node before)."""
    from benchmarks.bench_nodescale import commit_fanout

    got_in = {0: -1}  # place -> the round it received in
    for at in range(nodes):  # parents come before children in place order
        for round_, child in enumerate(tree_children(at, nodes), start=0 if at == 0 else at.bit_length()):
            assert tree_parent(child) == at and child not in got_in
            assert round_ > got_in[at], "a place sends only after it received"
            got_in[child] = round_
    assert sorted(got_in) == list(range(nodes))
    for at in range(nodes):
        below = {at} | {c for c in range(nodes) if c != 0 and _descends(c, at)}
        assert set(tree_places(at, nodes)) == below
    copies, rounds = commit_fanout(nodes)
    assert copies <= max(1, (nodes - 1).bit_length()) and rounds == (nodes - 1).bit_length()


def _descends(c: int, at: int) -> bool:
    while c != 0:
        c = tree_parent(c)
        if c == at:
            return True
    return False
