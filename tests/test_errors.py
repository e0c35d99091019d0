"""Every error a user can meet, with its message; failures never harm earlier checkpoints."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import stashpoint
from conftest import run_python, to_v1, whole
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._storage import FileWriter, LocalStorage


def test_missing_checkpoint_is_a_file_not_found_error(tmp_path):
    with pytest.raises(stashpoint.CheckpointNotFoundError, match=r"no checkpoint at .*nope") as info:
        stashpoint.load({}, tmp_path / "nope")
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, stashpoint.CheckpointError)


def test_uncommitted_directory_is_incomplete(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "shard-r00000-0000-abc.safetensors").write_bytes(b"partial")
    with pytest.raises(stashpoint.IncompleteCheckpointError, match=r"no committed checkpoint.*did not finish"):
        stashpoint.load({}, tmp_path / "ck")


def test_a_torch_save_file_is_refused_with_a_hint(tmp_path):
    torch.save({"a": torch.ones(1)}, tmp_path / "model.pt")
    with pytest.raises(stashpoint.CheckpointError, match="is a file, not a stashpoint checkpoint"):
        stashpoint.load({}, tmp_path / "model.pt")


def test_an_overwrite_over_a_hostile_manifest_saves_and_deletes_nothing_of_it(tmp_path):
    stashpoint.save({"a": torch.ones(2)}, tmp_path / "ck")
    (tmp_path / "ck" / "manifest.json").write_bytes(b"[" * 100_000)  # nested past the parser's depth
    shards = sorted(p.name for p in (tmp_path / "ck").glob("shard-*"))
    stashpoint.save({"a": torch.full((2,), 5.0)}, tmp_path / "ck", overwrite=True)
    out = {"a": torch.zeros(2)}
    stashpoint.load(out, tmp_path / "ck")
    assert torch.equal(out["a"], torch.full((2,), 5.0))
    assert set(shards) <= {p.name for p in (tmp_path / "ck").glob("shard-*")}  # not ours to judge: kept


@pytest.mark.parametrize("unread", ["memory short", "object store", "a lagging replica's 404"])
def test_a_save_failing_after_its_commit_keeps_its_files_where_its_manifest_cannot_be_read_back(
    tmp_path, monkeypatch, unread
):
    """A save that fails after rank 0 committed asks whether its manifest is in place: one it
    could not read back (memory short for the parse, an object store's failure) is not one that
    is absent, and deleting the shards would leave a committed manifest of missing files."""
    from stashpoint._core.sealed import ShortOfMemoryError
    from stashpoint._save import job
    from stashpoint.errors import S3Error

    commit = job.PersistJob._commit

    def then_fail(self, *args, **kwargs):
        commit(self, *args, **kwargs)

        def cannot(*a, **k):
            if unread == "memory short":
                raise ShortOfMemoryError("parsing the manifest ran out of memory (injected)")
            if unread == "object store":
                raise S3Error("GET manifest.json: HTTP 503 SlowDown (injected)")
            raise FileNotFoundError("GET manifest.json: HTTP 404 (injected)")

        monkeypatch.setattr(job, "open_sealed", cannot)
        raise RuntimeError("a failure after the commit (injected)")

    class ObjectStoreLike(LocalStorage):
        atomic_rename = False  # a manifest's presence commits: a 404 may be a replica's lag

    monkeypatch.setattr(job.PersistJob, "_commit", then_fail)
    state = {"w": torch.randn(1000)}
    with pytest.raises(stashpoint.CheckpointError, match="after the commit") as info:
        stashpoint.save(state, ObjectStoreLike(tmp_path / "ck"))
    assert "could not be told" in str(info.value) and "Nothing was committed" not in str(info.value)
    monkeypatch.undo()
    live = {"w": torch.zeros(1000)}
    stashpoint.load(live, tmp_path / "ck")
    assert torch.equal(live["w"], state["w"])


def test_saving_over_a_committed_checkpoint_needs_overwrite(tmp_path):
    stashpoint.save({"a": torch.ones(2)}, tmp_path / "ck")
    with pytest.raises(stashpoint.CheckpointError, match="overwrite=True"):
        stashpoint.save({"a": torch.zeros(2)}, tmp_path / "ck")
    stashpoint.save({"a": torch.full((2,), 5.0)}, tmp_path / "ck", overwrite=True)
    shards = list((tmp_path / "ck").glob("shard-*"))
    assert len(shards) == 1, "the old shards are removed once the new checkpoint commits"
    out = {"a": torch.zeros(2)}
    stashpoint.load(out, tmp_path / "ck")
    assert out["a"].tolist() == [5.0, 5.0]


def test_unsupported_values_name_their_key_path_and_type(tmp_path):
    with pytest.raises(stashpoint.UnsupportedStateError, match=r"_thread.lock at key 'cfg/locks/1'"):
        stashpoint.save({"cfg": {"locks": [1, threading.Lock()]}}, tmp_path / "ck")
    with pytest.raises(stashpoint.UnsupportedStateError, match=r"dict key \(1, 2\) of type tuple"):
        stashpoint.save({"x": {(1, 2): 3}}, tmp_path / "ck")
    with pytest.raises(stashpoint.UnsupportedStateError, match=r"layout torch.sparse_coo at key 'sp'.*to_dense"):
        stashpoint.save({"sp": torch.eye(3).to_sparse()}, tmp_path / "ck")
    for layout in (torch.strided, torch.jagged):  # strided: layout torch.strided, no one shape
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
        with pytest.raises(stashpoint.UnsupportedStateError, match=r"nested tensor at key 'n/0'.*unbind"):
            stashpoint.save({"n": [nested]}, tmp_path / "ck")
    q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    with pytest.raises(stashpoint.UnsupportedStateError, match="quantized tensor at key 'q'"):
        stashpoint.save({"q": q}, tmp_path / "ck")
    with pytest.raises(stashpoint.UnsupportedStateError, match=r"key 'g'.*torch.Generator: save b = g.get_state"):
        stashpoint.save({"g": torch.Generator()}, tmp_path / "ck")

    class Config:  # a Hugging Face config's shape
        def to_dict(self) -> dict:
            return {"n_layer": 2}

    with pytest.raises(stashpoint.UnsupportedStateError, match=r"key 'cfg'.*save obj.to_dict\(\)"):
        stashpoint.save({"cfg": Config()}, tmp_path / "ck")
    with pytest.raises(
        TypeError, match=r"save\(\) got an unexpected keyword argument 'overwirte' \(did you mean 'overwrite'\?\)"
    ):
        stashpoint.save({}, tmp_path / "ck", overwirte=True)
    with pytest.raises(TypeError, match="metadata must map str to str"):
        stashpoint.save({}, tmp_path / "ck", metadata={"a": 1})
    assert not (tmp_path / "ck").exists(), "a refused save writes nothing"


def test_state_mismatch_lists_every_problem_at_once(tmp_path):
    stashpoint.save(
        {"a": torch.ones(2), "b": torch.ones(3), "c": torch.ones(4), "extra": torch.ones(1)}, tmp_path / "ck"
    )
    target = {"a": torch.zeros(5), "b": torch.zeros(3, dtype=torch.float64), "c": torch.zeros(4), "new": torch.zeros(1)}
    with pytest.raises(stashpoint.StateMismatchError) as info:
        stashpoint.load(target, tmp_path / "ck")
    msg = str(info.value)
    assert "'a': the checkpoint holds float32[2], the state holds float32[5]" in msg
    assert "'b': the checkpoint holds float32[3], the state holds float64[3]" in msg
    assert "unexpected key 'extra'" in msg and "missing key 'new'" in msg
    assert "strict=False" in msg
    assert len(info.value.problems) == 4
    assert torch.equal(target["c"], torch.zeros(4)), "a refused load changes nothing"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stashpoint.load(target, tmp_path / "ck", strict=False)
    assert torch.equal(target["c"], torch.ones(4)), "strict=False loads what matches"
    assert any("4 mismatch" in str(w.message) for w in caught)


def test_every_error_survives_pickling_with_its_message_and_attributes(tmp_path):
    """A process pool or a spawned worker hands an error back pickled. Before: a
    StateMismatchError came back as a TypeError about __init__'s missing argument."""
    import pickle

    import stashpoint.errors
    from stashpoint._dist.arrival import CollectiveError

    stashpoint.save({"a": torch.ones(2)}, tmp_path / "ck")
    with pytest.raises(stashpoint.StateMismatchError) as info:
        stashpoint.load({"a": torch.zeros(5)}, tmp_path / "ck")
    mismatch = stashpoint.StateMismatchError("/p", ["x", "y"], hint="a prefix")
    errors = [info.value, mismatch, CollectiveError("waited")]
    simple = [name for name in stashpoint.errors.__all__ if name != "StateMismatchError"]
    errors += [getattr(stashpoint.errors, name)(f"{name} message") for name in simple]
    for error in errors:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error), (error, back)
    back = pickle.loads(pickle.dumps(mismatch))
    assert (back.path, back.problems, back.hint) == ("/p", ["x", "y"], "a prefix")
    assert "Likely cause: a prefix." in str(back)


