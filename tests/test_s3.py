"""stashpoint on s3:// paths, end to end, against a real SeaweedFS server (tests/s3_server.py).

The session server (``s3_env``/``s3_url`` fixtures) serves the ordinary tests; tests that stop or
kill the server get one of their own (``s3_own_server``).
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import stashpoint
from conftest import ROOT, S3_BUCKET, small_model, train_steps
from dist_util import run_world
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._storage import storage_for
from stashpoint._storage.s3 import S3Storage
from stashpoint._storage.s3config import S3Options
from stashpoint.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError, S3Error

S3_WORKER = Path(__file__).with_name("s3_worker.py")


def _trained(seed: int = 0) -> dict:
    model = small_model(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optim, 3)
    return {"model": model, "optim": optim, "step": 3, "note": "s3"}


def _fresh(seed: int = 42) -> dict:
    model = small_model(seed)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2), "step": 0, "note": ""}


def _same(a: dict, b: dict) -> bool:
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    oa, ob = a["optim"].state_dict()["state"], b["optim"].state_dict()["state"]
    return (
        all(torch.equal(sa[k], sb[k]) for k in sa)
        and oa.keys() == ob.keys()
        and all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])
    )


def _uploads(server) -> list[dict]:
    return server.client().list_multipart_uploads(Bucket=S3_BUCKET).get("Uploads", [])


def test_save_async_save_load_and_verify_on_s3(s3_url):
    state = _trained()
    stats = stashpoint.save(state, f"{s3_url}/a")
    assert stats.bytes_written > 0 and stats.path == f"{s3_url}/a"
    back = _fresh()
    stashpoint.load(back, f"{s3_url}/a")
    assert _same(state, back) and back["step"] == 3 and back["note"] == "s3"

    handle = stashpoint.async_save(state, f"{s3_url}/b")
    handle.wait()
    back = _fresh()
    stashpoint.load(back, f"{s3_url}/b")
    assert _same(state, back)
    report = stashpoint.verify(f"{s3_url}/b")
    assert report.ok and not report.problems and report.bytes_checked > 0

    with pytest.raises(CheckpointError, match="overwrite=True"):
        stashpoint.save(state, f"{s3_url}/b")
    state["step"] = 4
    stashpoint.save(state, f"{s3_url}/b", overwrite=True)
    back = _fresh()
    stashpoint.load(back, f"{s3_url}/b")
    assert back["step"] == 4
    assert sum(n.startswith("shard-") for n in storage_for(f"{s3_url}/b").list()) == 1, "old shards deleted"


def test_large_state_uses_multipart_and_parallel_ranged_reads(s3_env, s3_url, monkeypatch):
    monkeypatch.setenv("STASHPOINT_S3_PART_MB", "5")
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(3_000_000, generator=g) for i in range(4)}  # 48 MB: 10 parts
    stashpoint.save(state, s3_url)
    assert _uploads(s3_env) == [], "every multipart upload completed"
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    stashpoint.load(back, s3_url)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_a_damaged_object_is_detected_on_load_and_by_verify(s3_env, s3_url):
    state = _trained()
    stashpoint.save(state, s3_url)
    st = storage_for(s3_url)
    shard = next(n for n in st.list() if n.startswith("shard-"))
    data = bytearray(st.read(shard))
    data[-10] ^= 0xFF  # a flipped bit in the tensor bytes, same size
    s3_env.client().put_object(Bucket=S3_BUCKET, Key=st.key(shard), Body=bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        stashpoint.load(_fresh(), s3_url)
    report = stashpoint.verify(s3_url)
    assert not report.ok and any("checksum mismatch" in p for p in report.problems)


def test_an_uncommitted_prefix_is_incomplete_and_a_missing_one_not_found(s3_url):
    st = storage_for(s3_url)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        stashpoint.load(_fresh(), s3_url)
    st.prepare()
    w = st.open_writer("shard-r00000-0000-00000000.safetensors", 3)
    w.write(b"abc")
    w.close()
    with pytest.raises(IncompleteCheckpointError, match="no committed checkpoint"):
        stashpoint.load(_fresh(), s3_url)


def test_two_ranks_save_on_s3_and_load_on_one_and_on_two_resharded(s3_url, tmp_path, monkeypatch, caplog):
    expected_path = tmp_path / "expected.pt"
    monkeypatch.setenv("STASHPOINT_RANKS_PER_DIR", "1")  # each rank's files under a prefix of its own
    saved = run_world(2, "save", s3_url, str(expected_path), worker=S3_WORKER)
    assert all(r["bytes"] > 0 for r in saved), "both ranks wrote shards"
    names = storage_for(s3_url).list()
    assert {n.partition("/")[0] for n in names} == {"g00000", "g00001", "manifest.json"}, names
    # 2 -> 1: a plain model, optimizer and the whole of the sharded tensor in this process
    expected = torch.load(expected_path, weights_only=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim, "sharded": torch.zeros(13, 7), "step": 0}
    with caplog.at_level(logging.INFO, logger="stashpoint"):
        stashpoint.load(state, s3_url)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "is loaded by 1" in r.getMessage()]
    assert said and all(level == logging.INFO for level, _ in said), "an evaluation's load is no warning"
    assert all(torch.equal(v, expected["model"][k]) for k, v in model.state_dict().items())
    want = expected["optim"]["state"]
    got = optim.state_dict()["state"]
    assert all(torch.equal(got[i][k], want[i][k]) for i in want for k in want[i])
    assert torch.equal(state["sharded"], torch.randn(13, 7, generator=torch.Generator().manual_seed(5)))
    assert state["step"] == 7
    # 2 -> 2 with another sharding: each rank reads the byte ranges of its columns
    loaded = run_world(2, "load", s3_url, str(expected_path), worker=S3_WORKER)
    assert all(r["same_model"] and r["same_shard"] and r["step"] == 7 for r in loaded), loaded


def test_wrong_credentials_missing_bucket_and_unreachable_server_fail_clearly(s3_url, monkeypatch):
    stashpoint.save(_trained(), s3_url)
    with monkeypatch.context() as m:
        m.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        with pytest.raises(CheckpointError, match="AWS_SECRET_ACCESS_KEY") as e:
            stashpoint.save(_trained(), f"{s3_url}-other")
        assert "refused" in str(e.value) and s3_url.split("/")[2] in str(e.value)
        with pytest.raises(S3Error, match=r"SignatureDoesNotMatch|HTTP 403|refused"):
            stashpoint.load(_fresh(), s3_url)
    with pytest.raises(CheckpointError, match=r"bucket 'no-such-bucket' does not exist.*AWS_ENDPOINT_URL"):
        stashpoint.save(_trained(), "s3://no-such-bucket/x")
    with pytest.raises(CheckpointError, match=r"bucket 'no-such-bucket' does not exist"):
        stashpoint.load(_fresh(), "s3://no-such-bucket/x")
    from dist_util import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("STASHPOINT_S3_RETRY_SECONDS", "1")
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"AWS_ENDPOINT_URL"):
        stashpoint.load(_fresh(), s3_url)
    assert time.monotonic() - t0 < 30, "the retry budget bounds the wait"


def test_storage_url_round_trips_and_pickles(s3_url):
    st = storage_for(f"{s3_url}/step-1/")
    assert isinstance(st, S3Storage) and st.location == f"{s3_url}/step-1"
    assert storage_for(st.location) == st and pickle.loads(pickle.dumps(st)) == st
    assert st.child("sub").location == f"{s3_url}/step-1/sub"
    with pytest.raises(ValueError, match="valid bucket name"):
        storage_for("s3://B/x")
    with pytest.raises(ValueError, match=r"backslash, which S3-compatible servers read differently"):
        storage_for(f"{s3_url}/back\\slash")  # before: a manager's steps there were never listed again
    with pytest.raises(ValueError, match="STASHPOINT_S3_PART_MB"):
        import os

        os.environ["STASHPOINT_S3_PART_MB"] = "1"
        try:
            storage_for(s3_url)
        finally:
            del os.environ["STASHPOINT_S3_PART_MB"]
    with pytest.raises(ValueError, match="5 MiB"):
        S3Options(part_size=1024)


def _read_in_child(url: str, q) -> None:
    try:
        storage_for(url).read(MANIFEST_NAME)
        q.put("read")
    except S3Error as e:
        q.put(str(e))


def test_a_child_forked_after_s3_use_gets_a_clear_error_not_a_hang(s3_url):
    import multiprocessing as mp

    stashpoint.save(_trained(), s3_url)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_read_in_child, args=(s3_url, q))
    p.start()
    try:
        msg = q.get(timeout=60)
    finally:
        p.join(10)
        p.kill()
    assert "forked" in msg and "spawn" in msg, msg
    assert storage_for(s3_url).exists(MANIFEST_NAME), "the parent goes on working"


def test_without_the_s3_extra_import_works_and_s3_paths_name_the_extra(tmp_path):
    code = (
        "import sys; sys.modules['obstore'] = None; sys.modules['boto3'] = None\n"
        "import torch, stashpoint\n"
        f"stashpoint.save({{'x': torch.ones(2)}}, {str(tmp_path / 'ck')!r})\n"
        "try:\n"
        "    stashpoint.save({'x': torch.ones(2)}, 's3://bucket/x')\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "pip install 'stashpoint[s3]'" in out.stdout and "obstore" in out.stdout


# ---------------------------------------------------------------------------------------------
# Faults: the server goes away in the middle of an upload (a server of the test's own)


def _big_state(mb: int) -> dict:
    g = torch.Generator().manual_seed(3)
    return {f"w{i}": torch.randn(1_000_000, generator=g) for i in range(mb // 4)}


def _wait_for_upload(server, handle, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not _uploads(server):
        assert not handle.done(), "the save finished before any multipart upload was seen; make the state bigger"
        assert time.monotonic() < deadline, "no multipart upload started"
        time.sleep(0.02)


def test_server_killed_mid_upload_fails_clearly_commits_nothing_and_cleans_up(s3_own_server, monkeypatch):
    server = s3_own_server
    base = f"s3://{S3_BUCKET}/run"
    earlier = _trained()
    stashpoint.save(earlier, f"{base}/step-1")
    monkeypatch.setenv("STASHPOINT_S3_PART_MB", "5")
    monkeypatch.setenv("STASHPOINT_S3_CONCURRENCY", "1")
    monkeypatch.setenv("STASHPOINT_S3_RETRY_SECONDS", "1")
    handle = stashpoint.async_save(_big_state(160), f"{base}/step-2")
    _wait_for_upload(server, handle)
    server.kill()
    with pytest.raises(CheckpointError) as e:
        handle.wait(timeout=120)
    msg = str(e.value)
    assert "Nothing was committed" in msg and server.endpoint in msg and "STASHPOINT_S3_RETRY_SECONDS" in msg, msg
    server.start()  # same ports, same data
    assert not storage_for(f"{base}/step-2").exists(MANIFEST_NAME)
    with pytest.raises(CheckpointError, match=r"no checkpoint at|no committed checkpoint"):
        stashpoint.load(_fresh(), f"{base}/step-2")
    # the abort could not reach the dead server: the next save's prepare() aborts the upload
    stashpoint.save(_trained(), f"{base}/step-3")
    assert _uploads(server) == [], "no multipart upload left behind"
    back = _fresh()
    stashpoint.load(back, f"{base}/step-1")
    assert _same(earlier, back), "the earlier checkpoint is intact"


def test_a_managers_save_on_a_stopped_server_returns_within_seconds_and_fails_through_its_handle(
    s3_own_server, monkeypatch, caplog
):
    """Before: maybe_save asked whether the step held a checkpoint with the whole retry budget
    (90 s here, STASHPOINT_S3_RETRY_SECONDS) and then raised from the call, into the training
    loop: the quick limits were used only for the checks after it."""
    monkeypatch.setenv("STASHPOINT_S3_RETRY_SECONDS", "40")
    manager = stashpoint.CheckpointManager(f"s3://{S3_BUCKET}/down", every_steps=1)
    state = {"w": torch.ones(1024), "step": 1}
    manager.maybe_save(1, state).wait()
    s3_own_server.kill()
    t0 = time.monotonic()
    handle = manager.maybe_save(2, state)  # returns: training goes on
    took = time.monotonic() - t0
    assert took < 15, f"maybe_save blocked {took:.1f} s on a stopped server"
    with pytest.raises(CheckpointError):
        handle.wait(timeout=120)
    assert "exception calling callback" not in caplog.text  # the failed step's clean-up could not ask either
    s3_own_server.start()
    manager.maybe_save(3, state).wait()
    assert manager.steps() == [1, 3]
    manager.close()


def test_an_outage_shorter_than_the_retry_budget_is_ridden_out(s3_own_server, monkeypatch):
    server = s3_own_server
    url = f"s3://{S3_BUCKET}/outage"
    monkeypatch.setenv("STASHPOINT_S3_PART_MB", "5")
    monkeypatch.setenv("STASHPOINT_S3_CONCURRENCY", "1")
    monkeypatch.setenv("STASHPOINT_S3_RETRY_SECONDS", "60")
    state = _big_state(160)
    handle = stashpoint.async_save(state, url)
    _wait_for_upload(server, handle)
    server.kill()
    time.sleep(1.0)
    server.start()
    assert not handle.done(), "the outage did not hit the upload; make the state bigger"
    handle.wait(timeout=120)
    assert _uploads(server) == []
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    stashpoint.load(back, url)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_the_bucket_is_checked_once_per_process_not_on_every_save(s3_url):
    """At 16,384 ranks a HeadBucket per rank per save is 16,384 requests a save."""
    st = storage_for(f"{s3_url}/once-0")
    assert isinstance(st, S3Storage)
    client = st.client()
    client.checked.clear()  # as in a process that has not saved yet
    asked = []
    client.control.meta.events.register("before-call.s3.HeadBucket", lambda **kw: asked.append(1))
    for i in range(3):
        stashpoint.save({"w": torch.full((8,), float(i))}, f"{s3_url}/once-{i}")
        assert storage_for(f"{s3_url}/once-{i}").client() is client
    assert len(asked) == 1, f"HeadBucket asked {len(asked)} times for 3 saves"
    out = {"w": torch.zeros(8)}
    stashpoint.load(out, f"{s3_url}/once-2")
    assert out["w"][0] == 2.0
