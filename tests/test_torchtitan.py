"""The torchtitan adapter (issue 20) with torchtitan's own trainer and debug model (llama3
"debugmodel", FSDP2 over two CPU ranks on gloo), selected by one command-line flag: a job
killed with ``kill -9`` mid-training resumes in fresh processes from the newest committed step
and repeats the lost steps exactly; a model-only final save loads into another job, on another
number of ranks, as its initial checkpoint. tests/titan_job.py says what is adapted for the CPU."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import stashpoint
from conftest import ROOT
from dist_util import free_port

if sys.version_info < (3, 11):  # torchtitan 0.3 itself needs 3.11, and setup does not install it below
    pytest.skip("torchtitan 0.3 needs Python 3.11 or later", allow_module_level=True)
pytestmark = pytest.mark.xdist_group("torchtitan")  # one worker runs the shared job (scripts/test.sh: loadgroup)
JOB = Path(__file__).with_name("titan_job.py")
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
USE = "stashpoint.integrations.torchtitan.use_stashpoint"
_STEP = re.compile(r"step:\s+(\d+)\s+\S*\s*loss:\s+([0-9.]+)")


def _cmd(ranks: int, *flags: str) -> list[str]:
    parallel = ["--parallelism.spmd-backend", "full_dtensor"] if ranks > 1 else []
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), f"--master_port={free_port()}",
        str(JOB), "--module", "titan_job", "--config", "debug_cpu", *parallel,
        "--checkpoint.enable", "--override.imports", USE, *flags,
    ]  # fmt: skip


def _losses(log: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in _STEP.finditer(re.sub(r"\x1b\[[0-9;]*m", "", log))}


def _steps(folder: Path) -> list[int]:
    with stashpoint.CheckpointManager(folder) as mgr:  # (it owns the folder while open)
        return mgr.steps()


def _run(cwd: Path, cmd: list[str]) -> str:
    res = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=400)
    if res.returncode != 0:
        raise AssertionError(f"the torchtitan job exited {res.returncode}:\n{res.stderr[-5000:]}")
    return res.stderr + res.stdout


# the session's: pytest ends a module's fixture when a test of another module runs between its
# tests, which the workers' order allows (the job ran twice, 40 s each, in one CI run)
@pytest.fixture(scope="session")
def killed_and_resumed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A two-rank job of 8 steps saving every 2 (keeping 2, the last step's save model-only),
    killed with ``kill -9`` once step 7 is logged, then the same command again: the logs, the loss
    per step and what was committed."""
    from titan_job import write_assets

    d = tmp_path_factory.mktemp("titan")
    write_assets(d)
    flags = ("--training.steps", "8", "--checkpoint.interval", "2", "--checkpoint.keep-latest-k", "2",
             "--checkpoint.last-save-model-only")  # fmt: skip
    log_path = d / "killed.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(_cmd(2, *flags), cwd=d, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    try:  # kill every process of the job once step 7 is logged (step 6's save committed or in flight)
        while time.monotonic() < deadline and proc.poll() is None and 7 not in _losses(log_path.read_text()):
            time.sleep(0.1)
        assert proc.poll() is None, f"the job ended before it could be killed:\n{log_path.read_text()[-3000:]}"
        # torchrun starts each rank in a session of its own: kill them all, as a node failure would
        victims = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
        for victim in victims:
            victim.send_signal(signal.SIGKILL)
        psutil.wait_procs(victims, timeout=30)
    finally:
        proc.kill()
        proc.wait()
    folder = d / "outputs" / "checkpoint"
    committed = _steps(folder)
    resumed = _run(d, _cmd(2, *flags))
    return {"dir": d, "folder": folder, "committed": committed, "first": _losses(log_path.read_text()),
            "resumed_log": resumed, "resumed": _losses(resumed)}  # fmt: skip


def test_a_killed_job_resumes_from_the_newest_committed_step_and_repeats_the_lost_steps_exactly(killed_and_resumed):
    run = killed_and_resumed
    committed, first, again = run["committed"], run["first"], run["resumed"]
    assert committed and committed[-1] in (4, 6), committed
    assert f"Training starts at step {committed[-1] + 1}" in run["resumed_log"], run["resumed_log"][-3000:]
    assert sorted(again) == list(range(committed[-1] + 1, 9))
    redone = {s: v for s, v in again.items() if s in first}
    assert redone and redone == {s: first[s] for s in redone}, (redone, first)
    # keep_latest_k=2 resumable steps; the last step's save holds the model alone, beside them
    folder = run["folder"]
    assert _steps(folder) == [4, 6]
    assert stashpoint.read(folder / "step-00000006", select="train_state")["step"] == 6
    assert json.loads((folder / "step-00000006" / "manifest.json").read_text())["world_size"] == 2
    final = folder / "model-step-00000008"
    assert set(stashpoint.read(final)) == {"model"}
    assert json.loads((final / "manifest.json").read_text())["metadata"]["torchtitan"] == "model-only"


def test_a_model_only_last_save_is_the_initial_checkpoint_of_a_job_on_another_number_of_ranks(killed_and_resumed):
    d, final = killed_and_resumed["dir"], killed_and_resumed["folder"] / "model-step-00000008"
    flags = ("--training.steps", "1", "--checkpoint.folder", "finetune", "--checkpoint.initial-load-path", str(final))
    log = _run(d, _cmd(1, *flags))
    assert "Training starts at step 1" in log and f"stashpoint: loaded model of {final}" in log
    losses = _losses(log)
    assert losses[1] < 7.0, losses  # the trained model (two ranks' shards on one rank), not a fresh one (~8.0)


