"""Mistakes a distributed user makes, met with a clear error on every rank and never a split
job: a run directory that is not shared, ranks whose directories hold different steps, a
process group this rank is not in or that is not a group. Real processes, a real gloo group."""

from __future__ import annotations

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
