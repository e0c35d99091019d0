"""Node-local run directories (issue 21, part 1): two torchrun agents on this host are two
nodes, each with a directory of its own; a restart may number the nodes anew, lose a node's
commit, or lose a node's directory."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import stashpoint
from conftest import ROOT
from dist_util import rendezvous_store
from stashpoint._core.naming import MANIFEST_NAME, RECOVERABLE_NAME
from stashpoint._core.nodeplan import (
    REMOTE,
    Held,
    Transfer,
    coverable,
    expand,
    merge,
    plan_parts,
    plan_spans,
    plan_transfers,
    ranges,
    relay,
    replica_peers,
    upload_parts,
)
from stashpoint._dist import memfetch
from stashpoint._dist.nodes import this_node
from stashpoint._dist.stream import pieces
from stashpoint._dist.transfer import check_offer
from stashpoint._manager.holdings import node_order
from stashpoint._manager.upload import rank_problem
from stashpoint._storage import LocalStorage
from stashpoint._tools.cli import main as cli_main
from stashpoint._tools.inspect import describe
from stashpoint.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError

WORKER = Path(__file__).with_name("node_worker.py")
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
pytestmark = pytest.mark.xdist_group("nodelocal")


@pytest.fixture(autouse=True)
def fetch_memory(monkeypatch):
    """The memory area restores fetch into, one per test on ``/dev/shm`` (the default's file
    system): empty again once every job ended, its restores' copies settled onto the disk."""
    area = Path(tempfile.mkdtemp(prefix="stashpoint-test-", dir="/dev/shm"))
    monkeypatch.setitem(ENV, "STASHPOINT_FETCH_MEMORY", str(area))
    try:
        yield area
        assert not list(area.glob("*/fetch-*")), "a restore's memory copy (or its lock) outlived its job"
    finally:
        shutil.rmtree(area, ignore_errors=True)


def _agents(
    base: Path, steps: int, par: str, dirs: tuple[str, ...], *extra: str, nproc: int = 1, **popen
) -> list[subprocess.Popen]:
    """One torchrun agent per entry of ``dirs`` (nodes 0, 1, ..., ``nproc`` ranks each); node i
    keeps its files in ``base/node-<dirs[i]>``. Their rendezvous store is served from here on a
    port the kernel gave it and that it holds while the agents live (a port picked free and
    bound later by an agent can be taken in between); the agents join it as clients."""
    store = rendezvous_store()
    port = store.port
    procs = []
    for node in range(len(dirs)):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(dirs)), "--nproc_per_node", str(nproc),
            "--node_rank", str(node), "--rdzv_backend", "c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
            "--rdzv_id", f"nl-{port}", "--rdzv_conf", "is_host=0", "--max_restarts", "0", str(WORKER), str(base),
            str(steps), "--par", par,
            *extra,
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, env={**ENV, "NODE_DIR": dirs[node]}, **popen)
        proc.store = store  # type: ignore[attr-defined]  # served as long as the agents are
        procs.append(proc)
    return procs


