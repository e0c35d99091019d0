"""Paths as users write them: ``~`` is the home directory, as in a shell."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import stashpoint
from stashpoint._tools.inspect import list_steps


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A home directory of the test's own, and a working directory apart from it."""
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    return home


def test_a_tilde_path_is_the_home_directory_never_a_directory_named_tilde(home):
    model = torch.nn.Linear(3, 2)
    stashpoint.save({"model": model}, "~/ckpt/step-1")
    assert (home / "ckpt" / "step-1" / "manifest.json").is_file()
    # a directory named "~" in the working directory is one a later `rm -rf ~` loses the home for
    assert not Path("~").exists()

    fresh = torch.nn.Linear(3, 2)
    stashpoint.load({"model": fresh}, "~/ckpt/step-1")
    assert torch.equal(fresh.weight, model.weight)
    assert stashpoint.verify(Path("~/ckpt/step-1")).ok
    assert torch.equal(stashpoint.read("~/ckpt/step-1")["model"]["weight"], model.weight)
    stashpoint.async_save({"model": model}, "~/ckpt/step-2").wait()
    assert (home / "ckpt" / "step-2" / "manifest.json").is_file()
    assert not Path("~").exists()


def test_a_manager_and_the_listing_of_its_run_take_a_tilde_root(home):
    model = torch.nn.Linear(3, 2)
    with stashpoint.CheckpointManager("~/run", keep_last=2) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"model": model})
        manager.wait()
    assert sorted(p.name for p in (home / "run").iterdir() if p.is_dir()) == ["step-00000002", "step-00000003"]
    assert [s.step for s in list_steps("~/run")] == [2, 3]
    fresh = torch.nn.Linear(3, 2)
    with stashpoint.CheckpointManager("~/run") as again:
        assert again.restore({"model": fresh}) == 3
    assert torch.equal(fresh.bias, model.bias)
    assert not Path("~").exists()


def test_an_s3_url_that_pathlib_folded_is_refused_not_saved_to_a_local_directory(home):
    from pathlib import PurePosixPath

    folded = PurePosixPath("s3://bucket/run") / "step-1"  # s3:/bucket/run/step-1
    with pytest.raises(ValueError, match=r"looks like an s3:// URL that lost a slash.*'s3://bucket/run/step-1'"):
        stashpoint.save({"w": torch.ones(1)}, folded)
    assert not Path("s3:").exists()


def test_a_tilde_after_other_components_or_of_an_unknown_user_stays_as_written(home):
    from stashpoint._storage import storage_for

    assert storage_for("./~/ckpt").root == Path.cwd() / "~" / "ckpt"  # as a shell keeps ./~
    assert storage_for("~no-such-user-here/ckpt").root == Path.cwd() / "~no-such-user-here" / "ckpt"


def test_the_lightning_plugin_takes_a_tilde_path(home):
    pytest.importorskip("lightning")
    from stashpoint.integrations.lightning import StashpointCheckpointIO

    io = StashpointCheckpointIO()
    torch.save({"w": torch.ones(1)}, home / "old.ckpt")  # Lightning's own file: replaced by the directory
    for name in ("~/ck/epoch=0.ckpt", "~/old.ckpt"):
        io.save_checkpoint({"w": torch.arange(3.0)}, name)
        io.wait()
        assert torch.equal(io.load_checkpoint(name)["w"], torch.arange(3.0))
    assert (home / "ck" / "epoch=0.ckpt" / "manifest.json").is_file() and (home / "old.ckpt").is_dir()
    io.remove_checkpoint("~/ck/epoch=0.ckpt")
    io.wait()
    assert not (home / "ck" / "epoch=0.ckpt").exists()
    assert not Path("~").exists()


def test_a_name_longer_than_the_file_system_allows_is_a_checkpoint_error_naming_the_fix(tmp_path):
    """Before: a bare OSError (ENAMETOOLONG) from every call."""
    path = tmp_path / ("x" * 256)
    calls = {
        "save": lambda: stashpoint.save({"w": torch.ones(2)}, path),
        "load": lambda: stashpoint.load({"w": torch.ones(2)}, path),
        "read": lambda: stashpoint.read(path),
        "verify": lambda: stashpoint.verify(path),
        "manager": lambda: stashpoint.CheckpointManager(path),
    }
    for name, call in calls.items():
        with pytest.raises(stashpoint.CheckpointError, match="longer than the file system allows; choose a shorter"):
            call()
        assert not os.path.exists(path), name  # (Path.exists raises ENAMETOOLONG)
