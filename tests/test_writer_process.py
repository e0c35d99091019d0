"""The writer process (``writer="process"``): a real child process that maps the staging memory
and writes the shard files, reused across saves, killed for real, and never left behind.

Nothing is simulated: the child is the one the library starts, ``kill -9`` is a real SIGKILL
sent while it is writing (it is first frozen with SIGSTOP, so the test knows it was mid-write),
and "parent exit" is a real Python process that exits or is killed.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import stashpoint
from conftest import run_python, whole
from dist_util import run_world
from stashpoint._core.format import CHECKSUM_BLOCK_BYTES, block_checksums
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._core.plan import TensorSpec, plan_files
from stashpoint._save import engine as _save
from stashpoint._save import writerproc as _writerproc
from stashpoint._save.persist import shard_writes
from stashpoint._save.shardio import block_sums
from stashpoint._save.staging import StagingBuffers
from stashpoint._storage import LocalStorage

WORKER = Path(__file__).with_name("writerproc_worker.py")
MiB = 1 << 20


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def maps(pid: int) -> list[tuple[int, int, str, str, str]]:
    """``/proc/PID/maps`` as (start, end, permissions, inode, path)."""
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        out.append((start, end, parts[1], parts[4], parts[5] if len(parts) > 5 else ""))
    return out


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def checksums(path: Path) -> dict[str, list[list[str]]]:
    return {k: [list(c.checksums) for c in e.chunks] for k, e in whole(path).tensors.items()}


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tied = torch.randn(64, 64, generator=g)
    state = {
        "f32": torch.randn(300, 300, generator=g),
        "f64": torch.randn(1000, dtype=torch.float64, generator=g),
        "bf16": torch.randn(5000, generator=g).bfloat16(),
        "f16": torch.randn(777, generator=g).half(),
        "i64": torch.randint(-(2**40), 2**40, (1234,), generator=g),
        "i8": torch.randint(-128, 128, (333,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 256, (4097,), dtype=torch.uint8, generator=g),
        "bool": torch.rand(999, generator=g) > 0.5,
        "c64": torch.randn(100, dtype=torch.complex64, generator=g),
        "f8": torch.randn(500, generator=g).to(torch.float8_e4m3fn),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "transposed": torch.randn(50, 40, generator=g).t(),
        "tied_a": tied,
        "tied_b": tied,
    }
    return state


def test_block_checksums_are_the_formats():
    data = torch.randint(0, 256, (2 * CHECKSUM_BLOCK_BYTES + 3,), dtype=torch.uint8).numpy().tobytes()
    for n in (0, 1, CHECKSUM_BLOCK_BYTES, len(data)):
        mv = memoryview(data)[:n]
        assert block_sums(mv, CHECKSUM_BLOCK_BYTES) == block_checksums(mv)


def test_round_trip_is_bitwise_the_files_match_the_thread_writers_and_the_child_is_reused(tmp_path):
    state = mixed_state()
    by_thread = stashpoint.save(state, tmp_path / "thread", writer="thread", max_shard_bytes=100_000)
    by_child = stashpoint.save(state, tmp_path / "process", writer="process", max_shard_bytes=100_000)
    pid = _writerproc.current_pid()
    assert by_thread.writer == "thread" and by_child.writer == "process"
    assert pid is not None and alive(pid) and pid != os.getpid()
    assert by_child.num_files >= 3 and by_child.bytes_written == by_thread.bytes_written
    assert checksums(tmp_path / "process") == checksums(tmp_path / "thread"), "the same bytes, the same sums"

    out = {k: torch.zeros_like(v) for k, v in state.items()}
    out["tied_b"] = out["tied_a"]
    stashpoint.load(out, tmp_path / "process")
    for k, v in state.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and torch.equal(bits(out[k]), bits(v)), k

    again = stashpoint.save(state, tmp_path / "process", writer="process", overwrite=True)
    assert again.writer == "process" and _writerproc.current_pid() == pid, "one writer process, reused"


def test_the_writer_process_maps_the_staging_memory_and_unmaps_it_when_freed(tmp_path):
    stashpoint.shutdown()  # an empty staging pool: another test's free buffer in this process is not ours
    state = {"w": torch.randn(16 * MiB)}  # 64 MiB
    stashpoint.save(state, tmp_path / "a", writer="process")
    pid = _writerproc.current_pid()
    assert pid is not None
    engine = _save.current_engine()
    assert engine is not None
    staged = engine.pool._free[-1]
    region = staged.region
    assert region is not None and staged.buffer.data_ptr() % 4096 == 0
    name = f"/memfd:stashpoint-staging-{region.token}"
    ours = [m for m in maps(os.getpid()) if m[4].startswith(name)]
    theirs = [m for m in maps(pid) if m[4].startswith(name)]
    assert len(ours) == 1 and ours[0][0] <= staged.buffer.data_ptr() < ours[0][1], "the staging buffer is the memfd"
    assert len(theirs) == 1 and theirs[0][1] - theirs[0][0] == ours[0][1] - ours[0][0]
    assert ours[0][2][3] == "s" and theirs[0][2][3] == "s", "MAP_SHARED on both sides"
    assert ours[0][3] == theirs[0][3], "the same memory file (inode)"
    # no copy: the child read all 64 MiB through the shared mapping and holds no private copy
    assert status_kb(pid, "RssShmem") >= 60 * 1024
    assert status_kb(pid, "RssAnon") < 48 * 1024
    assert not any("libtorch" in m[4] for m in maps(pid)), "the writer process does not load torch"

    del staged, region
    stashpoint.save({"w": torch.randn(64 * MiB)}, tmp_path / "b", writer="process")  # too big to reuse it
    gc.collect()  # the freed buffer's last references may sit in a cycle
    assert _writerproc.current_pid() == pid
    assert not any(m[4].startswith(name) for m in maps(os.getpid())), "the old buffer was freed"
    assert not any(m[4].startswith(name) for m in maps(pid)), "and the writer process unmapped it"


def _stop_mid_write(ck: Path, before: set[str], pid: int, total: int) -> int:
    """Freeze the writer process once it has created its first new shard; the new files seen."""
    deadline = time.monotonic() + 30
    while not set(os.listdir(ck)) - before:
        assert time.monotonic() < deadline, "the writer process never started writing"
        time.sleep(0.0005)
    os.kill(pid, signal.SIGSTOP)
    new = len(set(os.listdir(ck)) - before)
    assert new < total, f"the writer had already created all {total} files: no mid-write moment was caught"
    return new


def _only_that_save_failed(ck: Path, before: set[str], old: dict[str, torch.Tensor], pid: int) -> None:
    """The failed save left nothing behind, the previous checkpoint loads, and the next save,
    in a new writer process, round-trips."""
    assert set(os.listdir(ck)) == before, "the partial shard files are removed"
    out = {"w": torch.zeros(1000)}
    stashpoint.load(out, ck)
    assert torch.equal(out["w"], old["w"]), "the previous checkpoint is intact"
    new = _many_files()
    stats = stashpoint.save(new, ck, overwrite=True, writer="process", max_shard_bytes=MiB)
    assert stats.writer == "process"
    assert _writerproc.current_pid() not in (None, pid), "a new writer process"
    back = {k: torch.zeros_like(v) for k, v in new.items()}
    stashpoint.load(back, ck)
    assert all(torch.equal(back[k], new[k]) for k in new)


def _many_files() -> dict[str, torch.Tensor]:
    return {f"t{i:03d}": torch.full((MiB // 4,), float(i)) for i in range(96)}  # one 1 MiB file each


def _saved_once(ck: Path) -> tuple[dict[str, torch.Tensor], int, set[str]]:
    """A first save through the writer process: the state, the writer's pid, the files."""
    old = {"w": torch.arange(1000, dtype=torch.float32)}
    stashpoint.save(old, ck, writer="process")
    pid = _writerproc.current_pid()
    assert pid is not None
    return old, pid, set(os.listdir(ck))