def run_job(
    base: Path,
    steps: int,
    par: str,
    dirs: tuple[str, ...] = ("0", "1"),
    *,
    replicas: int = 0,
    extra: tuple[str, ...] = (),
    nproc: int = 1,
) -> list[str]:
    """A job of one agent per entry of ``dirs`` (``nproc`` ranks each) to ``steps``; each
    agent's output."""
    procs = _agents(base, steps, par, dirs, "--replicas", str(replicas), *extra, nproc=nproc, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        outs = [p.communicate(timeout=200)[0] for p in procs]
    except subprocess.TimeoutExpired:
        _kill_all(procs, dump=True)
        outs = [p.communicate()[0] for p in procs]
        pytest.fail("the job hung:\n" + "\n---\n".join(o[-6000:] for o in outs))
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def resumed(outs: list[str]) -> set[int]:
    return {int(line.split()[1]) for out in outs for line in out.splitlines() if line.startswith("RESUMED ")}


def reports(outs: list[str]) -> dict[int, dict]:
    """Each rank's ``mgr.last_restore``, as the worker printed it."""
    docs = [json.loads(line[7:]) for out in outs for line in out.splitlines() if line.startswith("REPORT ")]
    return {d["rank"]: d for d in docs}


def same_losses(base: Path, reference: Path, steps: range) -> None:
    for rank in (0, 1):
        got, want = losses(base, rank), losses(reference, rank)
        assert [got[s] for s in steps] == [want[s] for s in steps], f"rank {rank}"


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


@pytest.fixture(scope="session")  # not per module: the worker interleaves test_node_room's tests
def ddp_reference(tmp_path_factory):
    """An uninterrupted DDP run of 14 steps: the losses every resumed run must repeat."""
    base = tmp_path_factory.mktemp("ref-ddp")
    run_job(base, 14, "ddp")
    return base


@pytest.mark.slow  # about 70 s: two torchrun agents, saved and restarted twice
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
    assert list((tmp_path / "node-0/ckpt").glob("step-00000006.incomplete-*")), "and set aside, not deleted"
    for rank in (0, 1):
        got, want = losses(tmp_path, rank), losses(ddp_reference, rank)
        assert [got[s] for s in range(5, 9)] == [want[s] for s in range(5, 9)]

    shutil.rmtree(tmp_path / "node-1")  # a node lost with its disk; no replicas (part 2) yet
    outs = run_job(tmp_path, 8, "ddp", extra=("--restore-step", "8"))
    errors = [line for out in outs for line in out.splitlines() if line.startswith("RESTORE_ERROR")]
    assert len(errors) == 2 and all(e.startswith("RESTORE_ERROR IncompleteCheckpointError") for e in errors), outs
    assert "step 8" in errors[0] and "on no node of this job" in errors[0], errors
    outs = run_job(tmp_path, 8, "ddp")
    assert resumed(outs) == {0}, "no step is whole without node 1's files: a fresh start"
    # kept, named for what they are (not "damaged"), and the log says how to take them back
    assert list((tmp_path / "node-0/ckpt").glob("step-*.incomplete-*")), sorted((tmp_path / "node-0/ckpt").iterdir())
    assert any("rename it back on each node" in out for out in outs), outs


def test_restoring_a_step_whose_only_copy_of_some_files_is_damaged_names_the_damage(tmp_path):
    """restore(step=N) where one rank's files are damaged on the one node holding them: the
    nodes recheck, find no good copy, and say the step is damaged (not that a node was lost)."""
    run_job(tmp_path, 4, "ddp")
    step = tmp_path / "node-1/ckpt/step-00000004"
    shard = max((p for p in step.iterdir() if p.name.startswith("shard-")), key=lambda p: p.stat().st_size)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(64)
    shard.write_bytes(bytes(raw))
    outs = run_job(tmp_path, 4, "ddp", extra=("--restore-step", "4"))
    errors = [line for out in outs for line in out.splitlines() if line.startswith("RESTORE_ERROR")]
    assert len(errors) == 2 and all(e.startswith("RESTORE_ERROR CorruptCheckpointError") for e in errors), outs
    assert "no node holds an undamaged copy" in errors[0] and "checksum" in errors[0], errors
    outs = run_job(tmp_path, 4, "ddp")  # a plain restore passes it by
    assert resumed(outs) == {2}


@pytest.mark.slow  # the four-node relay test checks the same sparse fetch in the default tier
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


def digests(outs: list[str], kind: str) -> set[tuple[int, str]]:
    """The (step, hash) of the whole state each rank printed on a ``DIGEST <kind>`` line."""
    lines = [line.split()[2:] for out in outs for line in out.splitlines() if line.startswith(f"DIGEST {kind} ")]
    return {(int(step), h) for step, h in lines}


@pytest.mark.slow  # about 40 s a case
@pytest.mark.parametrize("back", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_step_saved_by_four_ranks_resumes_on_two_and_back_on_four_through_the_nodes(tmp_path, back):
    """FSDP2 resharded through node-local directories: saved by two nodes of two ranks, a
    restart with one rank per node (N -> M) fetches onto each node what its rank's new slices
    need from the other node, and (``back``, in the slow tier) a restart with two ranks per node
    again (M -> N) does the same; the state restored is, gathered, exactly the state saved."""
    outs = run_job(tmp_path, 4, "fsdp2", nproc=2, extra=("--digest",))
    saved = digests(outs, "final")
    assert len(saved) == 1 and next(iter(saved))[0] == 4, saved
    assert ranks_in(files(tmp_path, "0", 4)) == {0, 1} and ranks_in(files(tmp_path, "1", 4)) == {2, 3}

    outs = run_job(tmp_path, 6, "fsdp2", nproc=1, extra=("--digest",))
    assert resumed(outs) == {4}
    assert digests(outs, "restored") == saved, "4 -> 2 ranks: the gathered state differs from the saved one"
    rep = reports(outs)
    assert rep[1]["tier"] == "local" and rep[1]["fetched"].get("peers", 0) > 0, rep[1]
    assert 1 in ranks_in(files(tmp_path, "1", 4)), "node 1's rank 1 read what saving rank 1 wrote: fetched"
    saved = digests(outs, "final")
    if not back:
        return
    outs = run_job(tmp_path, 8, "fsdp2", nproc=2, extra=("--digest",))
    assert resumed(outs) == {6}
    assert digests(outs, "restored") == saved, "2 -> 4 ranks: the gathered state differs from the saved one"


@pytest.mark.slow  # ~50 s of four node processes: the default tier stays under 15 minutes
def test_what_every_node_reads_of_one_rank_is_passed_on_by_the_nodes_that_got_it(tmp_path):
    """Four nodes, FSDP2: every rank reads the optimizer's step counters, which rank 0 wrote
    once. A restart fetches rank 0's index and those bytes onto nodes 1-3 through a doubling
    tree (node 0 sends to nodes 1 and 2, node 1 passes them on to node 3: ``relay``), run for
    real by four agents; every node resumes with exactly the state saved."""
    dirs = ("0", "1", "2", "3")
    outs = run_job(tmp_path, 4, "fsdp2", dirs, extra=("--digest",))
    saved = digests(outs, "final")
    assert len(saved) == 1, saved
    outs = run_job(tmp_path, 6, "fsdp2", dirs, extra=("--digest",))
    assert resumed(outs) == {4}
    assert digests(outs, "restored") == saved
    rep = reports(outs)
    assert all(rep[r]["tier"] == "local" and rep[r]["fetched"].get("peers", 0) > 0 for r in (1, 2, 3)), rep
    for node in ("1", "2", "3"):
        held = files(tmp_path, node, 4)
        assert 0 in ranks_in(held) and "partial-r00000" in held, "rank 0's index and a sparse part of it"
        for shard in (tmp_path / f"node-{node}" / "ckpt" / "step-00000004").glob("shard-r00000-*"):
            assert shard.stat().st_blocks * 512 < shard.stat().st_size, "a sparse copy, not the whole shard"


@pytest.mark.slow  # ~70 s; the memory area itself is checked in test_memfetch.py
def test_a_node_whose_leader_cannot_hold_its_memory_area_reads_its_directory_alone(tmp_path, fetch_memory, monkeypatch):
    """Another process holds node 0's memory area, with a manifest that is not the step's in
    it: node 0's leader cannot take the area, so none of the node's ranks reads through it
    (its leader says so to all), and the job resumes from the node's directory."""
    run_job(tmp_path, 4, "ddp", nproc=2)
    monkeypatch.setenv(memfetch.ENV, str(fetch_memory))
    area = memfetch.area(tmp_path / "node-0" / "ckpt")
    assert area is not None and area.parent.parent == fetch_memory
    held = memfetch.claim(area)
    assert held is not None
    try:
        (area / "step-00000004").mkdir(parents=True)
        (area / "step-00000004" / MANIFEST_NAME).write_bytes(b"not the step's manifest")
        outs = run_job(tmp_path, 6, "ddp", nproc=2)
        assert resumed(outs) == {4}
    finally:
        memfetch.release(held, area)


@pytest.mark.slow  # about 30 s; the default tier restores from a peer replica in test_replica_failures
def test_a_node_lost_with_its_disk_is_restored_from_the_replica_on_the_other_node(tmp_path, ddp_reference):
    """replicas=1: each node also keeps the other node's files of the newest step (only the
    newest). Node 1 lost with its directory, the job restarts with a fresh node 1: it resumes
    from the newest step, its rank's files fetched from node 0's replica, bit for bit."""
    run_job(tmp_path, 6, "ddp", replicas=1)
    for node, other in (("0", 1), ("1", 0)):
        assert ranks_in(files(tmp_path, node, 6)) == {0, 1}, "the other node's files are replicated here"
        assert f"replica-r{other:05d}" in files(tmp_path, node, 6)
        assert ranks_in(files(tmp_path, node, 4)) == {1 - other}, "older steps keep no replicas"
        newest = tmp_path / f"node-{node}" / "ckpt" / "step-00000006"
        held = describe(newest)["recoverable_without_storage"]
        assert held is not None and (held["replicas"], held["nodes"]) == (1, 2)
        assert held["own_bytes"] > 0 and held["replica_bytes"] > 0, "what this node holds, counted"
        assert abs(held["replica_bytes"] - held["own_bytes"]) < held["own_bytes"], "DDP: about as much as its own"
        assert RECOVERABLE_NAME not in files(tmp_path, node, 4), "an older step is not, its replicas gone"
        assert not [w for w in stashpoint.verify(newest).warnings if "replica-" in w or RECOVERABLE_NAME in w]
    shown = CliRunner().invoke(cli_main, ["inspect", str(tmp_path / "node-0/ckpt/step-00000006")]).output
    assert "recoverable without storage: each of 2 nodes' files copied to 1 other node(s)" in shown
    assert "this node holds" in shown and "of other nodes'" in shown
    shutil.rmtree(tmp_path / "node-1")
    outs = run_job(tmp_path, 8, "ddp", replicas=1)
    assert resumed(outs) == {6}
    rep = reports(outs)[1]
    assert rep["fetched"].get("peers", 0) > 0 and rep["fetched_into"] == "memory", rep
    assert 1 in ranks_in(files(tmp_path, "1", 6)) and "partial-r00001" not in files(tmp_path, "1", 6), (
        "what node 1 fetched into memory is in its directory once the job ended, whole"
    )
    for rank in (0, 1):
        got, want = losses(tmp_path, rank), losses(ddp_reference, rank)
        assert [got[s] for s in range(7, 9)] == [want[s] for s in range(7, 9)]


@pytest.mark.slow  # ~60 s of node processes: the default tier stays under 15 minutes
def test_nodes_lost_without_replicas_restore_from_the_remote_tier(tmp_path, ddp_reference):
    """node_local with a remote tier (a shared directory here) and no replicas. Node 1 lost with
    its disk: the job resumes from the newest step, each node fetching from its peer what a node
    holds and from the remote tier only what no node holds (rank 1's files). Both nodes lost:
    the newest step straight from the remote tier. A damaged shard on a node: that node's copy
    of the rank is found damaged and fetched anew from the remote tier, the rest read from the
    nodes. Bit for bit throughout."""
    remote = ("--remote", str(tmp_path / "remote"))
    run_job(tmp_path, 4, "ddp", extra=remote)
    assert (tmp_path / "remote" / "step-00000004" / MANIFEST_NAME).exists(), "every step uploaded"

    shutil.rmtree(tmp_path / "node-1")
    outs = run_job(tmp_path, 6, "ddp", extra=remote)
    assert resumed(outs) == {4}
    rep = reports(outs)
    assert rep[1]["tier"] == "local", "loaded from node 1's directory once filled"
    assert rep[1]["fetched"].get("remote", 0) > 0, "rank 1's own files: on no node, from the remote tier"
    assert rep[1]["fetched"].get("peers", 0) > 0, "what node 0 holds came from node 0"
    assert [tuple(x) for x in rep[0]["order"][:2]] == [(4, "local"), (4, "remote")]
    assert rep[0]["passed_by"] == [] and rep[1]["passed_by"] == []
    same_losses(tmp_path, ddp_reference, range(5, 7))

    shutil.rmtree(tmp_path / "node-0")
    shutil.rmtree(tmp_path / "node-1")
    outs = run_job(tmp_path, 8, "ddp", extra=remote)
    assert resumed(outs) == {6}
    assert {r["tier"] for r in reports(outs).values()} == {"remote"}
    same_losses(tmp_path, ddp_reference, range(7, 9))

    shard = sorted((tmp_path / "node-0/ckpt/step-00000008").glob("shard-r00000-*"))[0]
    with shard.open("r+b") as f:  # one byte in the middle of rank 0's data, on node 0 only
        f.seek(shard.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    outs = run_job(tmp_path, 10, "ddp", extra=remote)
    assert resumed(outs) == {8}
    rep = reports(outs)
    assert [p[:2] for p in rep[0]["passed_by"]] == [[8, "local"]], rep[0]["passed_by"]
    assert "checksum" in rep[0]["passed_by"][0][2] or "damaged" in rep[0]["passed_by"][0][2]
    # node 0's copy of rank 0 was checked and marked damaged: only those files came from the
    # remote tier, into node 0's directory, and the step loaded through the nodes
    assert {r["tier"] for r in rep.values()} == {"local"}
    assert rep[0]["fetched"].get("remote", 0) > 0 and not rep[1]["fetched"].get("remote")
    assert not list((tmp_path / "node-0/ckpt").glob("step-00000008.damaged-*")), "repaired, not set aside"
    assert rank_problem(LocalStorage(tmp_path / "node-0/ckpt/step-00000008"), 0) is None
    same_losses(tmp_path, ddp_reference, range(9, 11))


def test_the_fall_back_order_takes_a_step_the_nodes_hold_in_part_when_the_remote_tier_has_the_rest():
    whole = (Held(6, "s6", 2, ((0, 1),)), Held(4, "s4", 2, ((0, 1),)))
    other = (Held(6, "s6", 2, ((1, 2),)),)
    order, torn = node_order({0: whole, 1: other}, [2, 4], None)
    assert order == [(6, "local"), (4, "local"), (4, "remote"), (2, "remote")]
    assert torn == [], "step 6: both ranks on some node"
    order, torn = node_order({0: whole}, [4], None)
    assert order == [(4, "local"), (4, "remote")], "step 4: rank 1 from the remote tier"
    assert torn == [6], "step 6: rank 1 on no node nor in the remote tier"
    assert node_order({0: whole}, [4], 4)[0] == [(4, "local"), (4, "remote")]


def test_plan_transfers_reads_from_the_remote_tier_only_what_no_node_holds():
    held = {0: {0, 1}, 1: {0, 1}, REMOTE: {0, 1, 2, 3}}
    need = {2: {0, 1, 2, 3}}
    transfers, after = plan_transfers(held, need, [0, 1, 2, 3])
    from_remote = set().union(set(), *(expand(t.ranks) for t in transfers if t.src == REMOTE))
    assert from_remote == {2, 3}, "ranks 0 and 1 come from the nodes"
    assert all(t.src != REMOTE for t in transfers if t.manifest), "the manifest from a node"
    assert after[2] == {0, 1, 2, 3}


def test_replicas_need_node_local_and_enough_nodes(tmp_path):
    with pytest.raises(ValueError, match="node_local=True"):
        stashpoint.CheckpointManager(tmp_path / "a", replicas=1)
    with pytest.raises(ValueError, match="at least 2 nodes"):
        stashpoint.CheckpointManager(tmp_path / "b", node_local=True, replicas=1)


def test_each_node_sends_to_the_node_after_it_and_receives_from_the_one_before():
    nodes = [3, 5, 8, 9]
    for shift in (1, 2, 3):
        peers = {n: replica_peers(nodes, n, shift) for n in nodes}
        assert sorted(dst for dst, _ in peers.values()) == nodes, "every node receives one copy"
        for n, (dst, src) in peers.items():
            assert n not in (dst, src)
            assert peers[dst][1] == n, "the node it sends to receives from it"
    assert replica_peers([0, 1], 0, 1) == (1, 1), "two nodes: each other's sender and receiver"


def _start(base: Path, steps: int, replicas: int) -> list[subprocess.Popen]:
    return _agents(base, steps, "ddp", ("0", "1"), "--replicas", str(replicas), "--every", "1",
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


def _kill_all(procs: list[subprocess.Popen], dump: bool = False) -> None:
    """``kill -9`` every process of the job: the agents and the ranks they started (with
    ``dump``, the ranks first print where they are: tests/node_worker.py)."""
    import psutil

    victims = []
    for p in procs:
        try:
            victims += [p.pid, *(c.pid for c in psutil.Process(p.pid).children(recursive=True))]
        except psutil.NoSuchProcess:
            pass
    if dump:
        for pid in victims[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(3)
        spy = Path(sys.executable).with_name("py-spy")
        for pid in victims if spy.exists() else ():
            r = subprocess.run([str(spy), "dump", "--native", "--pid", str(pid)], capture_output=True, text=True)
            print(r.stdout[-6000:], r.stderr[-500:], file=sys.stderr)
    for pid in victims:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()


def _whole_steps(node_dir: Path) -> set[int]:
    """The steps a node's directory holds every rank's files of (read by the test itself)."""
    out = set()
    for step in (node_dir / "ckpt").glob("step-*"):
        if not step.name[5:].isdigit():  # set aside: step-N.damaged-<time>
            continue
        names = {p.name for p in step.iterdir()} if step.is_dir() else set()
        whole = MANIFEST_NAME in names and not any(n.startswith("partial-") for n in names)
        if whole and ranks_in({n for n in names if n.startswith("index-")}) == {0, 1}:
            out.add(int(step.name[5:]))
    return out


def _node_failures(base: Path, reference: Path, kills: int, seed: int) -> None:
    import random

    rng = random.Random(seed)
    total = 14
    for _ in range(kills):
        losses_file = base / "losses-0.txt"
        done = len(losses_file.read_text().splitlines()) if losses_file.exists() else 0
        target = done + rng.randint(2, 5)
        procs = _start(base, total, replicas=1)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            if losses_file.exists() and len(losses_file.read_text().splitlines()) >= target:
                break
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))  # anywhere in a save, its commit or its replication
        _kill_all(procs)
        lost = rng.choice(("0", "1"))
        survivor = base / f"node-{1 - int(lost)}"
        expected = max(_whole_steps(survivor), default=0)
        shutil.rmtree(base / f"node-{lost}", ignore_errors=True)
        outs = run_job(base, expected + 1, "ddp", replicas=1) if expected + 1 <= total else None
        if outs is not None:
            assert resumed(outs) == {expected}, f"lost node {lost}: the survivor held {expected} whole"
    run_job(base, total, "ddp", replicas=1)
    for rank in (0, 1):
        assert losses(base, rank) == {s: losses(reference, rank)[s] for s in range(1, total + 1)}


@pytest.mark.slow  # torture (~70 s): with the many-cycle one, in the slow tier
def test_random_node_failures_with_replicas_resume_from_the_newest_step_a_node_holds(tmp_path, ddp_reference):
    """Torture (a short run; the slow tier has more): the job is killed (kill -9, every process)
    at a random moment, one random node's directory is deleted, and the job restarts with a
    fresh node. It resumes from exactly the newest step the surviving node holds whole (never
    a torn one), and in the end every step's loss equals an uninterrupted run's."""
    _node_failures(tmp_path, ddp_reference, kills=2, seed=1)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ten kill-and-restart cycles of about 30 s each, past the 300 s default
def test_random_node_failures_with_replicas_many(tmp_path, ddp_reference):
    _node_failures(tmp_path, ddp_reference, kills=10, seed=2)


# -- the pure parts ---------------------------------------------------------------------------


def test_ranges_round_trip():
    assert ranges([5, 1, 2, 3, 7, 6]) == ((1, 4), (5, 8))
    assert expand(ranges({0, 9, 10})) == {0, 9, 10}
    assert ranges([]) == ()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 40)), max_size=12), st.integers(1, 32))
