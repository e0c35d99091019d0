"""A file the process may not read is not a damaged checkpoint: a restore raises, names the
file and sets nothing aside, on every rank alike; damage found by one rank sends every rank
to the same older step. Real processes, a real gloo group, and (as root) a rank really
without the power to read a file of mode 000 (tests/readerror_worker.py)."""

from __future__ import annotations

import pytest

from dist_util import WORKER, run_world

NO_DAC = WORKER.with_name("readerror_worker.py")


@pytest.mark.parametrize("world", [1, 2])
def test_an_unreadable_shard_of_the_newest_step_is_raised_and_the_step_kept(tmp_path, monkeypatch, world):
    """Before: taken for damage, step 2 was set aside and step 1 loaded: progress lost."""
    monkeypatch.setenv("NO_DAC_RANK", str(world - 1))
    results = run_world(world, "unreadable_shard", str(tmp_path), worker=NO_DAC)
    for r in results:
        assert r["error"] == "CheckpointError", r
        assert r["set_aside"] == [], r
    last = results[-1]
    assert "Permission denied" in last["message"] and "shard-r" in last["message"], last
    assert "neither set aside" in last["message"], last
    assert (tmp_path / "step-00000002" / "manifest.json").exists()


def test_an_index_one_rank_cannot_read_is_raised_on_every_rank(tmp_path, monkeypatch):
    """The planning stage: only the last rank reads its index; every rank raises the same kind
    of error (one falling back while another raised would leave the job split)."""
    monkeypatch.setenv("NO_DAC_RANK", "1")
    results = run_world(2, "unreadable_index", str(tmp_path), worker=NO_DAC)
    assert [r["error"] for r in results] == ["CheckpointError", "CheckpointError"], results
    assert all(r["set_aside"] == [] for r in results), results
    assert "Permission denied" in results[1]["message"], results


def test_an_index_damaged_on_one_rank_sends_every_rank_back_to_the_same_step(tmp_path):
    """Before: the rank that found the damage fell back alone while the other raised."""
    for r in run_world(2, "damaged_index", str(tmp_path), worker=NO_DAC, timeout=120):
        assert r.get("step") == 1 and r.get("value") == 1.0, r
        assert len(r["set_aside"]) == 1, r


def test_an_unreadable_checkpoint_or_run_directory_is_a_checkpoint_error(tmp_path, monkeypatch):
    monkeypatch.setenv("NO_DAC_RANK", "0")
    (r,) = run_world(1, "unreadable_dir", str(tmp_path), worker=NO_DAC)
    assert r["load"].startswith("CheckpointError: ") and "Permission denied" in r["load"], r
    assert "manifest" in r["load"] or "ckpt" in r["load"], r
    assert r["manager"].startswith("CheckpointError: cannot create the checkpoint directory"), r
    assert "locked" in r["manager"], r


def test_a_manifest_one_rank_cannot_read_stops_every_rank(tmp_path, monkeypatch):
    """Read before the ranks' first agreement: before, that rank alone went on to step 1 while
    the others loaded step 2, and the job ran on split."""
    monkeypatch.setenv("NO_DAC_RANK", "1")
    results = run_world(2, "unreadable_manifest", str(tmp_path), worker=NO_DAC)
    assert [r.get("error") for r in results] == ["CheckpointError", "CheckpointError"], results
    assert all(r["set_aside"] == [] for r in results), results


def test_a_node_may_not_read_its_newest_manifest_is_an_error_not_an_older_step(tmp_path, monkeypatch):
    monkeypatch.setenv("NO_DAC_RANK", "0")
    (r,) = run_world(1, "node_manifest_unreadable", str(tmp_path), worker=NO_DAC)
    assert r["got"][0] == "CheckpointError" and "Permission denied" in r["got"][1], r


def test_a_replica_its_holder_cannot_read_leaves_no_copy_taken_for_whole(tmp_path, monkeypatch):
    """Node 1 is lost; node 0 may not read its copy of node 1's shard. Before, node 0 sent zeros
    for it, node 1 landed them as a whole copy, and the next restore found that copy damaged
    and set the good step aside on both nodes."""
    monkeypatch.setenv("NO_DAC_RANK", "0")
    results = run_world(2, "node_replica_unreadable", str(tmp_path), worker=NO_DAC)
    assert results[1]["taken_for_whole"] is False, results[1]
    for r in results:
        assert r["denied"][0] == "CheckpointError" and "Permission denied" in r["denied"][1], r
        assert r["fixed"] == [2, 2.0], r
        # (step 1 is set aside: only step 2 has a replica, so rank 1's files of step 1 are lost)
        assert not [n for n in r["set_aside"] if n.startswith("step-00000002")], r


