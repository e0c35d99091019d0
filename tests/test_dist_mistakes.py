"""Mistakes a distributed user makes, met with a clear error on every rank and never a split
job: a run directory that is not shared, ranks whose directories hold different steps, a
process group this rank is not in or that is not a group. Real processes, a real gloo group."""

from __future__ import annotations

import time

import torch

import stashpoint
from dist_util import WORKER, run_world

WORKER_OF = WORKER.with_name("readerror_worker.py")


def test_a_root_the_ranks_do_not_share_is_refused_at_the_first_save(tmp_path):
    """Before: every save "committed" on rank 0, no restart could load one, and the restart hung."""
    for r in run_world(2, "unshared_root", str(tmp_path), worker=WORKER_OF):
        assert "rank(s) 1 do not see the files rank 0 writes" in r.get("error", ""), r
        assert "node_local=True" in r["error"], r
        assert r["committed"] == [], r


def test_ranks_whose_roots_hold_different_steps_restore_the_same_one(tmp_path):
    """Before: each rank took the newest step of its own listing; the ranks loaded different
    steps and the job's collectives paired up across them."""
    for r in run_world(2, "restore_agrees", str(tmp_path), worker=WORKER_OF):
        assert r == {"step": 1, "value": 1.0}, r


def test_a_group_this_rank_is_not_in_or_a_mesh_is_refused_by_name(tmp_path):
    """Before: a non-member saved alone over the group's checkpoint; a DeviceMesh raised a KeyError."""
    results = run_world(2, "wrong_group", str(tmp_path), worker=WORKER_OF)
    assert results[1]["non_member"].startswith("ValueError: rank 1 is not a member of the process_group"), results
    for r in results:
        assert r["mesh"].startswith("TypeError: process_group must be a torch.distributed ProcessGroup"), r
        assert "mesh.get_group()" in r["mesh"], r


def test_saves_over_the_world_work_after_subgroups_some_ranks_are_not_in(tmp_path):
    """Before: the world's checkpoint group waited out its timeout on every rank (each rank's
    torch named it by a hash of how many groups that rank held)."""
    results = run_world(3, "subgroups_then_world", str(tmp_path), worker=WORKER_OF)
    for r in results:
        assert "error" not in r and r["seconds"] < 25, r
        assert r["loaded"] == [5.0, 5.0, 5.0], r
    assert all((tmp_path / d / "manifest.json").is_file() for d in ("pair", "world", "alone", "pair2"))


def test_a_managers_ranks_saving_different_steps_or_given_different_roots_are_told_so(tmp_path):
    """Before: different steps were called different paths, and different roots a root that
    is not on a shared file system."""
    for r in run_world(2, "manager_mismatches", str(tmp_path), worker=WORKER_OF):
        assert "the ranks saved different steps to one run (rank 0: step 1, rank 1: step 2)" in r["steps"], r
        assert "different roots (rank 0: " in r["roots"] and "own-0, rank 1: " in r["roots"], r
        assert "every rank must give the same root" in r["roots"], r


def test_a_load_failing_on_one_rank_raises_the_same_class_on_every_rank(tmp_path):
    """Before: the rank whose state did not fit raised StateMismatchError (its path missing:
    CheckpointNotFoundError) and the others a plain CheckpointError, so that an ``except`` of
    the kind caught on some ranks only."""
    for r in run_world(2, "load_kinds", str(tmp_path), worker=WORKER_OF):
        expected = {"mismatch": "StateMismatchError", "missing": "CheckpointNotFoundError"}
        assert r == {**r, **expected, "incomplete": "IncompleteCheckpointError", "mixed": "CheckpointError"}, r
        assert r["mismatch_path"] == "ck" and r["mismatch_pickles"] is True, r


def test_a_save_on_rank_0_alone_names_the_ranks_it_waits_for_before_it_times_out(tmp_path):
    """torch.save's ``if rank == 0:`` idiom. Before: rank 0 waited out the timeout (ten minutes
    by default) in silence, in the group's creation that holds the interpreter, and then failed
    naming a store key."""
    first, _ = run_world(2, "rank0_only_save", str(tmp_path), worker=WORKER_OF)
    for when, what in (("first", "create the checkpoint group"), ("later", "save hellos")):
        assert "rank(s) 1 did not come" in first[when] or "rank(s) 1 never reached it" in first[when], first
        (warning,) = [m for m in first[f"{when}_logged"] if "has waited" in m]
        # the warning at half the 8 s timeout, naming the rank, the collective and the fix
        assert float(warning.split(" s:")[0]) < 6.5, warning
        assert f"for rank(s) 1 to reach the checkpoint collective '{what}'" in warning, warning
        assert "not only rank 0" in warning, warning


def test_destroying_the_process_group_under_a_save_waits_for_it_or_says_to(tmp_path):
    for r in run_world(2, "destroyed_under_save", str(tmp_path / "a"), worker=WORKER_OF):
        assert r["error"] == "no error", r  # dist.destroy_process_group() waited for the save
    assert torch.equal(stashpoint.read(tmp_path / "a" / "ckpt")["w"], torch.ones(64 << 20 >> 2))
    for r in run_world(2, "destroyed_under_upload", str(tmp_path / "c"), worker=WORKER_OF):
        assert r["remote"] is True, r  # a manager's upload to its remote tier was waited for too
    for r in run_world(2, "destroyed_bare_under_save", str(tmp_path / "b"), worker=WORKER_OF):
        assert "process group was destroyed while the checkpoint collective" in r["error"], r
        assert "before torch.distributed.destroy_process_group()" in r["error"], r
    assert not (tmp_path / "b" / "ckpt" / "manifest.json").exists()