def test_a_files_byte_ranges_go_packed_into_full_messages_in_order(spans, chunk):
    """Many small ranges (a sparse copy's step counters) go as one message; each message but the
    last is full, and the messages hold exactly the ranges' bytes, in order."""
    ranges = [(a, a + n) for a, n in spans]
    out = pieces(ranges, chunk)
    assert [i for p in out for a, b in p for i in range(a, b)] == [i for a, b in ranges for i in range(a, b)]
    sizes = [sum(b - a for a, b in p) for p in out]
    assert all(s == chunk for s in sizes[:-1]) and all(0 < s <= chunk for s in sizes)


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
    with pytest.raises(IncompleteCheckpointError, match="saving rank 3"):
        plan_transfers({0: {0, 1, 2}}, {1: {3}}, [0, 1])


def test_plan_spans_sends_only_the_ranges_of_ranks_a_node_lacks_merged():
    held = {0: {0}, 1: {1}}
    need = {
        1: {"a": (0, 100, [(0, 8), (8, 20), (50, 60)]), "b": (1, 70, [(0, 8)])},
        0: {"b": (1, 70, [(0, 8), (30, 40)])},
    }
    transfers = plan_spans(held, need)
    assert [(t.src, t.dst, t.spans) for t in transfers] == [
        (1, 0, (("b", 1, 70, ((0, 8), (30, 40))),)),
        (0, 1, (("a", 0, 100, ((0, 20), (50, 60))),)),
    ], "node 0's wants first (nodes in order), then node 1's"


