"""An S3 endpoint that misbehaves: reads and listings stay bounded and fail with a CheckpointError.

SeaweedFS (the other S3 tests' server) cannot be made to misbehave, so these tests run a small
HTTP server of their own that answers as a broken or hostile endpoint would: a ranged GET whose
body runs far past the range, and ListObjectsV2 pages that never end. A key that S3 allows and
obstore cannot address is tested on the real server.
"""

from __future__ import annotations

import re
import resource
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import boto3
import pytest
import torch

import stashpoint
from conftest import S3_BUCKET
from stashpoint._storage.s3 import S3Storage
from stashpoint.errors import CheckpointError

_BODY = b"x" * 100


class _Hostile(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    mode = "big_body"
    requests = 0
    signed: list[bool]
    deleted: list[str]

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:  # the bucket exists
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:  # DeleteObjects: the keys asked for, recorded
        body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
        keys = re.findall(r"<Key>(.*?)</Key>", body)
        type(self).deleted += keys
        done = "".join(f"<Deleted><Key>{k}</Key></Deleted>" for k in keys)
        self._xml_reply(f'<DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{done}</DeleteResult>')

    def do_GET(self) -> None:
        type(self).requests += 1
        query = parse_qs(urlsplit(self.path).query)
        if "list-type" in query:
            return self._page(query.get("prefix", [""])[0])
        start, _, end = self.headers.get("Range", "bytes=0-").split("=")[1].partition("-")
        last = min(int(end or len(_BODY) - 1), len(_BODY) - 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{last}/{len(_BODY)}")  # as asked
        self.send_header("Content-Length", str(1 << 30))  # the range says 100 bytes; 1 GiB follows
        self.send_header("ETag", '"e"')
        self.send_header("Last-Modified", "Mon, 01 Jan 2024 00:00:00 GMT")
        self.end_headers()
        try:
            for _ in range(1024):
                self.wfile.write(b"y" * (1 << 20))
        except OSError:
            pass  # the client hung up: what it should do

    def _page(self, prefix: str) -> None:
        type(self).signed.append("Authorization" in self.headers)
        if self.mode == "one_step":
            return self._xml(
                f"<Prefix>{prefix}</Prefix><KeyCount>1</KeyCount><IsTruncated>false</IsTruncated>"
                f"<CommonPrefixes><Prefix>{prefix}step-00000001/</Prefix></CommonPrefixes>"
            )
        if self.mode == "outside_prefix":  # a server (or proxy) that ignores the Prefix
            return self._xml(
                f"<Prefix>{prefix}</Prefix><KeyCount>2</KeyCount><IsTruncated>false</IsTruncated>"
                + "".join(
                    f'<Contents><Key>{k}</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified><ETag>"e"</ETag>'
                    "<Size>1</Size></Contents>"
                    for k in (f"{prefix}shard-r00000-0000-a.safetensors", "other-team/model/manifest.json")
                )
            )
        n = type(self).requests
        if self.mode in ("long_key", "many_names"):  # names of 2,000 bytes, or pages of 1,000 fresh 1,000-byte ones
            size, count = (2000, 1) if self.mode == "long_key" else (1000 - len(prefix), 1000)
            return self._xml(
                f"<Prefix>{prefix}</Prefix><KeyCount>{count}</KeyCount><IsTruncated>true</IsTruncated>"
                f"<NextContinuationToken>t{n}</NextContinuationToken>"
                + "".join(
                    f"<Contents><Key>{prefix}{n}-{i}-{'k' * size}</Key><Size>1</Size></Contents>" for i in range(count)
                )
            )
        token = "same" if self.mode == "same_token" else f"t{n}"
        key = "obj" if self.mode == "same_token" else "repeated"
        self._xml(
            f"<Prefix>{prefix}</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
            f"<IsTruncated>true</IsTruncated><NextContinuationToken>{token}</NextContinuationToken>"
            f"<Contents><Key>{prefix}{key}{n if self.mode == 'same_token' else ''}</Key>"
            '<LastModified>2024-01-01T00:00:00.000Z</LastModified><ETag>"e"</ETag><Size>1</Size></Contents>'
        )

    def _xml(self, inner: str) -> None:
        self._xml_reply(f"<ListBucketResult><Name>b</Name>{inner}</ListBucketResult>")

    def _xml_reply(self, doc: str) -> None:
        body = f'<?xml version="1.0" encoding="UTF-8"?>{doc}'.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def hostile(monkeypatch) -> Iterator[type[_Hostile]]:
    handler = type("Handler", (_Hostile,), {"signed": [], "deleted": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for name, value in {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_address[1]}",
        "AWS_ACCESS_KEY_ID": "id",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_REGION": "us-east-1",
        "STASHPOINT_S3_RETRY_SECONDS": "2",
    }.items():
        monkeypatch.setenv(name, value)
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()


def test_a_body_longer_than_its_range_is_refused_without_holding_it(hostile):
    store = S3Storage("s3://bucket/ck")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(
        CheckpointError,
        match=r"sent more than the 100 bytes asked for.*manifest\.json|manifest\.json.*more than the 100",
    ):
        store.read("manifest.json", 0, 100)
    with pytest.raises(CheckpointError, match="more than the 64 bytes"):
        store.readv("manifest.json", 0, [memoryview(bytearray(64))])
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200, f"reading 100 bytes from a 1 GiB body grew the process by {grown_mib:.0f} MiB"


@pytest.mark.parametrize("mode", ["same_token", "repeated_key"])
def test_a_listing_that_never_ends_fails_in_bounded_time(hostile, mode):
    hostile.mode = mode
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"s3://bucket/run/.*would not end"):
        S3Storage("s3://bucket/run").children()
    with pytest.raises(CheckpointError, match="would not end"):
        stashpoint.CheckpointManager("s3://bucket/run").restore({"w": torch.zeros(2)})
    assert time.monotonic() - t0 < 30 and hostile.requests < 50


def test_a_listing_holds_at_most_s3s_names_and_a_bounded_total(hostile, monkeypatch):
    """Before: a server sending fresh pages of long names grew the listing by 13 MB/s until
    ten million entries (about 10 GB of names at S3's 1 KiB each, unbounded past it)."""
    from stashpoint._storage import s3list

    hostile.mode = "long_key"
    with pytest.raises(CheckpointError, match=r"s3://bucket/run/: the server listed a name of 2,0\d\d bytes"):
        S3Storage("s3://bucket/run").children()
    monkeypatch.setattr(s3list, "MAX_LISTED_BYTES", 8 << 20)  # 512 MiB by default: seconds of pages here
    hostile.mode, hostile.requests = "many_names", 0
    with pytest.raises(CheckpointError, match=r"more than 8 MiB of names"):
        S3Storage("s3://bucket/run").children()
    assert 8 <= hostile.requests <= 10, hostile.requests


def test_a_foreign_key_obstore_cannot_address_leaves_the_run_usable(s3_env, s3_url):
    """A key with a control character, written beside the steps by another tool (legal in S3;
    obstore refused the whole listing over it)."""
    with stashpoint.CheckpointManager(s3_url) as manager:
        manager.save(1, {"w": torch.ones(4)})
    bucket, prefix = s3_url[len("s3://") :].split("/", 1)
    client = boto3.client("s3", endpoint_url=s3_env.endpoint, region_name="us-east-1")
    client.put_object(Bucket=bucket, Key=f"{prefix}/notes\x7f.txt", Body=b"x")
    client.put_object(Bucket=bucket, Key=f"{prefix}/tmp\x01dir/x", Body=b"x")  # a "directory" beside the steps
    state = {"w": torch.zeros(4)}
    with stashpoint.CheckpointManager(s3_url) as manager:
        assert manager.restore(state) == 1
        manager.save(2, {"w": torch.ones(4)})
    assert torch.equal(state["w"], torch.ones(4))
    assert bucket == S3_BUCKET


@pytest.mark.parametrize("url", ["s3://bucket/a/../b", "s3://bucket/./c", "s3://bucket/a\tb"])
def test_a_prefix_the_client_cannot_address_is_refused_naming_it(url):
    with pytest.raises(ValueError, match="rename it"):
        S3Storage(url)


def test_listing_a_whole_bucket_on_a_server_that_is_down_raises_a_checkpoint_error(monkeypatch):
    from dist_util import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("STASHPOINT_S3_RETRY_SECONDS", "1")
    with pytest.raises(CheckpointError, match="AWS_ENDPOINT_URL"):
        S3Storage("s3://bucket")._all_keys()


def test_a_read_capped_far_above_the_object_holds_only_the_object(s3_url):
    """A manifest is read with its cap (256 MiB) as the length: memory for what the server sends."""
    import tracemalloc

    stashpoint.save({"w": torch.ones(4)}, s3_url)
    store = S3Storage(s3_url)
    tracemalloc.start()
    try:
        data = store.read("manifest.json", 0, 256 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert data == store.read("manifest.json") and len(data) < 64 << 10
    assert peak < 16 << 20, f"a {len(data)}-byte read peaked at {peak >> 20} MiB"


def test_a_public_bucket_is_listed_without_credentials(hostile, monkeypatch, tmp_path):
    """No credentials anywhere: the data client sends unsigned requests, and so must the listing."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    hostile.mode = "one_step"
    assert S3Storage("s3://public/run").children() == ["step-00000001"]
    assert hostile.signed == [False]


def test_a_step_holding_a_key_obstore_cannot_address_is_moved_and_removed(s3_env, s3_url):
    """Retention and moving a step aside delete and copy every key, another tool's included."""
    bucket, prefix = s3_url[len("s3://") :].split("/", 1)
    client = boto3.client("s3", endpoint_url=s3_env.endpoint, region_name="us-east-1")
    with stashpoint.CheckpointManager(s3_url, keep_last=1) as manager:
        manager.save(1, {"w": torch.ones(4)})
        client.put_object(Bucket=bucket, Key=f"{prefix}/step-00000001/notes\x01.txt", Body=b"x")
        moved = S3Storage(f"{s3_url}/step-00000001").move("step-00000001.aside")
        assert f"{moved.prefix}/notes\x01.txt" in moved._all_keys()
        manager.save(2, {"w": torch.ones(4)}).wait()
        # in a committed step (one without a manifest holding it is another tool's, and kept)
        client.put_object(Bucket=bucket, Key=f"{prefix}/step-00000002/notes\x01.txt", Body=b"x")
        manager.save(3, {"w": torch.ones(4)})
        manager.wait()
    left = [
        o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step-00000002/").get("Contents", [])
    ]
    assert left == [], "retention removed step 2 with the foreign key in it"


def test_an_uncommitted_step_holding_another_tools_key_is_kept(s3_env, s3_url):
    bucket, prefix = s3_url[len("s3://") :].split("/", 1)
    client = boto3.client("s3", endpoint_url=s3_env.endpoint, region_name="us-east-1")
    client.put_object(Bucket=bucket, Key=f"{prefix}/step-00000005/notes\x01.txt", Body=b"x")
    with stashpoint.CheckpointManager(s3_url) as manager:  # its clean-up of crashed saves' leftovers
        assert manager.steps() == []
        with pytest.raises(CheckpointError, match=r"notes\\x01\.txt.*did not write"):
            manager.save(5, {"w": torch.ones(4)}).wait()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])]
    assert keys == [f"{prefix}/step-00000005/notes\x01.txt"]


def test_a_listing_naming_keys_outside_its_prefix_deletes_and_moves_nothing(hostile):
    hostile.mode = "outside_prefix"
    leftover = S3Storage("s3://bucket/run/step-00000002")
    for act in (leftover.remove_tree, lambda: leftover.move("step-00000002.damaged-20260101-000000"), leftover.list):
        with pytest.raises(CheckpointError, match=r"listed 'other-team/model/manifest.json', which is not under"):
            act()
    assert hostile.deleted == []


def test_a_tree_is_deleted_key_by_key_as_named(hostile):
    """obstore drops a trailing '/' and refuses 'a//b': folder markers and such keys go by name,
    and the object named like the prefix, beside the tree, is never among them."""
    from stashpoint._storage.s3tree import delete_tree

    keys = ["run/step-1/shard-r00000-0000-a.safetensors", "run/step-1/sub/", "run/step-1/x//y"]
    delete_tree(S3Storage("s3://bucket/run/step-1"), keys)
    assert set(hostile.deleted) >= set(keys) | {"run/step-1/", "run/step-1/x/"}
    assert "run/step-1" not in hostile.deleted and "run/step-1/sub" not in hostile.deleted
