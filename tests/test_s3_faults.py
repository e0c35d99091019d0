"""S3 answering the way a cluster's object store does on a bad day: a 404 from a lagging node,
a body changed on the way, a lost reply, a stalled server, pages that never end. A real
SeaweedFS server behind a fault-injecting proxy (``s3_faults.FaultProxy``)."""

from __future__ import annotations

import time

import pytest
import torch

import stashpoint
from s3_faults import FaultProxy
from stashpoint._storage import storage_for
from stashpoint._storage.s3 import S3Storage
from stashpoint._storage.s3tree import delete_batch
from stashpoint.errors import CheckpointError, S3Error


@pytest.fixture
def proxy(s3_env, monkeypatch):
    """The session's server behind a fault proxy, with a short retry budget and timeout."""
    p = FaultProxy(s3_env.ports["s3"]).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    monkeypatch.setenv("STASHPOINT_S3_RETRY_SECONDS", "3")
    monkeypatch.setenv("STASHPOINT_S3_TIMEOUT_SECONDS", "3")
    yield p
    p.stop()


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 256, generator=g), "step": seed}


def _equal(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and a["step"] == b["step"]


def test_one_404_at_a_managers_open_does_not_delete_a_committed_step(proxy, s3_url):
    with stashpoint.CheckpointManager(s3_url) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    proxy.set([{"match": r"^HEAD .*/step-00000002/manifest\.json$", "action": "status", "status": 404, "times": 1}])
    with stashpoint.CheckpointManager(s3_url) as mgr:  # its clean-up asks each step for its manifest
        assert proxy.requests("step-00000002/manifest")[0][1] == "status"
        assert mgr.steps() == [1, 2]
    proxy.set([])
    with stashpoint.CheckpointManager(s3_url) as mgr:
        got = _state(0)
        assert mgr.restore(got) == 2 and _equal(got, _state(2))


@pytest.mark.parametrize("fault", [{"action": "status", "status": 404, "code": "NoSuchKey"}, {"action": "corrupt"}])
def test_one_bad_answer_at_a_restore_is_read_again_not_taken_for_damage(proxy, s3_url, fault):
    with stashpoint.CheckpointManager(s3_url) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    proxy.set([{"match": r"^GET .*/step-00000002/shard-", **fault, "at": 3000, "times": 1}])
    with stashpoint.CheckpointManager(s3_url) as mgr:
        got = _state(0)
        assert mgr.restore(got) == 2 and _equal(got, _state(2))
        assert next(a for _, a, _ in proxy.requests(r"^GET .*step-00000002/shard-")) == fault["action"]
        assert mgr.steps() == [1, 2]  # nothing set aside


def test_a_step_damaged_for_good_is_still_passed_by_and_set_aside(proxy, s3_url):
    with stashpoint.CheckpointManager(s3_url) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    proxy.set([{"match": r"^GET .*/step-00000002/shard-", "action": "corrupt", "at": 3000}])
    with stashpoint.CheckpointManager(s3_url) as mgr:
        got = _state(0)
        assert mgr.restore(got) == 1 and _equal(got, _state(1))
        assert mgr.steps() == [1]


def test_a_listing_of_endless_empty_pages_fails_within_bounds(proxy, s3_url):
    stashpoint.save(_state(1), s3_url + "/step-00000001")
    proxy.set([{"match": r"list-type=2", "action": "list_empty_pages"}])
    with pytest.raises(S3Error, match="empty pages in a row"):
        storage_for(s3_url).children()
    assert len(proxy.requests("list-type=2")) <= 1002


def test_a_stalled_control_request_is_sent_once_not_retried_by_botocore_too(proxy, s3_url, monkeypatch):
    monkeypatch.setenv("STASHPOINT_S3_RETRY_SECONDS", "1")
    monkeypatch.setenv("STASHPOINT_S3_TIMEOUT_SECONDS", "2")
    proxy.set([{"match": r"^HEAD /stashpoint-test$", "action": "stall"}])  # HeadBucket
    with pytest.raises(S3Error):
        S3Storage(s3_url).prepare()
    # botocore's own retries sent it 4 times, each waiting the whole timeout
    assert len(proxy.requests(r"^HEAD /stashpoint-test$")) == 1


@pytest.mark.parametrize("action", ["lost_reply", "forward_then_status", "reset"])
def test_a_commit_whose_reply_is_lost_or_whose_connection_breaks_commits(proxy, s3_url, action):
    proxy.set([{"match": r"^PUT .*/manifest\.json", "action": action, "times": 1}])
    stashpoint.save(_state(3), s3_url)  # no error: the manifest there is this save's
    assert next(a for _, a, _ in proxy.requests(r"^PUT .*/manifest\.json")) == action
    assert _equal(stashpoint.read(s3_url), _state(3))


def test_a_commit_over_another_saves_manifest_is_still_refused(proxy, s3_url):
    stashpoint.save(_state(1), s3_url)
    proxy.set([{"match": r"^HEAD .*/manifest\.json", "action": "status", "status": 404, "times": 1}])
    with pytest.raises(CheckpointError, match="overwrite=True"):  # the early check missed it; the commit did not
        stashpoint.save(_state(2), s3_url)
    assert _equal(stashpoint.read(s3_url), _state(1))


def test_a_delete_refused_for_some_keys_alone_is_sent_again(proxy, s3_url):
    store = S3Storage(s3_url)
    store.commit("a", b"1")
    store.commit("b", b"2")
    proxy.set([{"match": r"^POST .*\?delete", "action": "delete_errors", "code": "SlowDown", "times": 1}])
    c = store.client()
    delete_batch(c.control, store.bucket, [store.key("a"), store.key("b")], 3.0)
    assert [a for _, a, _ in proxy.requests(r"\?delete")] == ["delete_errors", "pass"]
    assert store.list() == []


def test_a_save_call_does_not_wait_out_a_stalled_server(proxy, s3_url, monkeypatch):
    monkeypatch.setenv("STASHPOINT_S3_TIMEOUT_SECONDS", "60")
    proxy.set([{"match": r"^HEAD .*/manifest\.json", "action": "stall", "times": 1}])
    t = time.monotonic()
    handle = stashpoint.async_save(_state(4), s3_url)
    blocked = time.monotonic() - t
    handle.wait()  # the early check gave no answer: the exclusive commit decided
    assert blocked < 30, f"the call waited {blocked:.0f} s for a stalled server (its timeout is 60 s)"
    assert _equal(stashpoint.read(s3_url), _state(4))


def test_uploads_queued_behind_a_failed_one_ask_the_server_first(proxy, s3_url, tmp_path, monkeypatch):
    monkeypatch.setenv("STASHPOINT_S3_RETRY_SECONDS", "1")
    monkeypatch.setenv("STASHPOINT_S3_TIMEOUT_SECONDS", "2")
    mgr = stashpoint.CheckpointManager(tmp_path / "run", remote_root=s3_url)
    proxy.set([{"match": "", "action": "stall"}])
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    with pytest.raises(CheckpointError):
        mgr.close()
    # the first upload tried its files; the two after it asked the server once each (a
    # listing of the run, within the short limits of a clean-up) and failed at once: none
    # waited out the timeout on a request of its own step
    assert proxy.requests(r"step-0000000[23]/") == []
    assert len(proxy.requests(r"^GET .*list-type=2.*delimiter")) >= 2
    assert mgr.steps() == [1, 2, 3]  # kept for the next manager to upload
    proxy.set([])
    with stashpoint.CheckpointManager(tmp_path / "run", remote_root=s3_url) as again:
        again.wait()
        assert again.remote_steps() == [1, 2, 3]


def test_a_commit_refused_for_good_is_not_sent_again(proxy, s3_url):
    proxy.set([{"match": r"^PUT .*/manifest\.json", "action": "status", "status": 400, "code": "InvalidArgument"}])
    with pytest.raises(CheckpointError, match=r"InvalidArgument|400"):
        stashpoint.save(_state(5), s3_url)
    assert len(proxy.requests(r"^PUT .*/manifest\.json")) == 1


def test_a_managers_save_asks_a_stalled_server_within_short_limits(proxy, s3_url, monkeypatch):
    monkeypatch.setenv("STASHPOINT_S3_TIMEOUT_SECONDS", "60")
    mgr = stashpoint.CheckpointManager(s3_url)
    mgr.save(1, _state(1)).wait()
    proxy.set([{"match": r"prefix=.*step-00000002", "action": "stall"}])  # listings of the new step's prefix
    t = time.monotonic()
    handle = mgr.save(2, _state(2))  # returns: the storage's failure comes through the handle, training goes on
    assert time.monotonic() - t < 30  # the short limits (10 s a request), not the 60 s timeout
    with pytest.raises(CheckpointError, match="could not tell what"):
        handle.wait()
    proxy.set([])
    mgr.save(3, _state(3)).wait()
    mgr.close()
    assert stashpoint.CheckpointManager(s3_url).steps() == [1, 3]


def test_a_save_of_a_step_already_there_is_refused_when_its_head_lags(proxy, s3_url):
    """Every HEAD of the step's manifest says 404 (a lagging store): the owner's listing finds it,
    and the save is refused as one of a step already there, not moved aside as a rewind."""
    mgr = stashpoint.CheckpointManager(s3_url)
    mgr.save(1, _state(1)).wait()
    proxy.set([{"match": r"^HEAD .*/step-00000001/manifest\.json$", "action": "status", "status": 404}])
    with pytest.raises(CheckpointError, match="step 1 already has a committed checkpoint"):
        mgr.save(1, _state(2)).wait()
    proxy.set([])
    assert storage_for(s3_url).children() == ["step-00000001"]
    mgr.save(2, _state(2)).wait()  # the next save goes on
    mgr.close()
    got = _state(0)
    with stashpoint.CheckpointManager(s3_url) as again:
        assert again.steps() == [1, 2] and again.restore(got, step=1) == 1 and _equal(got, _state(1))


def test_open_uploads_are_listed_page_by_page_without_an_empty_marker():
    """A page may give the next key marker and no upload id marker: botocore refuses a None."""
    from stashpoint._storage.s3list import list_uploads

    class Pages:  # the pagination of ListMultipartUploads alone, as S3 answers it
        def __init__(self):
            self.asked = []

        def list_multipart_uploads(self, **request):
            self.asked.append(request)
            if len(self.asked) == 1:
                return {"Uploads": [{"Key": "p/a", "UploadId": "1"}], "IsTruncated": True, "NextKeyMarker": "p/a"}
            return {"Uploads": [{"Key": "p/b", "UploadId": "2"}], "IsTruncated": False}

    control = Pages()
    assert list_uploads(control, "b", "p/", retry_seconds=1) == [("p/a", "1"), ("p/b", "2")]
    assert control.asked[1] == {"Bucket": "b", "Prefix": "p/", "KeyMarker": "p/a"}


def test_a_failed_upload_is_retried_after_an_outage_that_took_writes_only(proxy, s3_url, tmp_path):
    """A full bucket: listings answer, every PUT fails, for four saves. Each failing upload
    used up a retry of the steps failed before it (counted as listed, never run): step 2 was
    said "tried no more" untried and stayed on the local tier for the run."""
    with stashpoint.CheckpointManager(tmp_path / "nvme", keep_last=1, remote_root=s3_url) as mgr:
        mgr.save(1, _state(1)).wait()
        mgr.wait()
        proxy.set([{"match": r"^PUT .*/shard-", "action": "status", "status": 500}])
        for step in (2, 3, 4, 5):
            mgr.save(step, _state(step)).wait()
            with pytest.raises(CheckpointError, match=f"uploading step {step}"):
                mgr.wait()
        proxy.set([])
        mgr.save(6, _state(6)).wait()
        mgr.wait()
        assert mgr.remote_steps() == [1, 2, 3, 4, 5, 6] and mgr.steps() == [6]


def test_an_upload_that_fails_while_its_clean_up_fails_too_says_the_upload_failed(proxy, s3_url, tmp_path):
    """Before, the check after a failed upload (is the manifest there?) raised its own S3 error,
    which replaced the upload's: a manifest read failing, no step, no word of the local copy."""
    with stashpoint.CheckpointManager(tmp_path / "nvme", keep_last=1, remote_root=s3_url) as mgr:
        mgr.save(1, _state(1)).wait()
        mgr.wait()
        head = r"^HEAD .*step-00000002/manifest"
        proxy.set(
            [
                {"match": head, "action": "pass", "times": 1},
                {"match": head, "action": "status", "status": 503},
                {"match": r"^PUT .*step-00000002/", "action": "status", "status": 500},
            ]
        )
        mgr.save(2, _state(2)).wait()
        with pytest.raises(CheckpointError, match=r"uploading step 2 .* failed: .*local copy .* is kept"):
            mgr.wait()
        proxy.set([])
        mgr.save(3, _state(3)).wait()
        mgr.wait()
        assert mgr.remote_steps() == [1, 2, 3]