def _run(order):
    """Each node's part of ``order`` run one after another, transfers between two nodes when
    both reach them: the steps taken, and what every node ends up holding (raises if a node
    sends a key it has not got yet, or the order deadlocks)."""
    queues = {}
    for i, (src, dst, _) in enumerate(order):
        queues.setdefault(src, []).append(i)
        queues.setdefault(dst, []).append(i)
    done, steps, got = set(), 0, {}
    while len(done) < len(order):
        ready = [i for i in range(len(order)) if i not in done and all(
            q[0] == i for q in (queues[order[i][0]], queues[order[i][1]]))]  # fmt: skip
        assert ready, "deadlock"
        busy = set()
        for i in ready:  # a step: every ready transfer whose nodes are free
            src, dst, keys = order[i]
            if src in busy or dst in busy:
                continue
            busy |= {src, dst}
            for k in keys:
                assert src == REMOTE or k in got.get(src, set()) or src == 0, (src, k)
            got.setdefault(dst, set()).update(keys)
            done.add(i)
            queues[src].pop(0)
            queues[dst].pop(0)
        steps += 1
    return steps, got


def test_a_key_every_node_wants_spreads_through_a_doubling_tree():
    """The replicated values one rank wrote, which every rank reads: node 0 holds them and
    1,023 other nodes want them. Relayed by the nodes that got them, it takes about log2(1,024)
    steps, not 1,023 sends from node 0; every node gets it, from a node that had it."""
    nodes = 1024
    order = relay([(n, "k") for n in range(1, nodes)], {"k": [0]})
    assert sorted(d for _, d, _ in order) == list(range(1, nodes))
    steps, got = _run(order)
    assert all(got[n] == {"k"} for n in range(1, nodes))
    assert steps <= 11, steps
    assert max(sum(1 for s, _, _ in order if s == n) for n in range(nodes)) <= 10, "no node sends to all"