def test_a_lenient_load_reports_its_mismatches_once_on_stderr(tmp_path):
    """Before: a warning and a log line with the same text, both on stderr when the program
    sets up no logging (logging's last-resort handler)."""
    code = (
        "import sys, torch, stashpoint\n"
        "stashpoint.save({'a': torch.ones(2)}, sys.argv[1])\n"
        "stashpoint.load({'a': torch.zeros(2), 'new': torch.zeros(1)}, sys.argv[1], strict=False)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(stashpoint.__file__).parents[1])}
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck")], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("skipped 1 mismatch(es)") == 1, run.stderr


def test_module_mismatch_names_module_keys(tmp_path):
    stashpoint.save({"model": torch.nn.Linear(3, 2)}, tmp_path / "ck")
    with pytest.raises(stashpoint.StateMismatchError, match=r"'model/weight'.*float32\[2, 3\].*float32\[4, 3\]"):
        stashpoint.load({"model": torch.nn.Linear(3, 4)}, tmp_path / "ck")
    with pytest.raises(stashpoint.StateMismatchError, match="unexpected key 'model/bias'"):
        stashpoint.load({"model": torch.nn.Linear(3, 2, bias=False)}, tmp_path / "ck")


def _one_shard(path):
    (shard,) = path.glob("shard-*")
    return shard


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_bit_in_tensor_data_is_detected_with_key_and_file(tmp_path):
    stashpoint.save({"good": torch.ones(100), "bad": torch.ones(100)}, tmp_path / "ck")
    shard = _one_shard(tmp_path / "ck")
    _flip(shard, whole(tmp_path / "ck").tensors["bad"].chunks[0].start + 17)
    with pytest.raises(stashpoint.CorruptCheckpointError, match=rf"key 'bad' in shard .*{shard.name}"):
        stashpoint.load({"good": torch.zeros(100), "bad": torch.zeros(100)}, tmp_path / "ck")
    out = {"good": torch.zeros(100), "bad": torch.zeros(100)}
    stashpoint.load(out, tmp_path / "ck", verify=False)  # the user may opt out of checking
    assert torch.equal(out["good"], torch.ones(100)) and not torch.equal(out["bad"], torch.ones(100))


def test_truncated_shard_is_detected(tmp_path):
    stashpoint.save({"a": torch.ones(1000)}, tmp_path / "ck")
    shard = _one_shard(tmp_path / "ck")
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(stashpoint.CorruptCheckpointError, match="is truncated"):
        stashpoint.load({"a": torch.zeros(1000)}, tmp_path / "ck")


def test_damaged_header_is_detected(tmp_path):
    stashpoint.save({"a": torch.ones(10)}, tmp_path / "ck")
    _flip(_one_shard(tmp_path / "ck"), 20)
    with pytest.raises(stashpoint.CorruptCheckpointError, match=r"header of shard .* does not match the manifest"):
        stashpoint.load({"a": torch.zeros(10)}, tmp_path / "ck")


def test_missing_shard_and_broken_manifest_are_detected(tmp_path):
    stashpoint.save({"a": torch.ones(10)}, tmp_path / "ck")
    (tmp_path / "ck" / MANIFEST_NAME).write_bytes(b"{not json")
    with pytest.raises(stashpoint.CorruptCheckpointError, match="not valid JSON"):
        stashpoint.load({"a": torch.zeros(10)}, tmp_path / "ck")
    stashpoint.save({"a": torch.ones(10)}, tmp_path / "ck2")
    _one_shard(tmp_path / "ck2").unlink()
    with pytest.raises(stashpoint.CorruptCheckpointError, match="listed in the manifest is missing"):
        stashpoint.load({"a": torch.zeros(10)}, tmp_path / "ck2")


def test_manifest_from_another_checkpoint_is_detected(tmp_path):
    stashpoint.save({"a": torch.ones(10)}, tmp_path / "one")
    stashpoint.save({"a": torch.ones(10)}, tmp_path / "two")
    (tmp_path / "two" / MANIFEST_NAME).write_bytes((tmp_path / "one" / MANIFEST_NAME).read_bytes())
    (index,) = (tmp_path / "one").glob("index-*")
    (tmp_path / "two" / index.name).write_bytes(index.read_bytes())
    _one_shard(tmp_path / "two").rename(tmp_path / "two" / _one_shard(tmp_path / "one").name)
    with pytest.raises(stashpoint.CorruptCheckpointError, match="does not match the manifest"):
        stashpoint.load({"a": torch.zeros(10)}, tmp_path / "two")


# ----------------------------------------------------------------------------- fault injection


class _FailingWriter(FileWriter):
    def __init__(self, inner: FileWriter, budget: list[int]) -> None:
        self.inner, self.budget = inner, budget

    def write(self, data):
        n = len(memoryview(data).cast("B"))
        if self.budget[0] < n:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        self.budget[0] -= n
        self.inner.write(data)

    def close(self):
        self.inner.close()

    def abort(self):
        self.inner.abort()


class FailingStorage(LocalStorage):
    """A local directory whose writes fail once ``budget`` bytes have been written."""

    def __init__(self, root, budget: int) -> None:
        super().__init__(root)
        self.budget = [budget]

    def open_writer(self, name, size):
        return _FailingWriter(super().open_writer(name, size), self.budget)


def test_a_write_failing_mid_save_commits_nothing_and_keeps_the_previous_checkpoint(tmp_path):
    old = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(3)}
    stashpoint.save(old, tmp_path / "ck", max_shard_bytes=600_000)
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())

    new = {"w": torch.zeros(300_000), "b": torch.zeros(3)}
    handle = stashpoint.async_save(
        new, FailingStorage(tmp_path / "ck", budget=700_000), overwrite=True, max_shard_bytes=600_000
    )
    with pytest.raises(
        stashpoint.CheckpointError, match=r"saving the checkpoint to .*ck failed: OSError.*No space left"
    ) as info:
        handle.wait()
    assert isinstance(info.value.__cause__, OSError)
    assert isinstance(handle.exception(), stashpoint.CheckpointError)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before, "partial files are removed"
    out = {"w": torch.zeros(300_000), "b": torch.zeros(3)}
    stashpoint.load(out, tmp_path / "ck")
    assert torch.equal(out["w"], old["w"]), "the previous checkpoint is intact"
    # training goes on: the next save works
    stashpoint.save(new, tmp_path / "ck", overwrite=True)
    stashpoint.load(out, tmp_path / "ck")
    assert torch.equal(out["w"], new["w"])