class _TrainState:
    """The trainer's part of the state (torchtitan's Trainer is itself the ``train_state``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step = sd["step"]


def _manager(folder: Path, **config: object):
    import torch

    from stashpoint.integrations.torchtitan import StashpointCheckpointManager

    torch.manual_seed(len(str(config)))
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    train = _TrainState()
    cfg = StashpointCheckpointManager.Config(**{"enable": True, "interval": 2, "keep_latest_k": 0, **config})
    mgr = StashpointCheckpointManager(
        cfg,
        dataloader=None,
        model_parts=[model],
        optimizers=optim,
        lr_schedulers=torch.optim.lr_scheduler.StepLR(optim, 1),
        states={"train_state": train},
        sd_adapter=None,
        base_folder=str(folder),
    )
    return mgr, model, train


def test_the_manager_refuses_to_lose_work_rolls_back_on_request_and_reads_without_owning(tmp_path):
    import torch

    mgr, model, train = _manager(tmp_path)
    for step in (2, 4, 6):
        train.step = step
        assert mgr.save(step, last_step=step == 6)
    mgr.close()
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir() if "step" in p.name) == [
        "model-step-00000006",
        "step-00000002",
        "step-00000004",
    ]
    # restarting a finished run would train its last steps again: refused, naming the way on
    mgr, _, _ = _manager(tmp_path)
    with pytest.raises(stashpoint.CheckpointError, match=r"model-only save of a finished run.*model-step-00000006"):
        mgr.load()
    mgr.close()
    # an evaluation job reads while a training job owns the folder
    owner, _, _ = _manager(tmp_path)
    reader, read_model, read_train = _manager(tmp_path, load_only=True)
    assert reader.load() and read_train.step == 4 and torch.equal(read_model.weight, model.weight)
    assert not reader.save(8)
    reader.close()
    owner.close()
    # --checkpoint.load_step 2: the newer step goes aside and training saves it again
    (folder / "model-step-00000006").rename(tmp_path / "final")
    mgr, _, train = _manager(tmp_path)
    assert mgr.load(step=2) and train.step == 2
    assert [p.name.split(".")[0] for p in folder.iterdir() if "rolled-back" in p.name] == ["step-00000004"]
    assert mgr.save(4)
    mgr.close()
    # a seed checkpoint (step 0, model only) starts a run; a DCP folder is refused, naming it
    seed = tmp_path / "seed"
    mgr, seed_model, _ = _manager(seed)
    assert mgr.save(0, last_step=True)
    mgr.close()
    mgr, fresh, train = _manager(seed, interval=3)
    assert mgr.load() and train.step == 0 and torch.equal(fresh.weight, seed_model.weight)
    mgr.close()
    # a seed is model only though the last save is not (llama3's debugmodel); load_step 0 takes
    # it, the newer steps moved aside (before: a full step 0, which a job on another number of
    # ranks refused for its dataloader's keys, and load_step 0 found no step 0)
    seed = tmp_path / "full-seed"
    mgr, seed_model, _ = _manager(seed, last_save_model_only=False)
    assert mgr.save(0, last_step=True)
    mgr.close()
    assert set(stashpoint.read(seed / "checkpoint" / "model-step-00000000")) == {"model"}
    mgr, model, train = _manager(seed, last_save_model_only=False)
    assert mgr.load() and torch.equal(model.weight, seed_model.weight)
    with torch.no_grad():
        model.weight.add_(1.0)
    train.step = 2
    assert mgr.save(2)
    mgr.close()
    mgr, again, train = _manager(seed, last_save_model_only=False)
    assert mgr.load(step=0) and train.step == 0 and torch.equal(again.weight, seed_model.weight)
    assert [p.name.split(".")[0] for p in (seed / "checkpoint").iterdir() if "rolled-back" in p.name] == [
        "step-00000002"
    ]
    mgr.close()
    # the seed is not cast to export_dtype (it is a run's start, loaded into its model), and one
    # that cannot load leaves the newer steps where they are
    seed = tmp_path / "bf16-seed"
    mgr, _, _ = _manager(seed, export_dtype="bfloat16")
    assert mgr.save(0, last_step=True)
    mgr.close()
    folder = seed / "checkpoint"
    assert stashpoint.read(folder / "model-step-00000000")["model"]["weight"].dtype == torch.float32
    mgr, _, train = _manager(seed, export_dtype="bfloat16")
    assert mgr.load()
    train.step = 2
    assert mgr.save(2)
    mgr.close()
    shard = next((folder / "model-step-00000000").glob("shard-*"))
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    mgr, _, _ = _manager(seed, export_dtype="bfloat16")
    with pytest.raises(stashpoint.CorruptCheckpointError):
        mgr.load(step=0)
    mgr.close()
    assert (folder / "step-00000002" / "manifest.json").exists()
    mgr, _, _ = _manager(tmp_path / "none")
    with pytest.raises(stashpoint.CheckpointNotFoundError, match=r"load_step 0 loads the seed checkpoint.*holds none"):
        mgr.load(step=0)
    mgr.close()
    (tmp_path / "dcp" / "checkpoint" / "step-10").mkdir(parents=True)
    (tmp_path / "dcp" / "checkpoint" / "step-10" / ".metadata").write_bytes(b"")
    mgr, _, _ = _manager(tmp_path / "dcp")
    with pytest.raises(stashpoint.CheckpointError, match=r"DCP checkpoints \(step-10/.metadata\)"):
        mgr.load()
    mgr.close()
