"""Sharded states at their edges: empty shards, tied tensors, a DTensor beside its own local
shard, placements a load cannot write. Each saves and loads back exactly, or is refused by key.
Real processes, a real gloo group."""

from __future__ import annotations

from dist_util import WORKER, run_world

WORKER_OF = WORKER.with_name("shard_edges_worker.py")


def test_a_tied_tensor_whose_shard_is_empty_on_a_rank_loads_back(tmp_path):
    """Before: the rank with no rows stored the second key as an empty tensor of its own, the
    others as the first key's bytes; the committed manifest gave it no chunks, and no load (nor
    a manager's restore) could read the checkpoint."""
    results = run_world(2, "tied_with_an_empty_shard", str(tmp_path), worker=WORKER_OF)
    assert all(r["loaded"] and r["detached"] and r["untied"] == [0.0, 100.0] for r in results), results
    assert results[0]["read"], results


def test_fsdp_with_a_zero_element_parameter_saves_and_loads(tmp_path):
    """Before: FSDP2 holds the empty shard as (0, 0) where its place is (2, 0): every save failed
    while staging ("The size of tensor a (2) must match the size of tensor b (0)")."""
    for r in run_world(2, "fsdp_with_an_empty_parameter", str(tmp_path), worker=WORKER_OF):
        assert r == {"same": True}, r


def test_a_dtensor_beside_its_own_local_shard_saves_both(tmp_path):
    """Before: the local shard was stored as the DTensor's global tensor (the same bytes), and
    the load refused the state that saved it (float32[8, 6] saved, [4, 6] held)."""
    for r in run_world(2, "dtensor_beside_its_own_local_shard", str(tmp_path), worker=WORKER_OF):
        assert r == {"w": True, "local": True}, r


def test_a_load_into_a_partial_dtensor_is_refused_by_key(tmp_path):
    """Before: each rank read the whole saved tensor into its local part: the Partial sum was
    twice the saved value, with no error and no warning."""
    for r in run_world(2, "load_into_a_partial_dtensor", str(tmp_path), worker=WORKER_OF):
        assert r["error"] == "StateMismatchError" and "'a'" in r["message"] and "Partial" in r["message"], r
        assert r["untouched"], r


def test_pipeline_stages_saved_by_their_ranks_load_into_the_whole_model_in_one_process(tmp_path):
    """Each rank saved its own stage (different keys); one process (an evaluation, an export)
    loads the whole model. Before: each of the other stages' tensors was a missing key, though
    the checkpoint holds them (this rank's tree holds its saved rank's structure alone)."""
    import torch

    import stashpoint
    from shard_edges_worker import stage_model

    run_world(2, "pipeline_stages", str(tmp_path), worker=WORKER_OF)
    whole = stage_model(None)
    for p in whole.parameters():
        torch.nn.init.zeros_(p)
    state = {"model": whole, "step": 0}
    stashpoint.load(state, tmp_path / "ck")
    assert state["step"] == 7
    want = stage_model(None).state_dict()
    got = whole.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_diff_of_one_state_saved_sharded_and_whole_says_how_each_tensor_was_compared(tmp_path):
    """Before: "2 tensor(s) compared (by the checksums recorded ...)" where only the scalar was:
    the sharded tensor's chunks differ between the two, so its data was read and compared."""
    from click.testing import CliRunner

    from stashpoint._tools.cli import main

    run_world(2, "sharded_and_whole", str(tmp_path), worker=WORKER_OF)
    r = CliRunner().invoke(main, ["diff", str(tmp_path / "sharded"), str(tmp_path / "whole")])
    assert r.exit_code == 0, r.output
    assert "2 tensor(s) compared (1 by the checksums recorded, 1 by their data;" in r.output, r.output