class _CommitFails(LocalStorage):
    def commit(self, name, data, *, exclusive=False):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")


def test_an_overwrite_whose_commit_fails_leaves_the_checkpoint_it_would_replace_whole(tmp_path):
    """The shards of the checkpoint an overwrite replaces go only once its manifest is in place:
    a commit that fails (a full disk as the manifest is written) leaves the old one loadable."""
    old = {"w": torch.arange(300_000, dtype=torch.float32)}
    stashpoint.save(old, tmp_path / "ck", max_shard_bytes=600_000)
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    with pytest.raises(stashpoint.CheckpointError, match="No space left"):
        stashpoint.save({"w": torch.zeros(300_000)}, _CommitFails(tmp_path / "ck"), overwrite=True)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before
    out = {"w": torch.zeros(300_000)}
    stashpoint.load(out, tmp_path / "ck")
    assert torch.equal(out["w"], old["w"])


class _RefusingStorage(LocalStorage):
    def commit(self, name, data, *, exclusive=False):
        raise stashpoint.CheckpointError("the test refuses this commit.")


def test_a_failed_saves_message_has_one_full_stop_between_its_cause_and_what_it_means(tmp_path):
    with pytest.raises(stashpoint.CheckpointError) as info:
        stashpoint.save({"w": torch.ones(3)}, _RefusingStorage(tmp_path / "ck"))
    assert "refuses this commit. Nothing was committed there" in str(info.value), info.value
    assert ".." not in str(info.value)