def test_a_managers_save_asks_for_the_steps_manifest_on_its_owner_alone(tmp_path):
    """Before: every rank asked (a HEAD each on S3: 16,384 a save at that scale), and a rank
    whose answer lagged submitted the save that the others refused, then waited out the timeout."""
    for r in run_world(2, "manifest_asked_once", str(tmp_path), worker=WORKER_OF):
        assert "step 2 already has a committed checkpoint" in r["again"], r
        assert ".." not in r["again"], r  # one full stop between the cause and what it means
        assert r["raised_by"] == "wait()", r  # alike on every rank: the owner's refusal reaches all by the handle
        assert r["again_s"] < 20, r
        if r["rank"] == 1:
            assert r["asked"] == 0, r
    assert torch.equal(stashpoint.read(tmp_path / "run" / "step-00000002")["w"], torch.full((4,), 2.0))


def test_a_rank_ending_on_an_uncaught_exception_exits_at_once_and_its_peers_save_fails_at_once(tmp_path):
    """Before: its exit waited out the 60 s shutdown barrier of stashpoint's groups, which its
    peer, waiting in a save's collective, never reached; the job ended a minute late."""
    t0 = time.monotonic()
    first, second = run_world(2, "dies_of_an_exception", str(tmp_path), worker=WORKER_OF, allow_fail=True)
    assert "CheckpointError" in first["error"] and first["took"] < 30, first
    assert second == {} and time.monotonic() - t0 < 45


def test_a_full_disk_on_one_node_is_named_by_its_own_directory_on_every_rank(tmp_path):
    """An ENOSPC names no file: the error rank 0 raised named node 0's directory alone."""
    for r in run_world(2, "node_disk_full", str(tmp_path), worker=WORKER_OF):
        assert "No space left on device (writing into " in r["error"], r
        assert f"{tmp_path / 'node-1'}/step-00000002)" in r["error"], r


def test_a_rank_gone_from_the_preemption_check_is_named_as_such(tmp_path):
    first, _ = run_world(2, "peer_gone_under_preemption", str(tmp_path), worker=WORKER_OF, allow_fail=True)
    assert first["error"].startswith("CheckpointError: the ranks' check for a preemption signal at step 4"), first
    assert "another rank left the job" in first["error"], first


def test_the_ranks_that_never_came_are_found_in_few_requests():
    """Before: one store request per rank of the world (16,384 at full scale)."""
    from dist_util import rendezvous_store
    from stashpoint._dist.arrival import absent

    store = rendezvous_store()
    world, missing = 3000, [0, 7, 255, 256, 1999, 2999]
    for r in range(world):
        if r not in missing:
            store.set(f"m/{r}", "1")
    asked = []
    real_check = store.check

    class Counting:
        def check(self, keys):
            asked.append(len(keys))
            return real_check(keys)

    assert absent(Counting(), "m", world) == missing
    assert len(asked) < 12 + 16 * len(missing), len(asked)


def test_a_collective_that_ends_at_once_asks_the_store_nothing_and_a_waiting_one_marks(tmp_path):
    """Before: every rank set a mark (and deleted an old one) at every collective, 32,768 store
    requests a collective at 16,384 ranks, all to one server; a rank that dies or never comes is
    still named (test_a_save_on_rank_0_alone_..., tests/test_distributed.py)."""
    results = run_world(2, "arrival_marks", str(tmp_path), worker=WORKER_OF)
    for r in results:
        assert r["calls"] > 3 and r["fast_marks"] == 0, r
    assert results[0]["rank0_marked_while_waiting"], results


def test_the_rank_that_skips_a_save_is_named_alone_though_the_others_wait_in_a_later_collective(tmp_path):
    """Three ranks, the last skipping one save. Before: once marks were set only after a wait,
    rank 1 (done with the save's first, rooted collective and waiting in the next) was named as
    never having reached it, beside rank 2."""
    results = run_world(3, "last_rank_skips_a_save", str(tmp_path), worker=WORKER_OF, timeout=120)
    first = results[0]
    assert "rank(s) 2 never reached it" in first["error"] or "rank(s) 2 did not come" in first["error"], first
    (warning,) = first["warnings"]
    assert "for rank(s) 2 to reach" in warning, warning


def test_optimizer_state_shaped_like_the_ranks_shard_of_an_fsdp2_parameter_is_warned_of_by_name(tmp_path):
    """An optimizer of one's own keeping plain tensors of each rank's shard: with shards of
    one size (one element each too) they were taken for one replicated value and one rank's
    kept, the others' lost with no word; with shards of two sizes the save failed on the ranks'
    disagreement with no word of why. Rank 0 now says so, naming the state and the fix (a
    warning: state the same on every rank may have a shard's shape too, and a refused save would
    leave the run with no checkpoint)."""
    for r in run_world(2, "shard_shaped_optimizer_state", str(tmp_path)):
        assert r["6"] == r["2"] == "saved", r
        assert "ranks disagree" in r["7"], r
        for rows in (6, 7, 2):
            said = r[f"{rows}-warned"]
            if r["rank"] == 0:
                assert len(said) == 1 and "the optimizer's state 'm' of parameter" in said[0], r
                assert "DTensor.from_local" in said[0] and "one rank's is saved" in said[0], said
            else:
                assert said == [], "said on rank 0 alone"
