"""Collective saves and loads with real processes in a real gloo process group."""

from __future__ import annotations

import json

import pytest

from conftest import to_v1, whole
from dist_util import run_world
from stashpoint._core.naming import MANIFEST_NAME


def _manifest(path):
    """The whole checkpoint as a version-1 document (every chunk listed), whatever its version."""
    return json.loads(whole(path).to_json())


def _bytes_per_rank(path) -> dict[int, int]:
    out: dict[int, int] = {}
    for f in _manifest(path)["files"]:
        out[f["rank"]] = out.get(f["rank"], 0) + f["size"] - f["data_start"]
    return out


@pytest.mark.parametrize("n_save", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_ddp_replicated_state_is_written_once_spread_over_ranks_and_loads_on_any_world(tmp_path, n_save):
    ck = tmp_path / "ck"
    saved = run_world(n_save, "ddp_save", str(ck))
    m = _manifest(ck)
    assert m["world_size"] == n_save
    # replicated tensors are written once in total, and spread: every rank writes some
    per_rank = _bytes_per_rank(ck)
    assert sorted(per_rank) == list(range(n_save))
    model_and_optim = sum(per_rank.values())
    assert max(per_rank.values()) < 0.75 * model_and_optim, per_rank
    for key, entry in m["tensors"].items():
        assert len(entry.get("chunks", [])) <= 1, f"{key} written more than once"
    # per-rank plain values (RNG, notes) are kept per rank
    assert len(m["trees"]) == n_save
    for n_load in (1, n_save, n_save + 1):
        loaded = run_world(n_load, "ddp_load", str(ck))
        for rank, r in enumerate(loaded):
            src = rank % n_save
            assert r["same"] and r["step"] == 3 and r["has_optim_state"]
            assert r["note"] == f"rank {src}", "each rank gets back what its rank saved"
            assert r["rng_next"] == saved[src]["rng_next"], "the RNG streams continue per rank"


# the default tier runs a sharded load of a replicated save and a 2-D one on fewer ranks (the
# stacks load FSDP2 2 -> 3); the slow tier all of them
DTENSOR_CASES = [
    pytest.param(2, "s0", 3, "s1", marks=pytest.mark.slow),
    pytest.param(2, "s1", 2, "rep", marks=pytest.mark.slow),
    pytest.param(3, "s0", 2, "s0", marks=pytest.mark.slow),
    (2, "rep", 3, "s0"),
    (4, "s0s1", 2, "s1"),
    pytest.param(4, "s1rep", 4, "reps0", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("n_save", "save_kind", "n_load", "load_kind"), DTENSOR_CASES)
def test_dtensor_save_on_n_load_on_m_with_another_sharding(tmp_path, n_save, save_kind, n_load, load_kind):
    ck = tmp_path / "ck"
    run_world(n_save, "dtensor_save", str(ck), save_kind)
    m = _manifest(ck)
    for entry in m["tensors"].values():  # chunks tile the global tensor exactly once
        numel = 1
        for d in entry["shape"]:
            numel *= d
        got = 0
        for c in entry["chunks"]:
            n = 1
            for d in c["shape"]:
                n *= d
            got += n
        assert got == numel, entry
    for r in run_world(n_load, "dtensor_load", str(ck), load_kind):
        assert all(r["ok"].values()), r
        assert r["step"] == 1
    for r in run_world(1, "plain_load", str(ck)):  # and onto one process, unsharded
        assert all(r["ok"].values()), r


def test_plain_checkpoint_loads_into_dtensors(tmp_path):
    run_world(1, "plain_save", str(tmp_path / "ck"))
    for r in run_world(2, "dtensor_load", str(tmp_path / "ck"), "s1"):
        assert all(r["ok"].values()), r


def test_fsdp2_on_two_ranks_loads_into_a_plain_model_on_one(tmp_path):
    run_world(2, "fsdp_save", str(tmp_path / "ck"))
    (r,) = run_world(1, "fsdp_to_plain", str(tmp_path / "ck"))
    assert r["same_model"] and r["same_moments"]


def test_zero_redundancy_optimizer_is_refused_with_what_to_use_instead(tmp_path):
    """Before: torch's RuntimeError ("consolidate_state_dict") escaped the save."""
    (r,) = run_world(1, "zero_refused", str(tmp_path / "ck"))
    assert len(r["errors"]) == 2 and all("ZeroRedundancyOptimizer is not supported" in e for e in r["errors"]), r
    assert all("Use FSDP2" in e for e in r["errors"]) and not r["exists"], r


def test_fsdp2_left_unsharded_by_a_forward_still_names_the_optimizers_parameters(tmp_path):
    """Before: the state was keyed by index when saved after a no-grad forward, and a load after
    one refused, saying some parameters belong to no module in the state."""
    (r,) = run_world(1, "fsdp_unsharded_names", str(tmp_path / "ck"))
    assert r["saved_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"] and r["same_moments"], r


def test_an_optimizer_saved_as_dcps_named_dict_loads_into_a_fresh_fsdp2_optimizer(tmp_path):
    """Saved as ``get_state_dict``'s dicts (or by DCP and imported): the optimizer's state is
    keyed by parameter name. A fresh FSDP2 optimizer loading it gets DTensor moments equal to the
    saved ones, and steps (plain full-size moments made its first step fail)."""
    import shutil

    from stashpoint._tools.convert import import_checkpoint

    ck = tmp_path / "ck"
    run_world(2, "fsdp_save_dicts", str(ck))
    import_checkpoint(tmp_path / "ck-dcp", tmp_path / "imported")
    shutil.copy(tmp_path / "ck.ref.pt", tmp_path / "imported.ref.pt")
    for path in (ck, tmp_path / "imported"):
        for r in run_world(2, "fsdp_load_modules", str(path)):
            assert r["kinds"] == ["DTensor"] and r["same_moments"], (path.name, r)


def test_training_all_reduces_while_background_saves_coordinate(tmp_path):
    results = run_world(2, "train_loop", str(tmp_path / "run"), "30", timeout=240)
    for r in results:
        assert r["replicas_equal"]
        assert r["steps"][-2:] == [27, 30]
    assert results[0]["steps"] == [27, 30], "rank 0 applied the retention (keep_last=2) before closing"
    # each save's metrics were kept on rank 1 for good (only the owner's retention forgets them)
    assert [r["metrics_kept"] for r in results] == [2, 0]


@pytest.mark.parametrize("how", ["kill", pytest.param("stall", marks=pytest.mark.slow)])
def test_a_rank_dying_or_stalling_mid_save_fails_it_on_the_others_within_the_timeout(tmp_path, how):
    import torch

    import stashpoint

    ck = str(tmp_path / "ck")
    results = run_world(2, "fail_mid_save", ck, "1", how, timeout=150, allow_fail=True)
    survivor = results[0]
    assert survivor["raised"], survivor
    assert survivor["seconds"] < 40, "failed within the 10 s timeout (plus teardown), not after the stall"
    assert "rank 0" in survivor["message"] and "peer rank died, stalled" in survivor["message"]
    assert "rank(s) 1 never reached it" in survivor["message"], survivor["message"]
    assert not (tmp_path / "ck" / MANIFEST_NAME).exists(), "nothing committed"
    prev = {"w": torch.zeros(1000), "x": torch.zeros(10)}
    stashpoint.load(prev, ck + "-prev")  # the earlier checkpoint stays loadable
    assert prev["x"].sum() == 10


def test_a_rank_failing_as_it_plans_its_files_fails_every_rank_at_once(tmp_path):
    results = run_world(2, "fail_planning_files", str(tmp_path / "ck"), timeout=150)
    for r in results:
        assert r["raised"] and r["seconds"] < 30, r  # not the 60 s timeout
        assert "rank(s) 1" in r["message"] and "MemoryError: injected" in r["message"], r
    assert not (tmp_path / "ck" / MANIFEST_NAME).exists()


def test_a_rank_0_slowed_past_the_timeout_leaves_the_save_committed_and_whole(tmp_path):
    """The others stop waiting after 4 s while rank 0 builds and writes the manifest for 7 s:
    they must not delete their shards, since rank 0 may (and here does) still commit."""
    results = run_world(2, "slow_commit", str(tmp_path / "ck"), "7", timeout=150)
    assert results[0]["committed"] and results[1]["committed"], results  # rank 0 commits late
    assert all(r["verified"] for r in results), results  # and whole: every shard is still there
    slow = results[1]
    assert slow["raised"] and "either complete and loadable or not committed" in slow["message"], slow


@pytest.mark.slow  # ~60 s: several worlds, each read path
def test_replicated_state_is_read_once_and_exchanged_or_read_directly(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    run_world(2, "ddp_save", str(ck))
    data = sum(_bytes_per_rank(ck).values())
    shared = run_world(3, "ddp_load_count", str(ck), "1")
    direct = run_world(3, "ddp_load_count", str(ck), "0")
    for r in shared + direct:
        assert r["same"]
        assert r["exp_avg"] == shared[0]["exp_avg"]
    assert [r["note"] for r in shared] == ["rank 0", "rank 1", "rank 0"]
    for r in direct:
        assert r["read"] >= data, "without exchange every rank reads everything"
    total_shared = sum(r["read"] for r in shared)
    assert total_shared < 1.3 * data, (total_shared, data)  # storage sees each byte about once
    # a state this small (under one exchange window) is read by one rank, in one broadcast
    assert sorted(r["read"] for r in shared)[-2] < 0.1 * data, [r["read"] for r in shared]
    monkeypatch.setenv("STASHPOINT_READ_SHARE_FLOOR", "0")  # every rank a reader: shares broadcast in turn
    spread = run_world(3, "ddp_load_count", str(ck), "1")
    assert all(r["same"] and r["exp_avg"] == shared[0]["exp_avg"] for r in spread)
    assert sum(r["read"] for r in spread) < 1.3 * data and max(r["read"] for r in spread) < 0.6 * data


def test_planning_runs_once_per_structure_and_never_on_the_callers_thread(tmp_path):
    for r in run_world(2, "plan_cache", str(tmp_path)):
        assert r["plans"] == 2 and r["described"] == 2, r
        assert all(t.startswith("stashpoint-writer") for t in r["threads"]), r
        # replicated (DDP-like) state: planned from one description, no rank sent its layout
        assert "description" in r["kinds"] and "layouts" not in r["kinds"], r


def test_later_saves_send_and_receive_a_bounded_few_hundred_bytes_per_rank(tmp_path):
    """Issue 19: after a structure's first save, a rank's collectives carry O(1) bytes (a 512-byte
    gather slot per gather, a short answer from rank 0) and rank 0 receives O(R) slots."""
    world = 3
    results = run_world(world, "save_bytes", str(tmp_path))
    for rank, r in enumerate(results):
        assert r["plans"] == 1, r
        first, *later = r["per_save"]
        for sent, received in later:
            assert sent <= (2048 if rank == 0 else 1024), (rank, r)  # rank 0 also sends the answers
            assert received <= (world * 1024 + 512 if rank == 0 else 512), (rank, r)
        if rank:
            assert first[1] > later[0][1], "the first save also sends each rank its part of the plan"
    for i in range(4):
        assert _manifest(tmp_path / f"s{i}")["world_size"] == world


@pytest.mark.slow  # ~60 s; version-1 loads are also in test_format_v2.py
def test_a_load_reads_only_the_indexes_its_regions_need_and_version_1_still_loads(tmp_path, monkeypatch):
    """Same world: a rank's own index and rank 0's (small replicated tensors); on half the world,
    also the writers of the rows it loads. A version-1 copy (every chunk in the manifest, no
    indexes) of the same checkpoint loads too. The files of each two ranks share a directory, as
    those of each 1,024 do in a larger world."""
    import shutil

    ck, old = tmp_path / "ck", tmp_path / "v1"
    monkeypatch.setenv("STASHPOINT_RANKS_PER_DIR", "2")
    run_world(4, "dtensor_save", str(ck), "s0")
    monkeypatch.delenv("STASHPOINT_RANKS_PER_DIR")
    assert sorted(p.name for p in ck.iterdir()) == ["g00000", "g00001", MANIFEST_NAME]
    indexes = sorted(p.relative_to(ck).as_posix()[:19] for p in ck.glob("*/index-*.json"))
    assert indexes == ["g00000/index-r00000", "g00000/index-r00001", "g00001/index-r00002", "g00001/index-r00003"]
    shutil.copytree(ck, old)
    to_v1(old)
    assert not list(old.glob("*/index-*"))
    for rank, r in enumerate(run_world(4, "indexes_read", str(ck), "s0")):
        assert r["loads"][0]["ok"] and set(r["loads"][0]["read"]) <= {0, rank}, (rank, r)
    for rank, r in enumerate(run_world(2, "indexes_read", str(ck), "s0", str(old))):
        new, legacy = r["loads"]
        assert new["ok"] and set(new["read"]) <= {0, rank, 2 * rank, 2 * rank + 1}, (rank, r)  # rank: its tree
        assert legacy["ok"] and legacy["read"] == [], (rank, r)


def test_an_error_on_one_rank_fails_that_save_on_all_and_the_ranks_stay_in_step(tmp_path):
    results = run_world(2, "asym_error", str(tmp_path))
    for r in results:
        assert r["a"].startswith(("UnsupportedStateError", "CheckpointError")), r
        assert "skip" in r["skip"] and "distributed" in r["skip"], r
    assert ("rank(s) 1" in results[0]["a"] and "_thread" not in results[0]["a"]) or "object" in results[0]["a"]
    assert not (tmp_path / "a" / MANIFEST_NAME).exists()
    assert (tmp_path / "b" / MANIFEST_NAME).exists(), "the next save commits: the ranks are still in step"


def test_all_ranks_fall_back_to_the_same_step_when_one_rank_finds_damage(tmp_path):
    for r in run_world(2, "fallback", str(tmp_path / "run")):
        assert r == {"step": 1, "value": 1.0, "state_step": 1}, r


def test_an_atomic_load_that_finds_damage_on_one_rank_changes_nothing_on_any_rank(tmp_path):
    for r in run_world(2, "atomic_load", str(tmp_path / "c")):
        assert r == {"error": "CorruptCheckpointError", "untouched": True, "step": 0}, r


def test_the_next_save_works_once_the_ranks_are_back_together(tmp_path):
    results = run_world(2, "recover", str(tmp_path), timeout=120)
    for r in results:
        assert r["first"] != "ok" and r["second"] == "ok", r
    assert not (tmp_path / "a" / MANIFEST_NAME).exists()
    assert (tmp_path / "b" / MANIFEST_NAME).exists()


def _writers(path) -> dict[str, int]:
    """Which rank wrote each tensor of a checkpoint (from its shard file's name)."""
    return {k: int(e["chunks"][0]["file"][7:12]) for k, e in _manifest(path)["tensors"].items() if e.get("chunks")}


@pytest.mark.parametrize("mode", ["thread", "process", "overlap"])
def test_ddp_ranks_copy_only_what_they_write_once_the_plan_is_known(tmp_path, mode):
    """The first save copies the whole replicated state on every rank (nobody knows yet who
    writes what); from the second on each rank copies only its part, and every checkpoint holds
    the state at the moment of its call while training went on."""
    import torch

    import stashpoint

    results = run_world(2, "ddp_partial", str(tmp_path), mode)
    held = results[0]["held"]
    for r in results:
        first, *later = r["saves"]
        assert first["staged"] == held, "the first save copies everything"
        for s in later:
            assert 0 < s["staged"] < 0.75 * held, s
    for i in (1, 2):
        assert sum(r["saves"][i]["staged"] for r in results) == held, "each tensor copied by one rank"
    for i in range(3):
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        stashpoint.load({"model": model, "optim": optim, "step": -1}, tmp_path / f"s{i}")
        ref = torch.load(tmp_path / f"ref{i}.pt", weights_only=True)
        assert all(torch.equal(ref["model"][k], v) for k, v in model.state_dict().items()), f"save {i}"
        got = optim.state_dict()["state"]
        assert sorted(got) == sorted(ref["optim"]), f"save {i}"
        for p, moments in ref["optim"].items():
            assert all(torch.equal(v, got[p][name]) for name, v in moments.items()), f"save {i}, param {p}"


def test_replicas_changing_unevenly_between_saves_fail_one_save_at_most_then_commit(tmp_path):
    """Rank 1 adds a tensor of its own (a plan under constraint, then a free one), then drops a
    replicated tensor it wrote while rank 0 keeps it unchanged: nobody copied it, so that save
    fails on both ranks; the next commits, and those structures are copied whole from then on."""
    import torch

    import stashpoint

    results = run_world(2, "uneven_change", str(tmp_path))
    r0, r1 = (r["saves"] for r in results)
    # 1: both copy a and b; 2: each copies its own (a to rank 0, b to rank 1)
    assert r0[0]["staged"] == r1[0]["staged"] == 8000
    assert r0[1]["staged"] == r1[1]["staged"] == 4000
    # 3: rank 1's structure changed (it copies all); rank 0 copied only a: b and c go to rank 1
    assert r0[2]["ok"] and r1[2]["ok"]
    assert (r0[2]["staged"], r1[2]["staged"]) == (4000, 8400)
    assert _writers(tmp_path / "s3") == {"a": 0, "b": 1, "c": 1}
    assert (r0[3]["staged"], r1[3]["staged"]) == (8000, 8400), "after a constrained plan, one free one"
    # 5: rank 1 wrote b and dropped it; rank 0 still holds b but did not copy it: that save fails
    for r in (r0, r1):
        assert not r[4]["ok"] and "no rank copied 'b'" in r[4]["error"], r[4]
        assert "the next save copies every tensor" in r[4]["error"]
    assert not (tmp_path / "s5" / MANIFEST_NAME).exists()
    # 6: every rank copies everything again, and the save commits
    assert r0[5]["ok"] and r1[5]["ok"] and r0[5]["staged"] == 8000 and r1[5]["staged"] == 4400
    assert _writers(tmp_path / "s6")["b"] == 0
    assert r0[6]["ok"] and r1[6]["ok"] and (r0[6]["staged"], r1[6]["staged"]) == (8000, 4400), (
        "structures that once left a tensor uncopied are copied whole from then on"
    )
    from safetensors.torch import load_file

    for k in (1, 2, 3, 4, 6, 7):  # each holds the values at its call
        state = {"a": torch.zeros(1000), "b": torch.zeros(1000)}
        stashpoint.load(state, tmp_path / f"s{k}")  # rank 0's structure
        assert bool((state["a"] == k).all()) and bool((state["b"] == 100 + k).all()), (k, state)
        if k > 2:  # rank 1's own tensor, read from its shard file
            c = load_file(tmp_path / f"s{k}" / _manifest(tmp_path / f"s{k}")["tensors"]["c"]["chunks"][0]["file"])["c"]
            assert bool((c == 200 + k).all()), (k, c)


def test_store_keys_stay_short_at_16384_ranks():
    """The job's store refuses keys over 8 KiB; a key naming every rank would pass that at ~1,500."""
    from stashpoint._dist.group import DistContext

    ctx = DistContext(None, tuple(range(16384)), 0, 16384, 10.0)
    other = DistContext(None, tuple(range(1, 16385)), 0, 16384, 10.0)
    assert len(ctx._store_prefix()) < 64 and ctx._store_prefix() != other._store_prefix()


def test_a_checkpoint_one_process_saved_warns_every_rank_that_resumes_its_rng_state(tmp_path):
    import subprocess
    import sys

    ck = tmp_path / "ck"
    code = "import sys, torch, stashpoint; stashpoint.save({'w': torch.ones(8), 'rng': stashpoint.RNGState()}, "
    code += "sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(ck)], check=True, timeout=120)
    for r in run_world(2, "rng_resume", str(ck)):
        assert any("saved by 1 rank and is loaded by 2" in w and "of saved rank 0" in w for w in r["warnings"]), r


def test_ranks_saving_to_paths_of_their_own_are_told_to_pass_one_path(tmp_path):
    for r in run_world(2, "per_rank_paths", str(tmp_path)):
        assert r["error"] and "passed different paths to one save" in r["error"], r
        assert "ckpt_0" in r["error"] and "ckpt_1" in r["error"]


def test_rank_0s_own_long_message_does_not_pad_a_gather(tmp_path):
    """A restore's gather, where rank 0 alone adds the remote tier's listing (thousands of steps):
    each rank sent it padded to that length, R x S bytes to rank 0."""
    results = run_world(3, "gather_root_long", str(tmp_path))
    assert all(r["ok"] for r in results), results
    assert results[0]["received"] < 10_000, results[0]


def test_a_tied_model_loading_an_untied_checkpoint_of_two_ranks_decides_alike_on_every_rank(tmp_path):
    """Before the check read the writers' indexes: equal values were refused (each rank saw one
    tensor's chunks), differing ones loaded silently, and strict=False left the replicas apart."""
    results = run_world(2, "tied_untied", str(tmp_path))
    for r in results:
        for rows in (1, 2000):
            assert r[f"{rows}-equal-True"] == r[f"{rows}-equal-False"] == "emb", (rows, r)
            assert r[f"{rows}-differ-True"] == "refused", (rows, r)
            assert r[f"{rows}-differ-False"] == "emb", (rows, r)
