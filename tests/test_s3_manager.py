"""The CheckpointManager, the tiers and the command line on s3:// roots, against a real
S3-compatible server (SeaweedFS, started by the tests: see tests/s3_server.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import torch

import stashpoint
from conftest import ROOT
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._storage import storage_for


def _state(v: int) -> dict:
    g = torch.Generator().manual_seed(v)
    return {"w": torch.randn(200_000, generator=g), "b": torch.full((7,), float(v)), "step": v}


def _empty() -> dict:
    return {"w": torch.zeros(200_000), "b": torch.zeros(7), "step": -1}


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"]


def test_manager_on_an_s3_root_lists_retains_restores_and_cleans_leftovers(s3_url):
    with stashpoint.CheckpointManager(s3_url, keep_last=2, keep_best=(1, "loss")) as mgr:
        assert mgr.restore(_empty()) is None and mgr.latest_step() is None
        for step, loss in ((1, 0.5), (2, 3.0), (3, 2.0), (4, 1.0)):
            mgr.save(step, _state(step), metrics={"loss": loss})
            mgr.wait()
        assert mgr.steps() == [1, 3, 4], "newest two + the best loss"
        assert mgr.path(4) == f"{s3_url}/step-00000004"
        out = _empty()
        assert mgr.restore(out) == 4 and _same(out, _state(4))
    # a crash leftover under the root (shards, no manifest) is removed by the next manager
    leftover = storage_for(s3_url).child("step-00000009")
    w = leftover.open_writer("shard-r00000-0000-deadbeef.safetensors", 3)
    w.write(b"abc")
    w.close()
    with stashpoint.CheckpointManager(s3_url, keep_last=2) as mgr:
        assert "step-00000009" not in storage_for(s3_url).children()
        assert mgr.steps() == [1, 3, 4]
    storage_for(s3_url).commit("notes.txt", b"mine")
    rep = stashpoint.verify(s3_url)  # the run directory: every step, and what the manager did not write
    assert rep.ok and rep.steps == 3, rep
    assert [w for w in rep.warnings if "notes.txt was not written by stashpoint's manager" in w], rep.warnings


def test_a_damaged_s3_step_is_skipped_and_moved_aside(s3_url):
    with stashpoint.CheckpointManager(s3_url, keep_last=None) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        mgr.wait()
    step2 = storage_for(s3_url).child("step-00000002")
    (shard,) = [n for n in step2.list() if n.startswith("shard-")]
    data = bytearray(step2.read(shard))
    data[-50] ^= 0xFF
    w = step2.open_writer(shard, len(data))
    w.write(bytes(data))
    w.close()
    with stashpoint.CheckpointManager(s3_url, keep_last=None) as mgr:
        out = _empty()
        assert mgr.restore(out) == 1 and _same(out, _state(1))
        assert mgr.steps() == [1]
        assert any(n.startswith("step-00000002.damaged-") for n in storage_for(s3_url).children())


def test_local_tier_with_an_s3_remote_and_a_fresh_node(tmp_path, s3_url):
    local = tmp_path / "nvme"
    with stashpoint.CheckpointManager(local, keep_last=1, remote_root=s3_url, remote_keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.steps() == [3] and mgr.remote_steps() == [2, 3]
    assert stashpoint.verify(f"{s3_url}/step-00000003").ok
    shutil.rmtree(local)  # a fresh node
    with stashpoint.CheckpointManager(local, keep_last=1, remote_root=s3_url) as mgr:
        out = _empty()
        assert mgr.restore(out) == 3 and _same(out, _state(3))
        mgr.save(4, _state(4))
        mgr.wait()
        assert mgr.steps() == [4]
        assert 4 in mgr.remote_steps()
        assert storage_for(f"{s3_url}/step-00000004").exists(MANIFEST_NAME)


def test_two_ranks_tiered_to_s3_and_restored_on_a_fresh_node(tmp_path, s3_url):
    from dist_util import run_world

    worker = ROOT / "tests" / "tier_worker.py"
    for r in run_world(2, "save", str(tmp_path / "nvme"), s3_url, worker=worker):
        assert r == {"local": [3], "remote": [2, 3]}
    for r in run_world(2, "restore", str(tmp_path / "fresh{rank}"), s3_url, worker=worker):
        assert r["step"] == 3 and r["ok"]


def test_two_ranks_save_and_restore_with_the_manager_on_an_s3_root(s3_url):
    from dist_util import run_world

    worker = ROOT / "tests" / "tier_worker.py"
    for r in run_world(2, "single-root", s3_url, "-", worker=worker):
        assert r == {"steps": [2, 3], "step": 3, "ok": True}


def test_the_command_line_on_s3_urls(s3_url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with stashpoint.CheckpointManager(s3_url) as mgr:
        mgr.save(5, _state(5), metrics={"loss": 0.25})
        mgr.wait()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "stashpoint", *args], capture_output=True, text=True, timeout=120, check=False
        )

    ls = cli("ls", s3_url)
    assert ls.returncode == 0, ls.stderr
    assert "5" in ls.stdout and "committed" in ls.stdout and "0.25" in ls.stdout
    step = f"{s3_url}/step-00000005"
    ins = cli("inspect", step, "--json")
    assert ins.returncode == 0, ins.stderr
    assert "w" in ins.stdout
    ver = cli("verify", step)
    assert ver.returncode == 0 and "OK" in ver.stdout, ver.stdout + ver.stderr
    run_dir = cli("inspect", s3_url)
    assert run_dir.returncode == 2 and "run directory" in run_dir.stderr
    missing = cli("verify", f"{s3_url}/step-00000099")
    assert missing.returncode == 2 and "no checkpoint" in missing.stderr
    # export from S3, import to S3, diff across local and S3
    export = cli("export", step, "w.safetensors")
    assert export.returncode == 0, export.stderr
    torch.save({"w": _state(5)["w"]}, "w.pt")
    imported = cli("import", "w.pt", f"{s3_url}/imported")
    assert imported.returncode == 0, imported.stderr
    from safetensors.torch import load_file

    assert torch.equal(load_file("w.safetensors")["w"], _state(5)["w"])
    stashpoint.save({"w": _state(5)["w"]}, "local-w")
    same = cli("diff", "local-w", f"{s3_url}/imported")
    assert same.returncode == 0, same.stdout + same.stderr


def test_manager_save_on_s3_from_a_fresh_process(s3_url):
    """The configuration comes from the environment alone: a new process needs nothing else."""
    code = (
        "import sys, torch, stashpoint\n"
        "with stashpoint.CheckpointManager(sys.argv[1]) as m:\n"
        "    m.save(1, {'w': torch.arange(10.0)}).wait()\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code, s3_url], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    out = {"w": torch.zeros(10)}
    stashpoint.load(out, f"{s3_url}/step-00000001")
    assert torch.equal(out["w"], torch.arange(10.0))


def test_a_manager_opened_on_the_remote_tier_during_an_upload_fails_that_upload_not_commits_it_empty(
    s3_url, tmp_path, monkeypatch
):
    """An evaluation job opens a manager on the training run's remote_root while a step is
    being uploaded: its clean-up at open takes the copied objects (no manifest yet) for a crash's
    leftover and deletes them. Before, the upload then committed a manifest over no files, and
    the local retention deleted the only good copy. Now the upload fails saying why, the local
    copy stays, and it goes up whole after the next upload that commits."""
    from stashpoint._manager import uploader

    commit = uploader._commit_copy
    opened: list[int] = []

    def another_manager_opens_first(src, dst, outcomes):  # type: ignore[no-untyped-def]
        if not opened:
            opened.append(1)
            with stashpoint.CheckpointManager(tmp_path / "eval", remote_root=s3_url):
                pass
        return commit(src, dst, outcomes)

    monkeypatch.setattr(uploader, "_commit_copy", another_manager_opens_first)
    with stashpoint.CheckpointManager(tmp_path / "train", keep_last=1, remote_root=s3_url) as mgr:
        mgr.save(1, _state(1))
        try:
            mgr.wait()
            raised = ""
        except stashpoint.CheckpointError as e:
            raised = str(e)
        assert "were deleted or changed before the copy committed" in raised, raised
        assert "Open one manager per remote_root" in raised
        assert mgr.remote_steps() == []
        assert mgr.steps() == [1], "step 1 is kept: its upload failed"
        mgr.save(2, _state(2)).wait()
        mgr.wait()  # step 2's upload commits, and step 1's goes up again after it, whole
        assert mgr.steps() == [2] and mgr.remote_steps() == [1, 2]
    back = _empty()
    stashpoint.load(back, f"{s3_url}/step-00000001")
    assert _same(back, _state(1))
