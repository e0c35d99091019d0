"""Node-local run directories (issue 21, part 1): two torchrun agents on this host are two
nodes, each with a directory of its own; a restart may number the nodes anew, lose a node's
commit, or lose a node's directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from dist_util import free_port
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._dist.nodes import this_node
from stashpoint._manager.nodefetch import check_offer
from stashpoint._manager.nodelocal import Held, Transfer, coverable, expand, merge, plan_spans, plan_transfers, ranges
from stashpoint.errors import CheckpointError, CorruptCheckpointError

WORKER = Path(__file__).with_name("node_worker.py")
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
pytestmark = pytest.mark.xdist_group("nodelocal")


def run_job(base: Path, steps: int, par: str, dirs: tuple[str, str] = ("0", "1")) -> list[str]:
    """Two agents (nodes 0 and 1, one rank each); node i keeps its files in ``base/node-<dirs[i]>``.
    Returns each agent's output."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--node_rank", str(node), "--rdzv_backend", "c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
            "--rdzv_id", f"nl-{port}", "--max_restarts", "0", str(WORKER), str(base), str(steps), "--par", par,
        ]  # fmt: skip
        env = {**ENV, "NODE_DIR": dirs[node]}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def resumed(outs: list[str]) -> set[int]:
    return {int(line.split()[1]) for out in outs for line in out.splitlines() if line.startswith("RESUMED ")}


def losses(base: Path, rank: int) -> dict[int, str]:
    out = {}
    for line in (base / f"losses-{rank}.txt").read_text().splitlines():
        step, loss = line.split()
        out[int(step)] = loss  # a step trained again after a resume: its latest loss
    return out


def files(base: Path, node: str, step: int) -> set[str]:
    d = base / f"node-{node}" / "ckpt" / f"step-{step:08d}"
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def ranks_in(names: set[str]) -> set[int]:
    return {int(n.split("-r")[1][:5]) for n in names if n.startswith(("index-", "shard-"))}


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    base = tmp_path_factory.mktemp("ref-ddp")
    run_job(base, 8, "ddp")
    return base


def test_each_node_holds_its_ranks_files_and_restarts_fetch_what_they_read(tmp_path, ddp_reference):
    """DDP: each node's directory holds its own rank's files and the manifest. A restart with the
    nodes numbered the other way round fetches each rank's files (and, for the replicated weights
    each rank reads, the other rank's) from the other node, and trains on bit for bit."""
    run_job(tmp_path, 4, "ddp")
    for node, rank in (("0", 0), ("1", 1)):
        held = files(tmp_path, node, 4)
        assert MANIFEST_NAME in held and ranks_in(held) == {rank}, held
    m0 = (tmp_path / "node-0/ckpt/step-00000004" / MANIFEST_NAME).read_bytes()
    assert m0 == (tmp_path / "node-1/ckpt/step-00000004" / MANIFEST_NAME).read_bytes()

    outs = run_job(tmp_path, 6, "ddp", dirs=("1", "0"))  # a new rendezvous swapped the node ranks
    assert resumed(outs) == {4}
    for node in ("0", "1"):
        assert ranks_in(files(tmp_path, node, 4)) == {0, 1}, "each node fetched what its rank read"
    for rank in (0, 1):
        got, want = losses(tmp_path, rank), losses(ddp_reference, rank)
        assert [got[s] for s in range(5, 7)] == [want[s] for s in range(5, 7)]

    # a crash between the nodes' commits: node 1 never committed step 6
    (tmp_path / "node-1/ckpt/step-00000006" / MANIFEST_NAME).unlink()
    outs = run_job(tmp_path, 8, "ddp")
    assert resumed(outs) == {4}, "the step only one node committed is passed by"
    for rank in (0, 1):
        got, want = losses(tmp_path, rank), losses(ddp_reference, rank)
        assert [got[s] for s in range(5, 9)] == [want[s] for s in range(5, 9)]

    shutil.rmtree(tmp_path / "node-1")  # a node lost with its disk; no replicas (part 2) yet
    outs = run_job(tmp_path, 8, "ddp")
    assert resumed(outs) == {0}, "no step is whole without node 1's files: a fresh start"


def test_fsdp2_restart_fetches_only_the_bytes_its_ranks_read(tmp_path, tmp_path_factory):
    """FSDP2: each rank reads its own shards, which its node holds, and a few replicated bytes
    another rank wrote: a restart fetches just those byte ranges, and trains on exactly as an
    uninterrupted run."""
    ref = tmp_path_factory.mktemp("ref-fsdp2")
    run_job(ref, 6, "fsdp2")
    run_job(tmp_path, 4, "fsdp2")
    outs = run_job(tmp_path, 6, "fsdp2")
    assert resumed(outs) == {4}
    for node, rank in (("0", 0), ("1", 1)):
        step = tmp_path / f"node-{node}" / "ckpt" / "step-00000004"
        other = 1 - rank
        assert rank in ranks_in(files(tmp_path, node, 4))
        # the other rank's shards at most in part: the few bytes this rank reads of them (the
        # optimizer's step counters, replicated, written once)
        for shard in step.glob(f"shard-r{other:05d}-*"):
            assert (step / f"partial-r{other:05d}").exists()
            assert shard.stat().st_blocks * 512 < shard.stat().st_size, "a sparse copy, not the whole shard"
    for rank in (0, 1):
        got, want = losses(tmp_path, rank), losses(ref, rank)
        assert [got[s] for s in range(5, 7)] == [want[s] for s in range(5, 7)]