def test_a_failed_first_save_leaves_no_manifest(tmp_path):
    h = stashpoint.async_save({"w": torch.ones(1000)}, FailingStorage(tmp_path / "ck", budget=100))
    assert isinstance(h.exception(), stashpoint.CheckpointError)
    assert not (tmp_path / "ck" / MANIFEST_NAME).exists()
    with pytest.raises(stashpoint.IncompleteCheckpointError):
        stashpoint.load({"w": torch.ones(1000)}, tmp_path / "ck")


class SlowStorage(LocalStorage):
    def __init__(self, root, gate: threading.Event) -> None:
        super().__init__(root)
        self.gate = gate

    def sync(self):
        assert self.gate.wait(30)
        super().sync()


def test_async_save_returns_once_staged_and_later_changes_do_not_leak_in(tmp_path):
    gate = threading.Event()
    state = {"w": torch.ones(1000)}
    h = stashpoint.async_save(state, SlowStorage(tmp_path / "ck", gate))
    state["w"].add_(1)  # training changes the state while the save persists
    assert not h.done() and h.stats is None
    with pytest.raises(TimeoutError, match="still running"):
        h.wait(timeout=0.05)
    gate.set()
    stats = h.wait(timeout=30)
    assert h.done() and h.exception() is None and h.stats == stats
    assert stats.bytes_written > 4000 and stats.blocking_s <= stats.total_s
    out = {"w": torch.zeros(1000)}
    stashpoint.load(out, tmp_path / "ck")
    assert torch.equal(out["w"], torch.ones(1000))


def test_a_second_async_save_waits_for_the_first(tmp_path):
    gate = threading.Event()
    h1 = stashpoint.async_save({"w": torch.ones(10)}, SlowStorage(tmp_path / "a", gate))
    threading.Timer(0.2, gate.set).start()
    h2 = stashpoint.async_save({"w": torch.ones(10)}, tmp_path / "b")
    assert h1.done(), "only one staged copy is in flight"
    assert h2.blocking_s >= 0.1
    h2.wait()