def test_a_rank_out_of_memory_planning_a_node_local_restore_fails_every_rank_at_once(tmp_path):
    other, short = run_world(2, "node_planning_out_of_memory", str(tmp_path), worker=NO_DAC)
    assert short["short"][:2] == ["ShortOfMemoryError", True], short
    assert "planning the load of" in short["short"][2] and "on rank 1 ran out of memory" in short["short"][2], short
    assert other["short"][0] == "CheckpointError" and "rank 1" in other["short"][2], other
    for r in (short, other):
        assert r["short_s"] < 60, r  # not the group's timeout
        assert r["again"] == [2, 2.0], r


def test_nodes_given_different_replicas_are_refused_at_once(tmp_path):
    for r in run_world(2, "node_replicas_differ", str(tmp_path), worker=NO_DAC, timeout=40):
        assert "replicas=0 on rank(s) 0; replicas=1 on rank(s) 1" in r["got"], r
        assert r["seconds"] < 30, r


@pytest.mark.parametrize("lazy", ["", "1"])
def test_a_rank_gone_while_the_managers_open_with_preemption_fails_the_others_after_the_timeout(
    tmp_path, monkeypatch, lazy
):
    monkeypatch.setenv("LAZY", lazy)
    first, _ = run_world(2, "preempted_while_opening", str(tmp_path), worker=NO_DAC, timeout=60, allow_fail=True)
    assert first["got"].startswith("CollectiveError: could not create the preemption group"), first
    assert first["seconds"] < 40, first


@pytest.mark.parametrize("spoil", ["manifest", "shard"])
def test_a_nodes_damaged_copy_that_no_other_node_holds_is_set_aside_as_damaged(tmp_path, monkeypatch, spoil):
    monkeypatch.setenv("SPOIL", spoil)
    for r in run_world(2, "node_copy_damaged", str(tmp_path), worker=NO_DAC):
        assert r["got"] == [1, 1.0], r
        assert (
            sorted(n.split(".")[0] + "." + n.split(".")[1].split("-")[0] for n in r["set_aside"])
            == ["step-00000002.damaged"] * 2
        ), r


def test_retention_keeps_a_step_whose_manifest_it_cannot_read(tmp_path, monkeypatch):
    """Before: the unreadable metrics counted as none, so keep_best let the best step go."""
    monkeypatch.setenv("NO_DAC_RANK", "0")
    (r,) = run_world(1, "retention_unreadable", str(tmp_path), worker=NO_DAC)
    # step 1 kept (its metrics unknown), and so step 2, the best of those known, and step 3, the last
    assert r["steps"] == [1, 2, 3], r


@pytest.mark.parametrize("how", ["dir", "write"])
def test_a_replacement_node_that_cannot_land_its_files_raises_an_error_not_damage(tmp_path, monkeypatch, how):
    """Node 1 comes back from a loss with a directory it may not write (``dir``), or where its
    writes fail part-way through the transfer (``write``: a file-size limit, as under a quota):
    every rank raises a plain CheckpointError that names the cause, the newest step is kept,
    and the restore after the fix loads it."""
    monkeypatch.setenv("NO_DAC_RANK", "1")
    monkeypatch.setenv("LANDING_FAILS", how)
    results = run_world(2, "node_landing_unwritable", str(tmp_path), worker=NO_DAC)
    cause = "Permission denied" if how == "dir" else "failed (writing index-r00001"
    for r in results:
        assert r["denied"][0] == "CheckpointError" and cause in r["denied"][1], r
        assert r["fixed"] == [2, 2.0], r
        assert not [n for n in r["set_aside"] if n.startswith("step-00000002")], r


def test_verify_lists_a_shard_it_may_not_read_instead_of_raising(tmp_path, monkeypatch):
    monkeypatch.setenv("NO_DAC_RANK", "0")
    (r,) = run_world(1, "verify_unreadable_shard", str(tmp_path), worker=NO_DAC)
    assert r.get("ok") is False and "Permission denied" in " ".join(r["problems"]), r