# -- the pure parts ---------------------------------------------------------------------------


def test_ranges_round_trip():
    assert ranges([5, 1, 2, 3, 7, 6]) == ((1, 4), (5, 8))
    assert expand(ranges({0, 9, 10})) == {0, 9, 10}
    assert ranges([]) == ()


def test_merge_joins_overlapping_and_touching_ranges():
    assert merge([(10, 20), (0, 4), (4, 6), (15, 30), (40, 40)]) == ((0, 6), (10, 30))


def test_coverable_needs_every_saving_rank_and_one_save_id():
    a = Held(10, "s10", 4, ((0, 2),))
    b = Held(10, "s10", 4, ((2, 4),))
    assert set(coverable({0: [a], 1: [b]})) == {10}
    assert coverable({0: [a]}) == {}, "ranks 2 and 3 are on no node"
    other = Held(10, "other", 4, ((2, 4),))
    assert coverable({0: [a], 1: [other]}) == {}, "two saves of one step: neither is trusted"


def test_plan_transfers_sends_each_missing_rank_once_and_spreads_the_sources():
    held = {0: {0, 1, 2, 3}, 1: {0, 1, 2, 3}}
    need = {2: {0, 1, 2, 3}, 3: {1}}
    transfers, after = plan_transfers(held, need, [0, 1, 2, 3])
    sent = [(t.src, t.dst, expand(t.ranks), t.manifest) for t in transfers]
    assert {d for _, d, _, m in sent if m} == {2, 3}, "nodes without the step get its manifest"
    to2 = [s for s in sent if s[1] == 2]
    assert {src for src, *_ in to2} == {0, 1}, "two holders share the work"
    assert set().union(*(r for _, d, r, _ in sent if d == 2)) == {0, 1, 2, 3}
    assert after[2] == {0, 1, 2, 3} and after[3] == {1}
    idx, after_idx = plan_transfers(held, need, [0, 1, 2, 3], indexes_only=True)
    assert all(not t.ranks for t in idx)
    assert set().union(*(expand(t.indexes) for t in idx if t.dst == 2)) == {0, 1, 2, 3}
    assert after_idx[2] == set(), "an index alone does not make a rank's files held"


def test_plan_transfers_fails_when_no_node_holds_a_needed_rank():
    with pytest.raises(CorruptCheckpointError, match="saving rank 3"):
        plan_transfers({0: {0, 1, 2}}, {1: {3}}, [0, 1])


def test_plan_spans_sends_only_the_ranges_of_ranks_a_node_lacks_merged():
    held = {0: {0}, 1: {1}}
    need = {
        1: {"a": (0, 100, [(0, 8), (8, 20), (50, 60)]), "b": (1, 70, [(0, 8)])},
        0: {"b": (1, 70, [(0, 8), (30, 40)])},
    }
    transfers = plan_spans(held, need)
    assert [(t.src, t.dst, t.spans) for t in transfers] == [
        (0, 1, (("a", 0, 100, ((0, 20), (50, 60))),)),
        (1, 0, (("b", 1, 70, ((0, 8), (30, 40))),)),
    ]


@pytest.mark.parametrize(
    ("offer", "why"),
    [
        (b"not json", "malformed"),
        (b'{"files": [["../../etc/passwd", 3]], "spans": []}', "not a file of this transfer"),
        (b'{"files": [["shard-r00002-0000-abc.safetensors", 3]], "spans": []}', "not a file of this transfer"),
        (b'{"files": [["shard-r00001-0000-other.safetensors", 3]], "spans": []}', "not a file of this transfer"),
        (b'{"files": [["manifest.json", 3]], "spans": []}', "not a file of this transfer"),
        (b'{"files": [["shard-r00001-0000-abc.safetensors", -1]], "spans": []}', "not a file of this transfer"),
        (b'{"files": [], "spans": [["shard-r00003-0000-abc.safetensors", 3, 9, [[0, 99]]]]}', "other than"),
        (b'{"files": [], "spans": [["x", 3, 9, "ab"]]}', "malformed"),
    ],
)
def test_a_peers_offer_outside_the_plan_is_refused(offer, why):
    plan = Transfer(0, 1, ranks=((1, 2),), spans=(("shard-r00003-0000-abc.safetensors", 3, 9, ((0, 4),)),))
    with pytest.raises(CorruptCheckpointError, match=why):
        check_offer(offer, plan, "abc", 0)
    ok = (
        b'{"files": [["shard-r00001-0000-abc.safetensors", 3]], '
        b'"spans": [["shard-r00003-0000-abc.safetensors", 3, 9, [[0, 4]]]]}'
    )
    assert check_offer(ok, plan, "abc", 0) == [("shard-r00001-0000-abc.safetensors", 3)]


def test_node_identity_comes_from_the_launcher(monkeypatch):
    for name in ("STASHPOINT_NODE", "GROUP_RANK", "STASHPOINT_LOCAL_RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert this_node(1).node == 0 and this_node(1).leader
    with pytest.raises(CheckpointError, match="GROUP_RANK"):
        this_node(4)
    monkeypatch.setenv("GROUP_RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert this_node(4) == type(this_node(4))(3, False)
    monkeypatch.setenv("STASHPOINT_NODE", "x")
    with pytest.raises(CheckpointError, match="STASHPOINT_NODE='x'"):
        this_node(4)