def test_kill_9_of_the_writer_mid_save_fails_that_save_cleanly_and_the_next_save_starts_a_new_one(tmp_path):
    ck = tmp_path / "ck"
    old, pid, before = _saved_once(ck)
    handle = stashpoint.async_save(_many_files(), ck, overwrite=True, writer="process", max_shard_bytes=MiB)
    _stop_mid_write(ck, before, pid, total=96)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(stashpoint.CheckpointError) as info:
        handle.wait(timeout=60)
    msg = str(info.value)
    assert f"writer process (pid {pid}) was killed by SIGKILL while writing the shards of {ck}" in msg, msg
    assert "Nothing was committed there and earlier checkpoints are untouched" in msg, msg
    _only_that_save_failed(ck, before, old, pid)


def test_a_writer_process_that_writes_nothing_for_the_stall_limit_is_killed_and_the_next_save_goes_on(
    tmp_path, monkeypatch
):
    ck = tmp_path / "ck"
    old, pid, before = _saved_once(ck)
    monkeypatch.setenv(_writerproc.STALL_ENV, "2")
    handle = stashpoint.async_save(_many_files(), ck, overwrite=True, writer="process", max_shard_bytes=MiB)
    try:
        _stop_mid_write(ck, before, pid, total=96)  # and left stopped, as a hung storage would leave it
        start = time.monotonic()
        with pytest.raises(stashpoint.CheckpointError) as info:
            handle.wait(timeout=60)
        took = time.monotonic() - start
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    msg = str(info.value)
    assert f"writer process (pid {pid}) stopped answering while writing the shards of {ck}" in msg, msg
    assert "it wrote nothing for 2 s" in msg and _writerproc.STALL_ENV in msg, msg
    assert took < 30, f"the save failed {took:.1f} s after the writer stopped"
    assert gone_within(pid, 10), "the stopped writer process was killed"
    _only_that_save_failed(ck, before, old, pid)