def test_each_rank_is_sent_its_nodes_part_of_a_plan_alone():
    transfers = [
        Transfer(0, 1, ranks=((0, 1),)),
        Transfer(REMOTE, 2, ranks=((5, 6),)),
        Transfer(1, 2, indexes=((1, 2),)),
    ]
    after = {0: {0}, 1: {0, 1}, 2: {2, 5}}
    of_rank, leaders = [0, 0, 1, 1, 2, 2], {0: 0, 1: 2, 2: 4}
    parts = plan_parts(transfers, after, of_rank, leaders)
    assert parts[0] == ([transfers[0]], ((0, 1),))
    assert parts[1] == ([], ((0, 1),)), "not its node's leader: nothing to run"
    assert parts[2] == ([transfers[0], transfers[2]], ((0, 2),)), "a node's transfers in the plan's order"
    assert parts[4] == ([transfers[1], transfers[2]], ((2, 3), (5, 6)))
    assert parts[5] == ([], ((2, 3), (5, 6)))


def test_relay_takes_the_remote_tier_only_for_what_no_node_holds_and_merges_a_pairs_keys():
    order = relay([(1, "a"), (1, "b"), (2, "c")], {"a": [0, REMOTE], "b": [0], "c": [REMOTE]})
    assert order == [(REMOTE, 2, ["c"]), (0, 1, ["a", "b"])], "both at the first step"
    with pytest.raises(IncompleteCheckpointError, match="on no node of this job"):
        relay([(1, "z")], {})


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
        check_offer(offer, plan, "abc", "rank 0")
    ok = (
        b'{"files": [["shard-r00001-0000-abc.safetensors", 3]], '
        b'"spans": [["shard-r00003-0000-abc.safetensors", 3, 9, [[0, 4]]]]}'
    )
    assert check_offer(ok, plan, "abc", "rank 0") == [("shard-r00001-0000-abc.safetensors", 3)]


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


