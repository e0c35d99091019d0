"""The PyTorch Lightning plugin (issue 20) with a real ``Trainer``: ``ModelCheckpoint`` retention,
``fit(ckpt_path="last")`` after a ``kill -9`` mid-fit, damage, values that are not JSON-like, and
DDP on two CPU processes (slow tier: ``bash scripts/test.sh -m slow tests/test_lightning.py``)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

import stashpoint
from conftest import ROOT, first_step_from, log_lines, read_losses, sigkill_once
from stashpoint.integrations.lightning import StashpointCheckpointIO

WORKER = Path(__file__).with_name("lightning_worker.py")
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}


def _run(d: Path, epochs: int, *flags: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [sys.executable, str(WORKER), str(d), str(epochs), *flags], env=ENV, capture_output=True, text=True, timeout=300
    )
    if check and res.returncode != 0:
        raise AssertionError(f"lightning_worker {d} {epochs} {flags} exited {res.returncode}:\n{res.stderr[-4000:]}")
    return res


_losses = read_losses


def test_a_run_killed_mid_fit_resumes_from_last_and_trains_on_exactly_as_an_uninterrupted_one(tmp_path):
    from lightning_worker import main

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    main([str(straight), "6"])  # the uninterrupted run, in this process
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(killed), "6", "--slow", "0.1"], env=ENV, stderr=subprocess.DEVNULL
    )
    # kill -9 once epoch 3's checkpoint is committed and epoch 4 is under way
    sigkill_once(proc, lambda: log_lines(killed / "losses-0.jsonl") >= 8 * 3 + 3)
    assert (killed / "ckpts" / "last.ckpt" / "manifest.json").exists()
    assert len(_losses(killed)) < 48
    left = log_lines(killed / "losses-0.jsonl")
    _run(killed, 6, "--resume")
    assert first_step_from(killed / "losses-0.jsonl", left) >= 8 * 3, "resumed from epoch 3's checkpoint"
    assert _losses(killed) == _losses(straight), "the resumed run's losses differ from the uninterrupted run's"
    # ModelCheckpoint kept the best two and last (it removed the others through the plugin), each a
    # whole stashpoint checkpoint
    kept = sorted(p.name for p in (killed / "ckpts").iterdir())
    assert len(kept) == 3 and "last.ckpt" in kept, kept
    assert all(stashpoint.verify(killed / "ckpts" / name).ok for name in kept)
    best = json.loads((killed / "done.json").read_text())["best"]
    assert Path(best).name in kept
    # a damaged newest checkpoint fails the next resume, naming the file
    shard = next((killed / "ckpts" / "last.ckpt").glob("shard-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(stashpoint.CorruptCheckpointError, match=shard.name):
        main([str(killed), "7", "--resume"])


def _trainer(d: Path, io: StashpointCheckpointIO) -> L.Trainer:
    return L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        plugins=[io],
        callbacks=[ModelCheckpoint(dirpath=d, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_values_that_are_not_json_like_fail_naming_their_keys_or_are_pickled_when_allowed(tmp_path):
    from lightning_worker import Model, data

    with pytest.raises(
        stashpoint.UnsupportedStateError, match=r"hyper_parameters/note.*StashpointCheckpointIO\(allow_pickle=True\)"
    ):
        _trainer(tmp_path / "refused", StashpointCheckpointIO()).fit(Model(note=Fraction(1, 3)), data())
    io = StashpointCheckpointIO(allow_pickle=True)
    _trainer(tmp_path / "pickled", io).fit(Model(note=Fraction(1, 3)), data())
    got = io.load_checkpoint(tmp_path / "pickled" / "last.ckpt")
    assert got["hyper_parameters"]["note"] == Fraction(1, 3) and got["global_step"] == 8
    with pytest.raises(stashpoint.CheckpointError, match="allow_pickle"):
        StashpointCheckpointIO().load_checkpoint(tmp_path / "pickled" / "last.ckpt")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, tmp_path / "x", storage_options={"a": 1})


@pytest.mark.slow  # two DDP runs of two processes each (~30 s)
def test_ddp_saves_on_rank_0_without_collectives_and_every_rank_resumes(tmp_path):
    _run(tmp_path, 2, "--ddp")
    assert stashpoint.verify(tmp_path / "ckpts" / "last.ckpt").ok
    _run(tmp_path, 3, "--ddp", "--resume")
    assert json.loads((tmp_path / "done.json").read_text())["global_step"] == 3 * 4  # 32 samples per rank / 8
    for rank in (0, 1):
        assert sorted(_losses(tmp_path, rank)) == list(range(12)), rank


def test_save_last_as_a_link_and_load_from_checkpoint(tmp_path):
    """ModelCheckpoint(save_last="link") links last.ckpt to the newest checkpoint the moment the
    plugin returns, before the background save made its directory (fit crashed on it); the
    module comes back with load_from_checkpoint, which Lightning's own cannot (torch.load of a
    directory)."""
    import torch

    from lightning_worker import Model, data
    from stashpoint.integrations.lightning import load_from_checkpoint

    d = tmp_path / "ckpts"
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        plugins=[StashpointCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=d, save_last="link", every_n_train_steps=4, save_top_k=2, monitor="step")],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Model(width=8, note="linked")
    trainer.fit(model, data())
    assert (d / "last.ckpt").is_symlink() and stashpoint.verify(d / "last.ckpt").ok
    loaded = load_from_checkpoint(Model, d / "last.ckpt")
    assert loaded.hparams.width == 8 and loaded.hparams.note == "linked"
    saved = stashpoint.read(d / "last.ckpt")["state_dict"]
    assert saved and all(torch.equal(v, saved[k]) for k, v in loaded.state_dict().items())
    assert load_from_checkpoint(Model, d / "last.ckpt", note="other").hparams.note == "other"


def test_a_torch_save_checkpoint_file_is_named_with_the_import_and_replaced_by_the_next_save(tmp_path):
    """A project switching over: last.ckpt is Lightning's own torch.save file. Resuming from it
    names the conversion; a save to that path (ModelCheckpoint's last_model_path, restored from
    a resumed run) replaces it (the background save failed on it, reported a save later)."""
    import torch

    d = tmp_path / "ckpts"
    d.mkdir()
    torch.save({"state_dict": {}}, d / "last.ckpt")
    io = StashpointCheckpointIO()
    with pytest.raises(stashpoint.CheckpointError, match=r"python -m stashpoint import .*last\.ckpt"):
        io.load_checkpoint(d / "last.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, d / "last.ckpt")
    io.wait()
    assert (d / "last.ckpt").is_dir() and io.load_checkpoint(d / "last.ckpt")["global_step"] == 3


def test_a_multisteplrs_milestones_come_back_a_counter_and_files_given_as_checkpoints_are_named(tmp_path):
    """Lightning applies the dict the plugin reads (no live object to take types from). Before:
    a MultiStepLR's milestones came back a dict, and its step(epoch) failed; the manifest given
    for its checkpoint was called a torch.save file, to convert."""
    import torch

    from stashpoint.integrations.lightning import load_from_checkpoint

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    multi = torch.optim.lr_scheduler.MultiStepLR(opt, [2, 6], 0.5)
    chained = torch.optim.lr_scheduler.ChainedScheduler([torch.optim.lr_scheduler.MultiStepLR(opt, [3])])
    io = StashpointCheckpointIO()
    own = {"milestones": {3: 0.01}, "base_lrs": [0.1], "last_epoch": 0}  # a user's scheduler: a dict stays
    io.save_checkpoint({"lr_schedulers": [multi.state_dict(), chained.state_dict(), own]}, tmp_path / "a.ckpt")
    got = io.load_checkpoint(tmp_path / "a.ckpt")["lr_schedulers"]
    assert type(got[0]["milestones"]) is collections.Counter and got[0]["milestones"] == multi.milestones
    assert type(got[1]["_schedulers"][0]["milestones"]) is collections.Counter
    assert type(got[2]["milestones"]) is dict and got[2] == own
    fresh = torch.optim.lr_scheduler.MultiStepLR(opt, [1], 0.5)
    fresh.load_state_dict(got[0])
    with pytest.warns(UserWarning):  # torch's deprecation of step(epoch); it worked
        fresh.step(3)
    with pytest.raises(stashpoint.CheckpointError, match=r"a file inside the stashpoint checkpoint .*a\.ckpt: give"):
        io.load_checkpoint(tmp_path / "a.ckpt" / "manifest.json")
    torch.save({"state_dict": {}}, tmp_path / "own.ckpt")
    with pytest.raises(stashpoint.CheckpointError, match=r"python -m stashpoint import .*own\.ckpt"):
        load_from_checkpoint(L.LightningModule, tmp_path / "own.ckpt")


def test_a_torch_save_file_stays_when_the_save_replacing_it_fails(tmp_path):
    """The old last.ckpt is set aside while the new one is written and removed once it
    committed; a save that fails (a value not saved without pickle) puts it back."""
    import torch

    d = tmp_path / "ckpts"
    d.mkdir()
    torch.save({"state_dict": {}}, d / "last.ckpt")
    io = StashpointCheckpointIO()
    with pytest.raises(stashpoint.UnsupportedStateError):
        io.save_checkpoint({"note": Fraction(1, 3)}, d / "last.ckpt")
    assert (d / "last.ckpt").is_file() and torch.load(d / "last.ckpt") == {"state_dict": {}}
    io.save_checkpoint({"global_step": 3}, d / "last.ckpt")
    io.wait()
    assert (d / "last.ckpt").is_dir() and sorted(p.name for p in d.iterdir()) == ["last.ckpt"]


def test_a_checkpoint_lightning_removes_goes_only_once_its_replacement_committed(tmp_path, monkeypatch):
    """ModelCheckpoint (save_top_k=1, the default) saves the new checkpoint, then at once removes
    the old one. Before: the old one was deleted while the new one was still being written, and a
    crash then left no committed checkpoint at all."""
    from lightning_worker import Model, data
    from stashpoint._storage import LocalStorage

    d = tmp_path / "ckpts"
    committed_beside: list[int] = []
    real = LocalStorage.remove_tree

    def spied(self: LocalStorage) -> None:
        if self.root.name.endswith(".ckpt"):
            others = [p for p in d.iterdir() if p != self.root and (p / "manifest.json").is_file()]
            committed_beside.append(len(others))
        real(self)

    monkeypatch.setattr(LocalStorage, "remove_tree", spied)
    trainer = L.Trainer(
        max_epochs=4,
        accelerator="cpu",
        plugins=[StashpointCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=d)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(width=512), data())
    assert len(committed_beside) == 3 and all(n >= 1 for n in committed_beside), committed_beside
    (kept,) = d.iterdir()
    assert kept.name == "epoch=3-step=32.ckpt" and stashpoint.verify(kept).ok


def test_a_last_link_to_a_checkpoint_that_never_committed_loads_the_newest_committed_one(tmp_path, caplog):
    """save_last="link" links last.ckpt to a checkpoint as soon as its save is staged: a run
    killed before that save committed left a link to nothing loadable, and fit(ckpt_path="last")
    failed although the checkpoint before it was whole."""
    import logging

    import torch

    d = tmp_path / "ckpts"
    io = StashpointCheckpointIO()
    io.save_checkpoint({"global_step": 4, "w": torch.ones(3)}, d / "epoch=0-step=4.ckpt")
    io.wait()
    (d / "epoch=1-step=8.ckpt").mkdir()  # what a kill -9 mid-save leaves
    (d / "epoch=1-step=8.ckpt" / "shard-r00000-0000-0123456789abcdef.safetensors").write_bytes(b"\0" * 64)
    (d / "last.ckpt").symlink_to("epoch=1-step=8.ckpt")
    with caplog.at_level(logging.WARNING, logger="stashpoint"):
        got = io.load_checkpoint(d / "last.ckpt")
    assert got["global_step"] == 4 and "holds no committed checkpoint" in caplog.text
    (d / "best.ckpt").symlink_to("epoch=1-step=8.ckpt")  # not Lightning's last link: loaded as it is
    with pytest.raises(stashpoint.IncompleteCheckpointError):
        io.load_checkpoint(d / "best.ckpt")
    # save_last=True: the first last.ckpt is a directory of its own, killed before it committed
    (d / "last.ckpt").unlink()
    (d / "epoch=1-step=8.ckpt").rename(d / "last.ckpt")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stashpoint"):
        got = io.load_checkpoint(d / "last.ckpt")
    assert got["global_step"] == 4 and "last.ckpt holds no committed checkpoint" in caplog.text
    (d / "last.ckpt" / ".metadata").write_bytes(b"")  # another format's directory (DCP's): named, not passed over
    with pytest.raises(stashpoint.CheckpointError, match="is a DCP checkpoint"):
        io.load_checkpoint(d / "last.ckpt")
    (d / "last.ckpt" / ".metadata").unlink()
    (d / "epoch=0-step=4.ckpt" / "manifest.json").unlink()  # nothing committed beside it: the error as before
    with pytest.raises(stashpoint.IncompleteCheckpointError):
        io.load_checkpoint(d / "last.ckpt")


def test_the_newest_committed_checkpoint_beside_last_is_the_newest_saved_after_a_copy_too(tmp_path):
    """Before: ranked by the manifests' file times, which a copy (cp -r, a download) sets to the
    copy's: the older checkpoint, copied last, was taken for the newest."""
    import torch

    d = tmp_path / "ckpts"
    io = StashpointCheckpointIO()
    for step in (10, 20):
        io.save_checkpoint({"global_step": step, "w": torch.ones(3)}, d / f"epoch={step // 10}-step={step}.ckpt")
        io.wait()
    (d / "last.ckpt").mkdir()  # killed while writing it
    (d / "last.ckpt" / "shard-r00000-0000-0123456789abcdef.safetensors").write_bytes(b"\0" * 64)
    os.utime(d / "epoch=1-step=10.ckpt" / "manifest.json", (2e9, 2e9))  # as a copy in that order leaves them
    assert StashpointCheckpointIO().load_checkpoint(d / "last.ckpt")["global_step"] == 20
    (d / "epoch=2-step=20.ckpt" / "manifest.json").write_text("{}")  # unreadable: passed over
    assert StashpointCheckpointIO().load_checkpoint(d / "last.ckpt")["global_step"] == 10