def test_directories_that_are_not_checkpoints_get_their_own_hint(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hi")
    with pytest.raises(stashpoint.CheckpointError, match=r"not a stashpoint checkpoint .*check the path"):
        stashpoint.load({}, tmp_path / "other")
    with stashpoint.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": torch.ones(2)}).wait()
    with pytest.raises(stashpoint.CheckpointError, match=r"run directory .*pass a step directory"):
        stashpoint.load({}, tmp_path / "run")


def test_a_shard_that_is_a_symbolic_link_is_refused(tmp_path):
    stashpoint.save({"a": torch.ones(10)}, tmp_path / "ck")
    shard = _one_shard(tmp_path / "ck")
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(stashpoint.CorruptCheckpointError, match="is a symbolic link, not a regular file"):
        stashpoint.load({"a": torch.zeros(10)}, tmp_path / "ck")


def test_verify_reports_every_problem(tmp_path):
    stashpoint.save(
        {"a": torch.ones(100), "b": torch.ones(100), "c": torch.ones(2_000_000)}, tmp_path / "ck", max_shard_bytes=1000
    )
    assert stashpoint.verify(tmp_path / "ck").ok
    manifest = whole(tmp_path / "ck")
    for key in ("a", "b"):
        chunk = manifest.tensors[key].chunks[0]
        _flip(tmp_path / "ck" / chunk.file, chunk.start + 3)
    (tmp_path / "ck" / manifest.tensors["c"].chunks[0].file).unlink()
    report = stashpoint.verify(tmp_path / "ck")
    text = "\n".join(report.problems)
    assert not report.ok and len(report.problems) >= 3, text
    assert "'a'" in text and "'b'" in text and "missing" in text


class DeniedStorage(LocalStorage):
    def open_writer(self, name, size):
        raise PermissionError(errno.EACCES, "Permission denied (injected)", str(self.root / name))


def test_permission_denied_fails_the_save_clearly_and_training_goes_on(tmp_path):
    stashpoint.save({"w": torch.ones(3)}, tmp_path / "ok")
    with pytest.raises(stashpoint.CheckpointError, match=r"failed: PermissionError.*Permission denied"):
        stashpoint.save({"w": torch.ones(3)}, DeniedStorage(tmp_path / "denied"))
    stashpoint.save({"w": torch.ones(3)}, tmp_path / "next")  # the next save works
    out = {"w": torch.zeros(3)}
    stashpoint.load(out, tmp_path / "ok")
    assert out["w"].sum() == 3


def test_loading_a_step_while_a_newer_one_is_being_saved(tmp_path):
    with stashpoint.CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        mgr.save(1, {"w": torch.full((100,), 1.0)}).wait()
        gate = threading.Event()
        mgr.storage_class = lambda root: SlowStorage(root, gate)  # type: ignore[assignment]
        h = mgr.save(2, {"w": torch.full((100,), 2.0)})
        out = {"w": torch.zeros(100)}
        assert mgr.restore(out) == 1 and out["w"][0] == 1.0, "the save in flight is not visible yet"
        gate.set()
        h.wait()
        assert mgr.restore(out) == 2 and out["w"][0] == 2.0


def test_the_manifest_is_published_only_after_every_shard_and_the_directory_are_durable(tmp_path, monkeypatch):
    """The order of the system calls of a save: fsync the parent of the directory it makes, each
    shard, the directory, then write the manifest to a temporary name, fsync it, publish it (a
    hard link, or a rename when overwriting), fsync the directory again."""
    import os as os_module

    from stashpoint._storage import local as _storage

    events: list[str] = []
    real_fsync, real_replace = os_module.fsync, os_module.replace

    def fsync(fd):
        target = os_module.readlink(f"/proc/self/fd/{fd}")
        events.append("fsync " + ("dir" if os_module.path.isdir(target) else os_module.path.basename(target)))
        real_fsync(fd)

    real_link = os_module.link

    def replace(src, dst):
        events.append(f"rename {os_module.path.basename(dst)}")
        real_replace(src, dst)

    def link(src, dst):  # without overwrite the manifest is published by a hard link: exclusive
        events.append(f"link {os_module.path.basename(dst)}")
        real_link(src, dst)

    monkeypatch.setattr(_storage.os, "fsync", fsync)
    monkeypatch.setattr(_storage.os, "replace", replace)
    monkeypatch.setattr(_storage.os, "link", link)
    state = {"a": torch.ones(300_000), "b": torch.ones(10)}
    for overwrite, publish in ((False, "link manifest.json"), (True, "rename manifest.json")):
        events.clear()
        stashpoint.save(state, tmp_path / "ck", max_shard_bytes=600_000, overwrite=overwrite)
        shards = [e for e in events if e.startswith("fsync shard-")]
        assert len(shards) == 2
        assert [e for e in events if e.endswith(" manifest.json")] == [publish], events
        at = events.index(publish)
        last_shard = max(events.index(e) for e in shards)
        if not overwrite:
            assert events[0] == "fsync dir", "the new checkpoint directory's name in its parent, first"
        assert last_shard < events.index("fsync dir", last_shard) < at, events
        assert any(e.startswith("fsync index-") for e in events[:at]), "the rank's index is durable first too"
        assert events[at - 1].startswith("fsync .manifest.json."), "the manifest's own bytes are durable first"
        assert events[at + 1] == "fsync dir", "and its name is made durable right after it is published"


def test_an_extra_file_is_reported_by_verify_and_does_not_affect_loading(tmp_path):
    stashpoint.save({"a": torch.ones(10)}, tmp_path / "ck")
    (tmp_path / "ck" / "shard-r00000-0000-0123456789abcdef.safetensors").write_bytes(b"leftover")
    report = stashpoint.verify(tmp_path / "ck")
    assert report.ok and any("not listed in the manifest" in w for w in report.warnings)
    out = {"a": torch.zeros(10)}
    stashpoint.load(out, tmp_path / "ck")
    assert out["a"].sum() == 10


def test_an_unlisted_shard_of_the_same_save_is_corruption(tmp_path):
    """A version-1 manifest that lost entries (re-sealed) is found by the shards of its save it
    does not list (a version-2 manifest names each index by checksum: test_format_v2.py)."""
    stashpoint.save({"a": torch.ones(10)}, tmp_path / "ck")
    to_v1(tmp_path / "ck")
    save_id = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_text())["save_id"]
    shard = _one_shard(tmp_path / "ck")
    (tmp_path / "ck" / f"shard-r00000-0009-{save_id}.safetensors").write_bytes(shard.read_bytes())
    with pytest.raises(stashpoint.CorruptCheckpointError, match=r"belongs to this checkpoint's save but its manifest"):
        stashpoint.load({"a": torch.zeros(10)}, tmp_path / "ck")
    assert any("does not list" in p for p in stashpoint.verify(tmp_path / "ck").problems)


