"""The Hugging Face Accelerate adapter (issue 20) with a real ``Accelerator`` and a transformers
GPT-2: a run killed with ``kill -9`` resumes from the newest committed step and trains on exactly
as an uninterrupted run, on one process and on two (torchrun, gloo); every object
``Accelerator.save_state`` covers comes back into fresh ones; damage and misuse fail clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState

import stashpoint
from conftest import ROOT, first_step_from, log_lines, read_losses, sigkill_once
from dist_util import free_port
from stashpoint.integrations.accelerate import accelerator_state, load_state, save_state

WORKER = Path(__file__).with_name("accelerate_worker.py")
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


_losses = read_losses


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[-6:])} exited {res.returncode}:\n{res.stderr[-4000:]}")


def test_a_run_killed_mid_training_resumes_from_the_newest_step_and_trains_on_exactly(tmp_path):
    from accelerate_worker import main

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    main([str(straight), "14", "--manager"])  # the uninterrupted run, in this process
    AcceleratorState._reset_state(reset_partial_state=True)
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(killed), "14", "--manager", "--slow", "0.3"],
        env=ENV,
        stderr=subprocess.DEVNULL,
    )
    # kill -9 two steps after the save at step 6 was started (it crosses no epoch: 10 batches each)
    sigkill_once(proc, lambda: log_lines(killed / "losses-0.jsonl") >= 8)
    assert len(_losses(killed)) < 14
    left = log_lines(killed / "losses-0.jsonl")
    _run([sys.executable, str(WORKER), str(killed), "14", "--manager", "--resume"])
    assert first_step_from(killed / "losses-0.jsonl", left) > 1, "resumed from a step, not started over"
    assert _losses(killed) == _losses(straight), "the resumed run's losses differ from the uninterrupted run's"
    done = json.loads((killed / "done-0.json").read_text())
    assert done == json.loads((straight / "done-0.json").read_text())
    assert done["tokens"] == 14 * 4 * 16 and done["epoch"] == 1
    assert sorted(p.name for p in (killed / "ckpts").iterdir() if p.name.startswith("step-")) == [
        "step-00000009",
        "step-00000012",
    ]


def test_two_processes_resume_from_save_state_in_fresh_processes_exactly(tmp_path):
    """torchrun, two processes (DDP on gloo): the run saves at steps 4 and 8 and goes on to 9;
    fresh processes load step 4 and must repeat steps 5-9 (an epoch ends at step 5) exactly."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    _run([*torchrun, f"--master_port={free_port()}", str(WORKER), str(straight), "9", "--every", "4"])
    step4 = straight / "ckpts" / "step-0004"
    manifest = json.loads((step4 / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    _run(
        [
            *torchrun,
            f"--master_port={free_port()}",
            str(WORKER),
            str(resumed),
            "9",
            "--every",
            "4",
            "--resume-from",
            str(step4),
        ]
    )
    for rank in (0, 1):
        want = {s: v for s, v in _losses(straight, rank).items() if s > 4}
        assert _losses(resumed, rank) == want, f"rank {rank}'s resumed losses differ"
        assert json.loads((resumed / f"done-{rank}.json").read_text()) == json.loads(
            (straight / f"done-{rank}.json").read_text()
        )
    ckpt = stashpoint.read(step4)  # (rank 0's per-process values)
    assert len(ckpt["dataloaders"]) == 1 and ckpt["dataloaders"][0]["batches"]["_num_yielded"] == 4
    assert stashpoint.verify(step4).ok


def test_every_object_save_state_covers_comes_back_into_fresh_ones(tmp_path):
    from accelerate_worker import build

    acc, model, opt, sched, loader, tally = build(seed=0)
    it = iter(loader)
    for _ in range(3):
        (batch,) = next(it)
        acc.backward(model(input_ids=batch, labels=batch).loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    tally.tokens = 123
    acc.step = 7
    handle = save_state(acc, tmp_path / "ckpt", metadata={"run": "t"})
    stats = handle.wait()
    assert stats.bytes_written > 0
    assert acc.save_iteration == 1  # counted up, as Accelerator.save_state does
    draws = torch.rand(3)  # what the global generator gives next (dropout draws from it)
    (expected,) = next(it)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()}
    AcceleratorState._reset_state(reset_partial_state=True)

    acc2, model2, opt2, sched2, loader2, tally2 = build(seed=1)  # other weights, a fresh optimizer
    assert not opt2.state_dict()["state"]
    load_state(acc2, tmp_path / "ckpt")
    assert torch.equal(torch.rand(3), draws)
    for k, v in model2.state_dict().items():
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0, msg=k)
    for k, v in opt2.state_dict()["state"].items():
        torch.testing.assert_close(v["exp_avg"], moments[k], rtol=0, atol=0)
    assert sched2.scheduler.last_epoch == sched.scheduler.last_epoch == 3
    assert tally2.tokens == 123 and acc2.step == 7 and acc2.save_iteration == 1
    (got,) = next(iter(loader2))  # the dataloader goes on with the batch after the third
    assert torch.equal(got, expected)
    assert stashpoint.read(tmp_path / "ckpt", select="accelerator") == {"step": 7, "iteration": 1}
    assert set(accelerator_state(acc2)) == {
        "models",
        "optimizers",
        "schedulers",
        "dataloaders",
        "custom",
        "rng",
        "accelerator",
    }

    # a damaged checkpoint fails naming the shard
    shard = next((tmp_path / "ckpt").glob("shard-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(stashpoint.CorruptCheckpointError, match=shard.name):
        load_state(acc2, tmp_path / "ckpt")


def test_a_position_within_the_epoch_needs_a_stateful_dataloader(tmp_path):
    from accelerate_worker import build

    acc, *_ = build()
    save_state(acc, tmp_path / "ckpt").wait()
    AcceleratorState._reset_state(reset_partial_state=True)
    acc2, *_ = build(stateful=False)
    with pytest.raises(stashpoint.CheckpointError, match="use_stateful_dataloader=True") as info:
        load_state(acc2, tmp_path / "ckpt")
    assert "does not fit this dataloader's position" in str(info.value), info.value


def test_a_dataloader_position_from_a_hostile_file_or_another_number_of_processes_is_refused(tmp_path):
    from accelerate_worker import build
    from stashpoint.integrations.accelerate import _LoaderPosition

    _acc, _model, _opt, _sched, loader, _tally = build()
    next(iter(loader))
    good = _LoaderPosition(loader, 1).state_dict()
    assert _LoaderPosition(loader, 1)._stashpoint_check(good) is None
    assert "resume on 1 processes" in _LoaderPosition(loader, 2)._stashpoint_check(good)
    tensor = {"__stashpoint_tensor__": "uint8", "shape": [4], "data": b"\0" * 4}
    for bad, why in [
        ({**tensor, "data": 10**12}, "'data' bytes"),  # an int would allocate that many bytes
        ({**tensor, "shape": [10**12]}, "has 4 bytes"),
        ({**tensor, "shape": [-4]}, "non-negative"),
        ({**tensor, "__stashpoint_tensor__": "evil"}, "unknown dtype"),
    ]:
        sd = {**good, "batches": {**good["batches"], "_index_sampler_state": bad}}
        assert why in _LoaderPosition(loader, 1)._stashpoint_check(sd), why


class _History:
    """A registered object whose state grows as the run goes (a fresh one's is empty)."""

    def __init__(self) -> None:
        self.losses: list = []
        self.best: dict = {}

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "best": dict(self.best)}

    def load_state_dict(self, sd: dict) -> None:
        self.losses, self.best = list(sd["losses"]), dict(sd["best"])


def test_a_registered_object_whose_state_grew_comes_back_whole(tmp_path):
    """Accelerate hands a registered object back what its state_dict() gave; a fresh object's
    empty history refused the saved one ("the keys differ"), and strict=False dropped it."""
    from accelerate import Accelerator

    def build():
        acc = Accelerator(cpu=True)
        history = _History()
        acc.register_for_checkpointing(history)
        return acc, acc.prepare(torch.nn.Linear(2, 2)), history

    acc, _, history = build()
    history.losses += [0.5, torch.arange(3.0)]
    history.best["epoch1"] = 0.4
    save_state(acc, tmp_path / "ckpt").wait()
    AcceleratorState._reset_state(reset_partial_state=True)
    acc, _, history = build()
    load_state(acc, tmp_path / "ckpt")
    assert history.losses[0] == 0.5 and torch.equal(history.losses[1], torch.arange(3.0))
    assert history.best == {"epoch1": 0.4}


@pytest.mark.parametrize("home", [False, True])
def test_automatic_checkpoint_naming_and_total_limit(tmp_path, monkeypatch, home):
    """save_state(accelerator) with Accelerate's automatic naming: project_dir/checkpoints/
    checkpoint_<iteration>, the oldest beyond total_limit deleted once a new one committed;
    load_state(accelerator) loads the newest. Accelerate's own keywords are accepted. A
    project_dir of "~" is the home directory for the saves, the retention and the load alike."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    if home:
        monkeypatch.setenv("HOME", str(tmp_path))
        (tmp_path / "work").mkdir()
        monkeypatch.chdir(tmp_path / "work")

    def build():
        project = "~" if home else str(tmp_path)
        config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=2)
        acc = Accelerator(cpu=True, project_config=config)
        return acc, acc.prepare(torch.nn.Linear(2, 2))

    acc, model = build()
    for i in range(4):
        with torch.no_grad():
            model.weight.fill_(i)
        save_state(acc, safe_serialization=True).wait()
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint_2", "checkpoint_3"]
    AcceleratorState._reset_state(reset_partial_state=True)
    acc, model = build()
    load_state(acc)
    assert torch.equal(model.weight, torch.full((2, 2), 3.0)) and acc.save_iteration == 4
    assert not Path("~").exists()
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(ValueError, match="automatic_checkpoint_naming=True"):
        save_state(Accelerator(cpu=True))


def test_accelerates_own_checkpoints_are_named_not_written_beside_or_called_missing(tmp_path):
    """Before: a save to a directory of Accelerator.save_state's own files wrote beside them, so
    that accelerator.load_state later loaded the old weights in silence; a load of one said only
    that it was no stashpoint checkpoint, and load_state() with automatic naming that there was
    none, though Accelerate's were there."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=str(tmp_path / "proj"), automatic_checkpoint_naming=True)
    acc = Accelerator(cpu=True, project_config=config)
    model = acc.prepare(torch.nn.Linear(2, 2))
    acc.save_state()  # Accelerate's own: proj/checkpoints/checkpoint_0
    first = tmp_path / "proj" / "checkpoints" / "checkpoint_0"
    own = r"written by Accelerator.save_state \(.*random_states_0\.pkl"
    with pytest.raises(stashpoint.CheckpointError, match=own + r".*another directory"):
        save_state(acc, first)
    acc.project_configuration.iteration = 0
    with pytest.raises(stashpoint.CheckpointError, match=own + r".*another directory"):
        save_state(acc)
    assert not (first / "manifest.json").exists() and acc.project_configuration.iteration == 0
    with pytest.raises(stashpoint.CheckpointNotFoundError, match=own + r".*accelerator\.load_state"):
        load_state(acc, first)
    with pytest.raises(stashpoint.CheckpointNotFoundError, match=r"checkpoint_0 hold Accelerator\.save_state's own"):
        load_state(acc)
    save_state(acc, tmp_path / "ours").wait()
    load_state(acc, tmp_path / "ours")
    assert model.weight.shape == (2, 2)
    from stashpoint._storage import storage_for

    save_state(acc, storage_for(tmp_path / "storage")).wait()  # a Storage given, as async_save takes one
    load_state(acc, storage_for(tmp_path / "storage"))


def test_automatic_naming_never_replaces_an_earlier_runs_checkpoint_nor_deletes_the_one_it_saved(tmp_path):
    """Before: a second run in the same project_dir (no load_state) replaced the first run's
    checkpoint_1 and checkpoint_2 in silence, and total_limit deleted each checkpoint it had
    just saved (the lowest number). Accelerate refuses an existing checkpoint_<n> too. The
    earlier run's checkpoints numbered above the one saved are never deleted: whether a save is
    refused cannot depend on when the main process's retention ran."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    def build():
        AcceleratorState._reset_state(reset_partial_state=True)
        config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
        acc = Accelerator(cpu=True, project_config=config)
        return acc, acc.prepare(torch.nn.Linear(2, 2))

    folder = tmp_path / "checkpoints"
    acc, _ = build()
    for _ in range(3):
        save_state(acc).wait()
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    first = {n: (folder / n / "manifest.json").read_bytes() for n in ("checkpoint_1", "checkpoint_2")}

    acc, _ = build()  # a new run, no load_state: its iteration starts at 0
    handle = save_state(acc)  # not waited for: the next save's refusal does not depend on its retention
    with pytest.raises(stashpoint.CheckpointError, match=r"checkpoint_1 already holds a committed.*load_state"):
        save_state(acc)
    handle.wait()
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert all((folder / n / "manifest.json").read_bytes() == first[n] for n in first)
    assert acc.project_configuration.iteration == 1  # the refused save did not count
    save_state(acc, overwrite=True).wait()  # replaces the earlier run's checkpoint_1; the oldest goes
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    assert (folder / "checkpoint_1" / "manifest.json").read_bytes() != first["checkpoint_1"]

    # what a save cut short leaves (ranks' files in group directories at scale): not refused
    (folder / "checkpoint_3" / "g00000").mkdir(parents=True)
    (folder / "checkpoint_3" / "g00000" / "shard-r00000-0000-0123456789abcdef.safetensors").write_bytes(b"\0")
    acc.project_configuration.iteration = 3
    save_state(acc).wait()
    assert (folder / "checkpoint_3" / "manifest.json").is_file()
    # Accelerate's own save_state's files where the next automatic checkpoint goes: refused
    (folder / "checkpoint_4").mkdir()
    (folder / "checkpoint_4" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(stashpoint.CheckpointError, match=r"checkpoint_4 already holds files of another kind"):
        save_state(acc)

    # Accelerate's own keyword names, and a URL that automatic naming cannot list
    save_state(acc, output_dir=tmp_path / "named").wait()
    load_state(acc, input_dir=tmp_path / "named")
    with pytest.raises(TypeError, match="give the checkpoint's path once"):
        save_state(acc, tmp_path / "a", output_dir=tmp_path / "b")
    AcceleratorState._reset_state(reset_partial_state=True)
    config = ProjectConfiguration(project_dir="s3://bucket/run", automatic_checkpoint_naming=True)
    with pytest.raises(ValueError, match="local project_dir, not 's3://bucket/run'"):
        save_state(Accelerator(cpu=True, project_config=config))


def _epochs(stateful: bool, ckpt: Path, resume: bool) -> torch.Tensor:
    """12 batches an epoch, 20 steps; step 12, an epoch's last batch, saved (or resumed from)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    acc = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful, use_seedable_sampler=True),
    )
    set_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(96, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))
    model, opt, loader = acc.prepare(model, opt, loader)
    step = 12 if resume else 0
    if resume:
        load_state(acc, ckpt)
    while step < 20:
        for xb, yb in loader:
            acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
            opt.step()
            opt.zero_grad()
            step += 1
            if step == 12 and not resume:
                save_state(acc, ckpt).wait()
            if step == 20:
                break
    AcceleratorState._reset_state(reset_partial_state=True)
    return model.weight.detach().clone()


@pytest.mark.parametrize("stateful", [True, False])
def test_a_checkpoint_taken_at_an_epochs_last_batch_resumes_with_the_next_epoch(tmp_path, stateful):
    """Before: the loader still counted the epoch it had just ended, and a resume replayed that
    epoch's order instead of the next one's."""
    straight = _epochs(stateful, tmp_path / "ckpt", resume=False)
    assert stashpoint.read(tmp_path / "ckpt", select="dataloaders")[0]["epoch"] == 1
    assert torch.equal(_epochs(stateful, tmp_path / "ckpt", resume=True), straight)


def test_an_object_registered_only_after_the_load_is_named_missing(tmp_path):
    """Before: load_state filled the empty list of registered objects with the saved states, as
    plain dicts, and the object registered later kept its fresh state without a word."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    acc.register_for_checkpointing(_History())
    acc.prepare(torch.nn.Linear(2, 2))
    save_state(acc, tmp_path / "ckpt").wait()
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True)
    acc.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(stashpoint.StateMismatchError, match=r"'custom': the checkpoint holds 1 object"):
        load_state(acc, tmp_path / "ckpt")
