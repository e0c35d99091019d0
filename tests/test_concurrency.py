"""Concurrent writers: processes racing to save to one new path."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import stashpoint

ROOT = Path(__file__).resolve().parents[1]
_RACER = """
import sys, time, torch, stashpoint
path, value, start = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
state = {"w": torch.full((512, 1024), value), "who": value}
while time.time() < start:
    pass
try:
    stashpoint.save(state, path)
    print("OK")
except stashpoint.CheckpointError as e:
    print("ERR", e)
"""


def test_of_two_processes_saving_to_one_new_path_exactly_one_commits_and_the_other_leaves_nothing(tmp_path):
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    for trial in range(2):  # each trial races the two commits anew
        path = tmp_path / f"ckpt{trial}"
        start = time.time() + 4  # both processes imported torch and wait at the same instant
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _RACER, str(path), str(v), str(start)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for v in (1, 2)
        ]
        outs = [p.communicate(timeout=120)[0].strip() for p in procs]
        winners = [i for i, o in enumerate(outs) if o == "OK"]
        assert len(winners) == 1, outs
        loser = outs[1 - winners[0]]
        # refused at the commit (both wrote), or up front when the winner had already committed
        refused = "another save committed" in loser or "a committed checkpoint already exists" in loser
        assert loser.startswith("ERR") and refused and "overwrite=True" in loser, loser
        # the loser's shard and index are gone: the manifest and the winner's index name every file left
        names = sorted(p.name for p in path.iterdir())
        assert len(names) == 3 and "manifest.json" in names, names
        assert len({n.split("-")[-1].split(".")[0] for n in names if n != "manifest.json"}) == 1, names
        got = stashpoint.read(path)
        assert got["who"] == winners[0] + 1 and torch.equal(got["w"], torch.full((512, 1024), got["who"]))


def test_two_processes_overwriting_one_path_leave_a_checkpoint_that_loads(tmp_path):
    """Both may succeed (the later commit wins), but neither removes the files of the other:
    the one manifest in place names files that are all there, and it loads."""
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    racer = _RACER.replace("stashpoint.save(state, path)", "stashpoint.save(state, path, overwrite=True)")
    for trial in range(4):
        path = tmp_path / f"ckpt{trial}"
        stashpoint.save({"w": torch.zeros(512, 1024), "who": 0.0}, path)  # the checkpoint both replace
        start = time.time() + 4
        procs = [
            subprocess.Popen([sys.executable, "-c", racer, str(path), str(v), str(start)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for v in (1, 2)
        ]  # fmt: skip
        outs = [p.communicate(timeout=120)[0].strip() for p in procs]
        assert outs == ["OK", "OK"], outs  # both succeed: the later commit wins
        report = stashpoint.verify(path)
        assert report.ok, (trial, outs, report.problems)
        got = stashpoint.read(path)
        assert got["who"] in (1.0, 2.0) and torch.equal(got["w"], torch.full((512, 1024), got["who"]))
        # the files of the save whose commit was replaced, where they are left, are ignored and named
        committed = json.loads((path / "manifest.json").read_text())["save_id"]
        others = [p.name for p in path.iterdir() if p.name != "manifest.json" and committed not in p.name]
        assert all(any(name in w for w in report.warnings) for name in others), (others, report.warnings)
        assert not any(committed in w for w in report.warnings), report.warnings


def test_a_load_waits_for_a_save_of_the_same_checkpoint_still_in_flight(tmp_path):
    state = {"w": torch.randn(1 << 20), "step": 3}
    handle = stashpoint.async_save(state, tmp_path / "ck")
    out = {"w": torch.zeros(1 << 20), "step": 0}
    stashpoint.load(out, tmp_path / "ck")  # committed by then, not half written
    handle.wait()
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3
    # and so does a read (before: "holds no committed checkpoint ... delete this directory", as
    # Lightning's load_from_checkpoint right after trainer.save_checkpoint met it)
    state["w"] = torch.randn(1 << 22)
    handle = stashpoint.async_save(state, tmp_path / "ck2")
    assert torch.equal(stashpoint.read(tmp_path / "ck2")["w"], state["w"])
    handle.wait()


def test_a_load_in_a_process_that_never_saved_does_not_import_the_save_engine(tmp_path):
    """A restarted process loads first: the save engine (a tenth of its first load's time to
    import) is not needed to know that no save of its own is in flight."""
    stashpoint.save({"w": torch.ones(8)}, tmp_path / "ck")
    code = (
        "import sys, torch, stashpoint\n"
        "out = {'w': torch.zeros(8)}\n"
        f"stashpoint.load(out, {str(tmp_path / 'ck')!r})\n"
        "assert torch.equal(out['w'], torch.ones(8))\n"
        "print('stashpoint._save.engine' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def test_a_load_and_a_read_wait_for_a_save_in_flight_to_the_same_directory_spelled_otherwise(tmp_path, monkeypatch):
    """Before: a link or ``..`` in the path read the previous checkpoint while the save replaced it."""
    from stashpoint._storage import LocalStorage

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    stashpoint.save({"w": torch.zeros(1000), "step": 0}, real / "ck")
    commit = LocalStorage.commit

    def slow_commit(self, *args, **kwargs):  # the save stays in flight while the load starts
        time.sleep(0.5)
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "commit", slow_commit)
    spellings = [tmp_path / "link" / "ck", real / ".." / "real" / "ck"]
    for step, spelled in enumerate(spellings * 2, start=1):
        handle = stashpoint.async_save(
            {"w": torch.full((1000,), float(step)), "step": step}, real / "ck", overwrite=True
        )
        assert not handle.done()
        if step <= len(spellings):
            out = {"w": torch.zeros(1000), "step": 0}
            stashpoint.load(out, spelled)
        else:
            out = stashpoint.read(spelled)
        assert handle.done() and out["step"] == step and torch.equal(out["w"], torch.full((1000,), float(step)))


def test_a_checkpoint_deleted_or_replaced_while_it_is_read_is_said_to_be_so_not_damaged(tmp_path, monkeypatch):
    """A reader racing a manager's retention, or a save with overwrite=True: the files its
    manifest listed went. Before, that was a CorruptCheckpointError, damage to look for (and a
    policy quarantining damaged checkpoints would act on it); a shard deleted alone still is."""
    import shutil

    from stashpoint._load import loader, read

    state = {"w": torch.arange(50_000, dtype=torch.float32), "b": torch.ones(3)}
    path = tmp_path / "ck"

    def then(real, what):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            out = real(*args, **kwargs)
            what()
            return out

        return wrapped

    deleted = lambda: shutil.rmtree(path)  # noqa: E731
    replaced = lambda: stashpoint.save({"w": torch.zeros(50_000), "b": torch.zeros(3)}, path, overwrite=True)  # noqa: E731
    cases = [
        (read, "open_checkpoint", deleted, lambda: stashpoint.read(path)),
        (loader, "_plan", deleted, lambda: stashpoint.load({"w": torch.zeros(50_000), "b": torch.zeros(3)}, path)),
        (read, "open_checkpoint", replaced, lambda: stashpoint.read(path)),
        (loader, "_plan", replaced, lambda: stashpoint.load({"w": torch.zeros(50_000), "b": torch.zeros(3)}, path)),
    ]
    for module, name, meanwhile, call in cases:
        stashpoint.save(state, path, overwrite=True)
        with monkeypatch.context() as m:
            m.setattr(module, name, then(getattr(module, name), meanwhile))
            try:
                call()
                raise AssertionError("read whole")
            except stashpoint.CheckpointError as e:
                said = str(e)
                if meanwhile is deleted:
                    assert isinstance(e, stashpoint.CheckpointNotFoundError), (name, said)
                    assert "was deleted while it was read" in said, said
                else:
                    assert not isinstance(e, stashpoint.CorruptCheckpointError), (name, said)
                    assert "was replaced by another save (overwrite=True) while it was read" in said, said
    stashpoint.save(state, path, overwrite=True)
    next(path.glob("shard-*")).unlink()
    try:
        stashpoint.read(path)
        raise AssertionError("read whole")
    except stashpoint.CorruptCheckpointError as e:
        assert "missing" in str(e) and "while it was read" not in str(e)