def test_loading_the_checkpoint_being_saved_waits_for_it(tmp_path):
    gate = threading.Event()
    h = stashpoint.async_save({"w": torch.full((100,), 3.0)}, SlowStorage(tmp_path / "ck", gate))
    out = {"w": torch.zeros(100)}
    threading.Timer(0.5, gate.set).start()
    stashpoint.load(out, tmp_path / "ck")  # not "no checkpoint": the save in flight commits first
    assert h.done() and out["w"][0] == 3.0


def test_strict_load_lists_plain_values_missing_from_the_checkpoint(tmp_path):
    stashpoint.save({"w": torch.ones(3)}, tmp_path / "ck")
    with pytest.raises(stashpoint.StateMismatchError, match="missing key 'step'"):
        stashpoint.load({"w": torch.zeros(3), "step": 0}, tmp_path / "ck")


def test_an_empty_path_is_refused_instead_of_writing_into_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="path is empty"):
        stashpoint.save({"w": torch.ones(2)}, "")
    assert list(tmp_path.iterdir()) == []


def test_an_expanded_tensor_saves_and_loading_into_one_names_it(tmp_path):
    stashpoint.save({"t": torch.arange(3.0)[:1].expand(10)}, tmp_path / "c")
    out = {"t": torch.zeros(10)}
    stashpoint.load(out, tmp_path / "c")
    assert torch.equal(out["t"], torch.zeros(10))
    with pytest.raises(stashpoint.StateMismatchError, match=r"'t': .* a view whose elements share memory"):
        stashpoint.load({"t": torch.ones(1).expand(10)}, tmp_path / "c")


def test_a_path_under_a_file_names_the_file_in_the_way(tmp_path, caplog):
    (tmp_path / "afile").write_text("not a directory")
    refused = pytest.raises(stashpoint.CheckpointError, match=r"^\S*afile exists and is not a directory; a checkpoint")
    with caplog.at_level(logging.WARNING, logger="stashpoint"), refused:
        stashpoint.save({"w": torch.ones(3)}, tmp_path / "afile")  # at once: no warning of files kept
    assert caplog.text == "", caplog.text
    with pytest.raises(stashpoint.CheckpointError, match=r"afile exists and is not a directory, so .*afile/sub cannot"):
        stashpoint.save({"w": torch.ones(3)}, tmp_path / "afile" / "sub")
    with pytest.raises(stashpoint.CheckpointError, match=r"afile exists and is not a directory; a checkpoint"):
        stashpoint.CheckpointManager(tmp_path / "afile")


def test_a_link_to_a_directory_that_is_not_there_names_the_link_and_its_target(tmp_path):
    (tmp_path / "runs").symlink_to(tmp_path / "unmounted" / "scratch")
    for root in (tmp_path / "runs", tmp_path / "runs" / "exp1"):
        with pytest.raises(stashpoint.CheckpointError, match=r"runs is a symbolic link to .*unmounted/scratch, which"):
            stashpoint.CheckpointManager(root)
        with pytest.raises(stashpoint.CheckpointError, match=r"does not exist; create that directory"):
            stashpoint.save({"w": torch.ones(3)}, root)
    assert not (tmp_path / "unmounted").exists()