def test_the_byte_ranges_a_rank_reads_travel_merged(tmp_path):
    """Rank 0 gathers every rank's ranges in a node-local restore: fifty back-to-back tensors
    are one range (with the header), not fifty-one, whatever the world size."""
    from stashpoint._load.loader import ranges_needed
    from stashpoint._storage import LocalStorage

    state = {f"p{i}": torch.ones(2) for i in range(50)}
    stashpoint.save(state, tmp_path / "c")
    got = ranges_needed(LocalStorage(tmp_path / "c"), {k: torch.zeros(2) for k in state}, 0, skip=set())
    [(rank, size, spans)] = got.values()
    assert rank == 0 and spans == [(0, size)], got


def test_upload_parts_keep_each_rank_to_its_own_and_spread_the_rest_over_their_holders():
    own = [((0, 1),), ((1, 2),)]
    assert upload_parts(2, own) == ([((0, 1),), ((1, 2),)], [])
    swapped = [((1, 2),), ((0, 1),)]  # the nodes numbered anew
    assert upload_parts(2, swapped) == ([((1, 2),), ((0, 1),)], [])
    # four saved ranks, two live ranks on nodes holding two each, one node holding all (a replica)
    parts, missing = upload_parts(4, [((0, 4),), ((2, 4),)])
    assert missing == [] and sorted(expand(parts[0]) | expand(parts[1])) == [0, 1, 2, 3]
    assert not expand(parts[0]) & expand(parts[1]), "each saved rank uploaded once"
    assert parts[1] == ((3, 4),) and expand(parts[0]) == {0, 1, 2}
    assert upload_parts(3, [((0, 1),), ((0, 1), (5, 9))]) == ([((0, 1),), ()], [1, 2])


def test_the_inventory_keeps_only_the_newest_steps_manifest_in_memory(tmp_path):
    """A restore looks at every step's manifest for two fields: parsed one at a time, only the
    newest kept for the rest of the restore (hostile manifests of many MB each added up, step by
    step)."""
    from stashpoint._load import manifest as _manifest
    from stashpoint._manager.holdings import inventory

    with stashpoint.CheckpointManager(tmp_path / "run", node_local=True, keep_last=None) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"w": torch.ones(4)}).wait()
    with _manifest.remembering():
        held = inventory(LocalStorage(tmp_path / "run"))
        memo = _manifest._MEMO.get()
        assert [h.step for h in held] == [1, 2, 3]
        assert memo is not None and len([k for k in memo if k[0] == "head"]) == 1, list(memo)