def test_a_slow_writer_process_that_keeps_writing_is_not_a_stall(tmp_path, monkeypatch):
    """Stopped for 1.2 s and let run for 0.1 s in turn: slower than the 3 s limit in all, but
    never 3 s without progress, so the save succeeds (0.05 s runs were too short for a shard
    under a loaded CI run, which then saw no progress for 3 s; 100 MiB was written in two runs
    of 0.1 s on a quiet one, too few to outlast the limit: 300 MiB takes at least three)."""
    ck = tmp_path / "ck"
    stashpoint.save({"w": torch.zeros(1)}, ck, writer="process")
    pid = _writerproc.current_pid()
    assert pid is not None
    monkeypatch.setenv(_writerproc.STALL_ENV, "3")
    new = {f"t{i:04d}": torch.full((MiB // 16,), float(i)) for i in range(1200)}
    start = time.monotonic()
    handle = stashpoint.async_save(new, ck, overwrite=True, writer="process", max_shard_bytes=MiB // 4)
    try:
        while not handle.done():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(1.2)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1)
    finally:
        os.kill(pid, signal.SIGCONT)
    handle.wait(timeout=60)
    took = time.monotonic() - start
    assert took > 3, f"the save took {took:.1f} s: not longer than the limit, so it proves nothing"
    assert _writerproc.current_pid() == pid, "the same writer process"
    back = {k: torch.zeros_like(v) for k, v in new.items()}
    stashpoint.load(back, ck)
    assert all(torch.equal(back[k], new[k]) for k in new)


def test_the_stall_limit_comes_from_the_environment_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.delenv(_writerproc.STALL_ENV, raising=False)
    assert _writerproc.writer_stall_s() == _writerproc.DEFAULT_STALL_S
    monkeypatch.setenv(_writerproc.STALL_ENV, "0")
    assert _writerproc.writer_stall_s() is None
    monkeypatch.setenv(_writerproc.STALL_ENV, " 2.5 ")
    assert _writerproc.writer_stall_s() == 2.5
    for bad in ("-1", "soon", "inf", "nan"):
        monkeypatch.setenv(_writerproc.STALL_ENV, bad)
        with pytest.raises(ValueError, match=f"STASHPOINT_WRITER_STALL_S='{bad}' must be a number of seconds"):
            _writerproc.writer_stall_s()


def test_an_error_in_the_writer_process_comes_back_with_its_traceback_and_the_child_lives_on(tmp_path):
    """A storage's error comes back as its one line, as from the writer thread (before, with the
    child's traceback, a screenful in the log at every save a full disk failed); any other error
    with the traceback."""
    specs = (TensorSpec("x", "float32", (1000,), 4),)
    plan = plan_files(specs, max_file_bytes=1 << 30)
    staged = StagingBuffers.allocate(plan, specs, pin_device=None)
    writes = shard_writes(plan.files, staged, rank=0, save_id="0" * 16)
    writer = _writerproc.get()
    missing = tmp_path / "no" / "such" / "dir"
    desc = {"kind": "local", "root": str(missing), "direct_io": True}
    with pytest.raises(stashpoint.CheckpointError) as info:
        writer.write(desc, str(missing), writes, staged, block=CHECKSUM_BLOCK_BYTES)
    msg = str(info.value)
    assert f"writing the shards of {missing} in the writer process (pid {writer.pid}) failed: FileNotFoundError" in msg
    assert "\n" not in msg, "a storage's error is one line"
    with pytest.raises(stashpoint.CheckpointError) as info:
        writer.write({**desc, "root": str(tmp_path)}, str(tmp_path), writes, staged, block=0)
    msg = str(info.value)
    assert "failed: ValueError" in msg
    assert "The writer process's traceback:\nTraceback (most recent call last)" in msg and "shardio.py" in msg
    from stashpoint._save import writerchild

    lost = writerchild._write({"storage": desc, "token": 7}, {}, None)  # type: ignore[arg-type]
    assert lost["type"] == "ProtocolError" and "never sent" in lost["error"], lost
    assert "Traceback" in lost["traceback"], "the protocol's own error is no storage's: it keeps its traceback"
    assert _writerproc.current_pid() == writer.pid, "an error is not a crash: the same writer goes on"
    assert stashpoint.save({"x": torch.ones(3)}, tmp_path / "ok", writer="process").writer == "process"


class _Subclassed(LocalStorage):
    """A backend the writer process cannot re-create (it could change what a write does)."""


def test_a_storage_the_child_cannot_open_is_written_on_the_thread(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="stashpoint"):
        stats = stashpoint.save({"x": torch.ones(10)}, _Subclassed(tmp_path / "ck"), writer="process")
    assert stats.writer == "thread"
    assert "the writer process cannot open" in caplog.text and "_Subclassed" in caplog.text
    out = {"x": torch.zeros(10)}
    stashpoint.load(out, tmp_path / "ck")
    assert torch.equal(out["x"], torch.ones(10))


def test_an_unknown_writer_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="writer must be 'thread' or 'process', got 'fork'"):
        stashpoint.save({"x": torch.ones(1)}, tmp_path / "ck", writer="fork")


def test_overlap_with_the_writer_process(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)

    def train_step() -> None:
        model(torch.randn(32, 256)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()

    for _ in range(2):
        train_step()
    state = {"model": model, "optim": optim}
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    ref_opt = {i: {n: t.clone() for n, t in s.items()} for i, s in optim.state_dict()["state"].items()}
    handle = stashpoint.async_save(state, tmp_path / "ck", overlap=True, writer="process")
    for _ in range(3):
        train_step()  # changes every tensor; step() waits for the background copies
    stats = handle.wait()
    assert stats.writer == "process"
    assert not torch.equal(model[0].weight, ref["0.weight"]), "training went on"

    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8))
    optim2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    stashpoint.load({"model": model2, "optim": optim2}, tmp_path / "ck")
    got = model2.state_dict()
    assert all(torch.equal(bits(got[k]), bits(ref[k])) for k in ref)
    got_opt = optim2.state_dict()["state"]
    assert all(torch.equal(got_opt[i][n], ref_opt[i][n]) for i in ref_opt for n in ref_opt[i])


_PARENT = """
import os, signal, sys, torch, stashpoint
from stashpoint._save import writerproc as _writerproc
stashpoint.save({"w": torch.ones(1000)}, sys.argv[1], writer="process")
print("PID", _writerproc.current_pid(), flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_the_parent_exiting_or_killed_leaves_no_writer_process_behind(tmp_path, how):
    done = run_python(_PARENT, str(tmp_path / "ck"), how, timeout=120)
    assert done.returncode == (0 if how == "exit" else -signal.SIGKILL), done.stderr
    pid = int(next(ln for ln in done.stdout.splitlines() if ln.startswith("PID ")).split()[1])
    assert gone_within(pid, 5.0), f"the writer process {pid} outlived its parent"
    assert (tmp_path / "ck" / MANIFEST_NAME).exists()


_PARENT_MID_WRITE = """
import os, signal, sys, time, torch, stashpoint
from stashpoint._save import writerproc as _writerproc
ck = sys.argv[1]
stashpoint.save({"w": torch.ones(10)}, ck, writer="process")
before = set(os.listdir(ck))
state = {f"t{i:03d}": torch.full((2**18,), float(i)) for i in range(256)}  # 256 files of 1 MiB
stashpoint.async_save(state, ck, overwrite=True, writer="process", max_shard_bytes=2**20)
while not set(os.listdir(ck)) - before:
    time.sleep(0.0005)
print("PID", _writerproc.current_pid(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the training process dies while its writer writes
"""


@pytest.mark.slow
def test_the_parent_killed_mid_write_leaves_no_writer_process_and_nothing_committed(tmp_path):
    ck = tmp_path / "ck"
    done = run_python(_PARENT_MID_WRITE, str(ck), timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    pid = int(next(ln for ln in done.stdout.splitlines() if ln.startswith("PID ")).split()[1])
    assert gone_within(pid, 5.0), f"the writer process {pid} outlived its parent"
    doc = json.loads((ck / MANIFEST_NAME).read_text())
    assert list(doc["tensors"]) == ["w"], "the save in flight was not committed; the first one stands"


def test_two_gloo_ranks_each_with_its_writer_process(tmp_path):
    results = run_world(2, str(tmp_path / "ck"), worker=WORKER, timeout=240)
    for rank, r in enumerate(results):
        assert r["same"], f"rank {rank} loaded other values"
        assert r["writers"] == ["process", "process"], r
        assert r["pids"][0] is not None and r["pids"][0] == r["pids"][1], f"rank {rank}: one writer, reused"
        assert all(b > 0 for b in r["rank_bytes"]), f"rank {rank} wrote nothing: {r}"
    assert results[0]["pids"][0] != results[1]["pids"][0], "one writer process per rank"
    assert results[0]["bytes"] == sum(r["rank_bytes"][1] for r in results)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA path (cudaHostRegister'd shared staging): needs a GPU")
def test_cuda_tensors_through_pinned_shared_staging_and_the_writer_process(tmp_path):
    state = {"w": torch.randn(1000, 1000, device="cuda"), "i": torch.arange(10, device="cuda"), "cpu": torch.ones(5)}
    stats = stashpoint.save(state, tmp_path / "ck", writer="process")
    assert stats.writer == "process"
    engine = _save.current_engine()
    assert engine is not None
    staged = engine.pool._free[-1]
    assert staged.region is not None and staged.region.pinned, "shared memory, registered with CUDA"
    assert staged.buffer.is_pinned(), "torch sees the registered pages as pinned (asynchronous copies)"
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    stashpoint.load(out, tmp_path / "ck")
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_the_writer_priority_comes_from_the_environment_and_a_bad_value_is_named(tmp_path, monkeypatch):
    stashpoint.shutdown()  # the next save starts a writer process with this environment
    monkeypatch.setenv("STASHPOINT_WRITER_NICE", "5")
    try:
        stashpoint.save({"x": torch.ones(3)}, tmp_path / "a", writer="process")
        pid = _writerproc.current_pid()
        assert pid is not None
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0) + 5
        stashpoint.shutdown()
        assert gone_within(pid, 5.0), "shutdown() stops the writer process"
        monkeypatch.setenv("STASHPOINT_WRITER_NICE", "low")
        with pytest.raises(stashpoint.CheckpointError, match="STASHPOINT_WRITER_NICE='low' must be a whole number"):
            stashpoint.save({"x": torch.ones(3)}, tmp_path / "b", writer="process")
        assert not (tmp_path / "b" / MANIFEST_NAME).exists()
    finally:
        stashpoint.shutdown()


def test_a_trimmed_staging_buffer_stays_trimmed_when_a_writer_process_maps_it(tmp_path):
    """A buffer reused for a smaller layout gives its tail back (``SharedRegion.trim``); a writer
    process that maps it afterwards must not populate that tail again (it would allocate it)."""
    stashpoint.save({"w": torch.randn(16 * MiB)}, tmp_path / "a", writer="thread")  # 64 MiB, never sent
    engine = _save.current_engine()
    assert engine is not None
    region = engine.pool._free[-1].region
    assert region is not None and os.fstat(region.fd).st_blocks * 512 >= 64 * MiB
    small = {"w": torch.randn(4 * MiB)}  # 16 MiB: the same touched buffer, its tail given back
    stats = stashpoint.save(small, tmp_path / "b", writer="process")
    assert stats.writer == "process" and engine.pool._free[-1].region is region
    assert region.resident < 20 * MiB
    assert os.fstat(region.fd).st_blocks * 512 < 20 * MiB, "the writer process did not bring the tail back"
    back = {"w": torch.zeros(4 * MiB)}
    stashpoint.load(back, tmp_path / "b")
    assert torch.equal(back["w"], small["w"])


def _strace_works() -> bool:
    import shutil
    import subprocess

    return shutil.which("strace") is not None and (
        subprocess.run(["strace", "-o", os.devnull, "true"], capture_output=True, check=False).returncode == 0
    )


@pytest.mark.skipif(not _strace_works(), reason="needs strace, allowed to trace (ptrace)")
def test_the_writer_process_syncs_every_shard_before_the_commit(tmp_path):
    """save() returns once the checkpoint is durable with either writer: the ordering test
    watches the thread writer's fsyncs in this process; the writer process's own are seen by
    strace, following the child (-f)."""
    import subprocess
    import sys

    from conftest import ROOT

    code = (
        "import sys, torch, stashpoint\n"
        "stashpoint.save({'w': torch.randn(300_000), 'b': torch.ones(3)}, sys.argv[1], writer='process',"
        " max_shard_bytes=600_000)\n"
    )
    trace = tmp_path / "trace.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = ["strace", "-f", "-qq", "-y", "-e", "trace=fsync,fdatasync", "-o", str(trace), sys.executable, "-c", code]
    subprocess.run([*cmd, str(tmp_path / "ck")], env=env, check=True, timeout=120)
    synced = trace.read_text()
    shards = sorted(p.name for p in (tmp_path / "ck").glob("shard-*"))
    assert len(shards) == 2 and all(f"/{name}>" in synced for name in shards), synced