def test_a_mismatch_by_a_wrappers_prefix_says_so(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    wrapped_sd = {f"module.{k}": v for k, v in model.state_dict().items()}  # what DDP's state_dict() gives
    stashpoint.save({"model": wrapped_sd}, tmp_path / "c")
    with pytest.raises(stashpoint.StateMismatchError, match=r"Likely cause: the keys differ by a wrapper's prefix"):
        stashpoint.load({"model": model}, tmp_path / "c")
    stashpoint.save({"model": {"encoder.weight": torch.ones(4, 4)}}, tmp_path / "d")
    with pytest.raises(stashpoint.StateMismatchError) as other:  # another mismatch: no such hint
        stashpoint.load({"model": model}, tmp_path / "d")
    assert "Likely cause" not in str(other.value)


def test_a_launched_process_that_never_joined_its_group_is_warned_that_it_saves_alone(tmp_path, monkeypatch):
    """torchrun set WORLD_SIZE, but init_process_group was forgotten: every process would save
    alone to the same path."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(UserWarning, match=r"WORLD_SIZE=2 but torch.distributed is not initialized.*init_process_group"):
        stashpoint.save({"w": torch.ones(3)}, tmp_path / "c")
    # the second process finds the first one's checkpoint, or manager: told the real cause
    with (
        pytest.warns(UserWarning),
        pytest.raises(stashpoint.CheckpointError, match=r"already exists .*every process saves alone"),
    ):
        stashpoint.save({"w": torch.ones(3)}, tmp_path / "c")
    with (
        stashpoint.CheckpointManager(tmp_path / "run"),
        pytest.raises(stashpoint.CheckpointError, match=r"already owns .*every process saves alone"),
    ):
        stashpoint.CheckpointManager(tmp_path / "run")


def test_an_optimizer_state_loaded_into_another_of_torchs_optimizers_is_a_mismatch(tmp_path):
    """AdamW's state in SGD fails at SGD's first step; Adam's in AdamW would train on as Adam."""
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    stashpoint.save({"model": model, "optim": optim}, tmp_path / "c")
    fresh = torch.nn.Linear(4, 4)
    for other in (torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9), torch.optim.Adam(fresh.parameters())):
        wrong = r"holds the state of an optimizer of class AdamW, the state holds one of class (SGD|Adam):"
        with pytest.raises(stashpoint.StateMismatchError, match=wrong):
            stashpoint.load({"model": fresh, "optim": other}, tmp_path / "c")
    same = torch.optim.AdamW(fresh.parameters())
    stashpoint.load({"model": fresh, "optim": same}, tmp_path / "c")
    assert torch.equal(same.state[next(iter(fresh.parameters()))]["exp_avg"], optim.state[model.weight]["exp_avg"])


def test_a_copy_that_fails_in_the_call_is_a_checkpoint_error_and_the_buffers_are_reusable(tmp_path, monkeypatch):
    """A GPU out of memory for a gather's scratch (injected: there is no GPU here) reaches the
    caller as a CheckpointError naming the path, and the next save works."""
    from stashpoint._save import engine

    def oom(pairs, fences=None):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    state = {"w": torch.arange(6.0)}
    with monkeypatch.context() as m:
        m.setattr(engine, "stage", oom)
        with pytest.raises(stashpoint.CheckpointError, match=r"staging memory for .*ck.*OutOfMemoryError.*untouched"):
            stashpoint.save(state, tmp_path / "ck")
    stashpoint.save(state, tmp_path / "ck")
    out = {"w": torch.zeros(6)}
    stashpoint.load(out, tmp_path / "ck")
    assert torch.equal(out["w"], state["w"])


def test_keys_under_another_prefix_get_a_hint_naming_both_prefixes(tmp_path):
    """A model saved bare and loaded as the submodule of another (or the other way round)."""
    body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    stashpoint.save({"model": body}, tmp_path / "c")

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))

    with pytest.raises(stashpoint.StateMismatchError, match=r"differ by a prefix: .*'model' where the state has "
                       r"'model.backbone' \('model/0.weight' against 'model/backbone.0.weight'\)"):  # fmt: skip
        stashpoint.load({"model": Wrapped()}, tmp_path / "c")


def test_the_hint_for_a_key_of_thousands_of_parts_is_not_worked_out(tmp_path):
    """Every tail of every unexpected key was kept to find a prefix: 718 MiB for one key of 10k parts."""
    import tracemalloc

    stashpoint.save({"a." * 10_000 + "w": torch.zeros(1)}, tmp_path / "c")
    tracemalloc.start()
    try:
        with pytest.raises(stashpoint.StateMismatchError, match=r"unexpected key 'a\.a\.a"):
            stashpoint.load({"b": torch.zeros(1)}, tmp_path / "c")
        peak_mib = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    assert peak_mib < 100, f"the mismatch's hint took {peak_mib:.0f} MiB"


def test_a_dtype_mismatch_says_that_a_load_does_not_cast_and_how_to_get_there(tmp_path):
    model = torch.nn.Linear(4, 4)
    stashpoint.save({"model": model}, tmp_path / "c")
    with pytest.raises(stashpoint.StateMismatchError) as info:
        stashpoint.load({"model": torch.nn.Linear(4, 4).to(torch.bfloat16)}, tmp_path / "c")
    message = str(info.value)
    assert "float32[4, 4], the state holds bfloat16[4, 4]" in message
    assert "a load does not cast" in message and "model.to(torch.bfloat16)" in message, message


def test_a_file_size_limit_below_the_staging_memory_is_named(tmp_path):
    """The staging memory is a memory file, which ``ulimit -f`` counts: a save larger than the
    limit got a bare ``OSError: File too large`` out of ``save``."""
    code = f"""
import resource, torch, stashpoint
resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))
try:
    stashpoint.save({{"w": torch.ones(3 << 20)}}, {str(tmp_path / "ck")!r}, max_shard_bytes=1 << 20)
except stashpoint.CheckpointError as e:
    print("REFUSED", e)
"""
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert "REFUSED" in out.stdout and "ulimit -f" in out.stdout, out.stdout