def test_a_top_k_and_a_last_checkpoint_saved_back_to_back_are_both_in_flight(tmp_path):
    """save_last=True makes ModelCheckpoint save twice at every checkpoint; the second save waited
    for the first one's whole write (0.8 s of blocking in a review's run). Two may be in flight."""
    import torch

    io = StashpointCheckpointIO()
    state = {"w": torch.ones(1 << 20)}
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    io.save_checkpoint(state, tmp_path / "last.ckpt")
    assert [s.path for s in io._saves] == [str(tmp_path / "a.ckpt"), str(tmp_path / "last.ckpt")]
    assert (tmp_path / "last.ckpt").is_dir(), "there once staged: Lightning may link last.ckpt to it at once"
    io.save_checkpoint(state, tmp_path / "b.ckpt")  # a third waits for the first
    assert [s.path for s in io._saves] == [str(tmp_path / "last.ckpt"), str(tmp_path / "b.ckpt")]
    io.save_checkpoint(state, tmp_path / "last.ckpt")  # last.ckpt again: its previous save first, not b's
    assert [s.path for s in io._saves] == [str(tmp_path / "b.ckpt"), str(tmp_path / "last.ckpt")]
    io.remove_checkpoint(tmp_path / "a.ckpt")  # committed: goes once the newest save in flight has
    io.wait()
    assert not (tmp_path / "a.ckpt").exists()
    assert all(stashpoint.verify(tmp_path / n).ok for n in ("last.ckpt", "b.ckpt"))


def test_the_standalone_pytorch_lightning_package_takes_the_plugin(tmp_path):
    """`import pytorch_lightning as pl` checks plugins against lightning_fabric's CheckpointIO,
    not lightning.fabric's: the Trainer refused the plugin as an invalid type."""
    pl = pytest.importorskip("pytorch_lightning")
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.l(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=4)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        plugins=[StashpointCheckpointIO()],
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), loader)
    assert isinstance(trainer.strategy.checkpoint_io, StashpointCheckpointIO)
    (saved,) = (tmp_path / "checkpoints").iterdir()
    assert stashpoint.verify(saved).ok
