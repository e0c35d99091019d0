"""Ranks that make different stashpoint calls, open different checkpoints, or fail apart: every
rank gets a CheckpointError that says so, soon, and the next call made in step works. Real
processes, a real gloo group."""

from __future__ import annotations

from dist_util import WORKER, run_world

WORKER_OF = WORKER.with_name("rankmix_worker.py")


def test_ranks_that_open_different_checkpoints_fail_together_and_load_nothing(tmp_path):
    """Before: each rank loaded its own checkpoint in silence; with the exchange, rank 1 took
    rank 0's tensors and its own plain values (a state of two checkpoints)."""
    for rank, r in enumerate(run_world(2, "different_checkpoints", str(tmp_path), worker=WORKER_OF)):
        for exchange in ("exchange=False", "exchange=True"):
            got = r[exchange]
            assert got["error"] == "CheckpointError", r
            assert "the ranks opened different checkpoints" in got["message"], r
            assert "rank(s) 1 opened another one than rank 0" in got["message"], r
            assert got["state"] == [0.0, 0], r  # nothing of either checkpoint
            assert got["seconds"] < 10, r
        assert r["same"]["ok"] and r["same"]["state"] == [2.0, 2], (rank, r)


def test_ranks_at_different_calls_are_told_so_and_the_next_save_in_step_works(tmp_path):
    """Before: rank 0's restore read rank 1's host name as its listing (a bare AttributeError),
    and rank 1 waited out the timeout."""
    for r in run_world(2, "different_calls", str(tmp_path), worker=WORKER_OF):
        assert r["ok"] is False and r["error"] == "CollectiveError", r
        assert "the ranks are at different stashpoint calls" in r["message"], r
        assert r["seconds"] < 10, r
        assert r["after"]["ok"], r


def test_exchange_given_on_some_ranks_only_still_loads(tmp_path):
    """Before: the ranks left to decide asked the others which hosts they run on, and those
    that were told did not: a bare TypeError on one rank, a timeout on the other."""
    for r in run_world(2, "exchange_given_on_one_rank", str(tmp_path), worker=WORKER_OF):
        assert r["ok"] and r["state"] == [3.0, 3], r


def test_an_objects_load_failing_on_one_rank_fails_the_load_on_every_rank(tmp_path):
    """Before: rank 0's load and restore returned (step 2) while rank 1 raised: the ranks went
    on apart."""
    for rank, r in enumerate(run_world(2, "object_fails_on_one_rank", str(tmp_path), worker=WORKER_OF)):
        for call in ("load", "restore"):
            assert r[call]["ok"] is False and r[call]["error"] == "CheckpointError", (rank, r)
            assert "rank 1 cannot take v=2" in r[call]["message"], (rank, r)
            assert r[call]["seconds"] < 10, (rank, r)
        assert "The objects' own loads run last" in r["load"]["message"] if rank == 1 else True, r
        assert r["after"]["ok"], (rank, r)


def test_a_save_one_rank_refuses_for_its_arguments_fails_at_once_everywhere_and_the_next_works(tmp_path):
    """Before: rank 1 raised and the others waited out the timeout; their next save, made in
    step, failed too (rank 0 had dropped the group that rank 1 still held)."""
    results = run_world(2, "bad_argument_on_one_rank", str(tmp_path), worker=WORKER_OF)
    assert results[1]["refused"]["error"] == "ValueError", results
    assert results[1]["manager"]["error"] == "ValueError", results
    for r in results:
        for call in ("refused", "manager"):
            assert r[call]["ok"] is False and r[call]["seconds"] < 10, r
        assert "rank 1 refused the save: ValueError: max_shard_bytes" in results[0]["refused"]["message"], results
        assert "rank 1 refused the save: ValueError: on_busy" in results[0]["manager"]["message"], results
        assert r["next"]["ok"] and r["manager_next"]["ok"], r


def test_the_save_after_a_load_that_timed_out_works(tmp_path):
    """Before: a load's failed collective left its group in place, its pairs closed by the
    timeout: the next save, made in step, failed on every rank."""
    for r in run_world(2, "late_to_a_load", str(tmp_path), worker=WORKER_OF):
        assert r["late"]["ok"] is False and r["late"]["error"] == "CollectiveError", r
        assert r["next"]["ok"], r


def test_a_manager_refused_on_one_rank_is_named_by_the_others_preemption_group(tmp_path):
    """Before: rank 0 waited in the preemption group's creation for stashpoint's whole timeout
    (600 s by default), logging nothing, then named no rank."""
    first, second = run_world(2, "manager_refused_on_one_rank", str(tmp_path), worker=WORKER_OF, timeout=90)
    assert second["error"] == "ValueError", second
    assert first["error"] == "CollectiveError", first
    assert "rank(s) 1 did not come to create the preemption group of their CheckpointManagers" in first["message"]
    assert "did the constructor raise on those ranks" in first["message"], first
    assert 7 < first["seconds"] < 20, first
    assert first["warned"] and "rank(s) 1" in first["warned"][0], first  # named while it still waits


def test_a_plain_value_refused_on_one_rank_fails_the_load_on_every_rank(tmp_path):
    """The diff review of the agreement after the objects' loads: a container's own error
    (not a CheckpointError) skipped it on rank 1, and rank 0 waited out the timeout."""
    for r in run_world(2, "plain_value_refused_on_one_rank", str(tmp_path), worker=WORKER_OF):
        assert r["load"]["ok"] is False and r["load"]["error"] == "CheckpointError", r
        assert "config is frozen" in r["load"]["message"] and r["load"]["seconds"] < 10, r
        assert r["next"]["ok"], r


def test_a_managers_save_refused_for_its_arguments_keeps_the_remote_tiers_uploads_in_step(tmp_path):
    """The diff review: the refusing rank queued no upload of the refused step, the others did;
    every later upload failed as out of step."""
    for r in run_world(2, "bad_argument_with_a_remote_tier", str(tmp_path), worker=WORKER_OF):
        assert r["refused"]["ok"] is False, r
        assert r["wait"]["ok"] or "step 2" in r["wait"]["message"], r
        assert r["remote"] == [1, 3, 4], r