def test_a_class_given_instead_of_its_object_is_named(tmp_path):
    """Before: torch's ``TypeError: Module.state_dict() missing 1 required positional argument``."""
    with pytest.raises(stashpoint.UnsupportedStateError, match=r"Linear is a class, not an object of it"):
        stashpoint.save({"model": torch.nn.Linear}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_keys_that_print_alike_but_differ_in_type_are_named_as_such(tmp_path):
    """Before: 'emb/0' was listed both as missing and as unexpected, with nothing to tell why."""
    stashpoint.save({"emb": {"0": torch.ones(2), "1": torch.ones(2)}}, tmp_path / "ck")
    with pytest.raises(stashpoint.StateMismatchError, match=r"'emb': 2 key\(s\) \(0, 1\) are of type str in the "):
        stashpoint.load({"emb": {0: torch.zeros(2), 1: torch.zeros(2)}}, tmp_path / "ck")


def test_a_key_of_another_type_is_skipped_by_a_lenient_load_not_loaded(tmp_path):
    """Before: strict=False said it skipped the tensor under 1 and loaded it into "1" all the same
    (the catalog's path of the int key prints as the str key's); partial=True did it silently."""
    stashpoint.save({1: torch.ones(2), "nested": {"": {"b": torch.ones(2)}}}, tmp_path / "ck")
    live = {"1": torch.zeros(2), "nested": {"b": torch.zeros(2)}}
    with pytest.warns(UserWarning, match=r"(?s)skipped .*are of type int in the checkpoint and str in the state"):
        stashpoint.load(live, tmp_path / "ck", strict=False)
    assert torch.equal(live["1"], torch.zeros(2)) and torch.equal(live["nested"]["b"], torch.zeros(2))
    with pytest.raises(stashpoint.StateMismatchError, match=r"missing key '1'(.|\n)*of type int in the checkpoint"):
        stashpoint.load(live, tmp_path / "ck", partial=True)
    assert torch.equal(live["1"], torch.zeros(2))


def test_two_spellings_of_one_visible_name_are_told_apart_in_the_mismatch(tmp_path):
    """Before: "unexpected key 'café'" and "missing key 'café'" side by side (NFC and NFD)."""
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    stashpoint.save({composed: torch.ones(2)}, tmp_path / "ck")
    with pytest.raises(stashpoint.StateMismatchError) as e:
        stashpoint.load({decomposed: torch.zeros(2)}, tmp_path / "ck")
    assert f"unexpected key {composed!r}: in the checkpoint" in str(e.value)
    assert "missing key 'cafe\u0301' (written 'cafe\\u0301', not in Unicode's composed form)" in str(e.value)


def test_objects_saved_in_a_container_the_state_holds_empty_are_missing_not_rebuilt(tmp_path):
    """Before: an empty list or dict took the saved one, objects' states as plain dicts: a
    scheduler left out of the state (or an object registered after the load) went unnoticed."""
    model = torch.nn.Linear(2, 2)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    stashpoint.save({"scheds": [sched], "by_name": {"m": model}, "losses": [torch.ones(2)]}, tmp_path / "ck")
    for live, where in (
        ({"scheds": [], "by_name": {"m": model}}, "'scheds'"),
        ({"scheds": [sched], "by_name": {}}, "'by_name'"),
    ):
        state = {**live, "losses": []}
        with pytest.raises(stashpoint.StateMismatchError, match=where + r": the checkpoint holds 1 object\(s\)"):
            stashpoint.load(state, tmp_path / "ck")
    state = {"scheds": [], "by_name": {"m": model}, "losses": []}
    with pytest.warns(UserWarning, match="put the objects in it"):
        stashpoint.load(state, tmp_path / "ck", strict=False)
    assert state["scheds"] == [] and torch.equal(state["losses"][0], torch.ones(2))  # plain values still grow


def test_drop_locals_clears_chained_errors_frames_and_leaves_a_suspended_generator_running():
    import weakref

    from stashpoint._runtime import drop_locals

    class Held:
        pass

    def inner() -> None:
        big = Held()
        refs.append(weakref.ref(big))
        raise ValueError("inner")

    def outer() -> None:
        try:
            inner()
        except ValueError:
            raise KeyError("outer") from None  # the inner error stays its __context__

    def gen():
        try:
            yield 1
            raise ValueError("in a generator")
        except ValueError as e:
            caught.append(e)
        yield 2
        yield 3

    refs: list = []
    caught: list = []
    try:
        outer()
    except KeyError as e:
        error = e
    drop_locals(error)
    assert refs[0]() is None, "the chained error's frame let its locals go"
    g = gen()
    assert next(g) == 1 and next(g) == 2
    drop_locals(caught[0])
    assert next(g, "closed") == 3, "a suspended generator's frame is left alone (clearing it closes it)"
