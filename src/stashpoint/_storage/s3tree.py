"""Operations on every object under an S3 prefix: deleting a tree (retention, clean-up) and
copying one server-side (moving a damaged step aside), in the order that keeps an interrupted
one safe. Keys obstore cannot address (another tool's, with a control character) go through
botocore, so that such a key never blocks retention or a move."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
from typing import TYPE_CHECKING, Any

from stashpoint._core.naming import MANIFEST_NAME
from stashpoint._storage.s3config import addressable, has_control
from stashpoint._storage.s3list import TRANSIENT_CODES, Backoff, retrying
from stashpoint.errors import S3Error

if TYPE_CHECKING:
    from stashpoint._storage.s3 import S3Storage

log = logging.getLogger("stashpoint")
_DELETE_BATCH = 1000  # S3's limit per DeleteObjects request


def delete_tree(store: S3Storage, keys: list[str]) -> None:
    """Delete ``keys`` (all under ``store``'s prefix): manifests first, so an interrupted removal
    leaves uncommitted leftovers, never a half-deleted committed checkpoint; then the
    folder keys (``step/``) of servers that keep emptied folders listed (SeaweedFS), deepest
    first, each exactly as named (on AWS, where folders are markers some tools write, the
    object ``step`` beside the tree is never touched)."""
    manifests = [k for k in keys if k.rsplit("/", 1)[-1] == MANIFEST_NAME]
    _delete(store, manifests)
    _delete(store, sorted(set(keys) - set(manifests)))
    if not store.prefix:
        return
    dirs = {f"{store.prefix}/"}
    for k in keys:
        parts = k[len(store.prefix) + 1 :].split("/")[:-1]
        dirs.update(f"{store.prefix}/{'/'.join(parts[: i + 1])}/" for i in range(len(parts)))
    try:  # what lists them as folders: a leftover is no step (no manifest) and goes later
        for depth in sorted({d.count("/") for d in dirs}, reverse=True):
            _delete(store, sorted(d for d in dirs if d.count("/") == depth))
    except OSError as e:
        log.warning("stashpoint: could not delete the folder keys of %s: %s", store.url, e)


def copy_tree(store: S3Storage, target: S3Storage, keys: list[str]) -> None:
    """Copy ``keys`` (under ``store``'s prefix) to the same names under ``target``'s, server-side,
    manifests last: an interrupted copy leaves no committed checkpoint there."""
    import obstore

    c, cut = store.client(), len(store.prefix) + 1
    objects = [k for k in keys if not k.endswith("/")]
    manifests = [k for k in objects if k.rsplit("/", 1)[-1] == MANIFEST_NAME]

    def copy(key: str) -> None:
        to = target._under(key[cut:])
        if plain_key(key):
            obstore.copy(c.store, key, to)
        else:
            copy_raw(c.control, store.bucket, key, to, store.options.retry_seconds)

    for group in (sorted(set(objects) - set(manifests)), manifests):
        with cf.ThreadPoolExecutor(store.options.concurrency, "stashpoint-s3-copy") as pool:
            futures = [pool.submit(store.call, "copying", k[cut:], copy, k) for k in group]
            for f in futures:
                f.result()


def plain_key(key: str) -> bool:
    """Whether obstore addresses ``key`` as it is: it refuses control characters, ``.``, ``..``
    and empty segments (``a//b``), and drops a leading or trailing ``/`` (a folder marker
    ``step/`` would become the object ``step``, beside the tree)."""
    return all(part and addressable(part) for part in key.split("/"))


def _delete(store: S3Storage, keys: list[str]) -> None:
    import obstore

    c, retry = store.client(), store.options.retry_seconds
    ours: list[str] = []
    batched: list[str] = []  # folder markers, a//b: by name, in batches
    single: list[str] = []  # control characters: one request each
    for k in keys:
        (ours if plain_key(k) else single if has_control(k) else batched).append(k)
    for i in range(0, len(ours), _DELETE_BATCH):
        store.call("deleting under", None, obstore.delete, c.store, ours[i : i + _DELETE_BATCH])
    for i in range(0, len(batched), _DELETE_BATCH):
        store.call("deleting under", None, delete_batch, c.control, store.bucket, batched[i : i + _DELETE_BATCH], retry)
    for key in single:
        store.call("deleting under", None, delete_raw, c.control, store.bucket, key, retry)


def delete_batch(control: Any, bucket: str, keys: list[str], retry_seconds: float) -> None:
    """Delete ``keys`` (at most 1,000, none with a control character) exactly as named. A reply
    may refuse some keys alone (``SlowDown``, ``InternalError``: S3 under load): those are sent
    again within ``retry_seconds``."""
    backoff = Backoff(retry_seconds)
    left = keys
    while True:
        request = {"Objects": [{"Key": k} for k in left], "Quiet": True}
        reply = retrying(functools.partial(control.delete_objects, Bucket=bucket, Delete=request), backoff.left())
        failed = [e for e in reply.get("Errors") or () if e.get("Code") != "NoSuchKey"]
        if not failed:
            return
        lasting = [e for e in failed if e.get("Code") not in TRANSIENT_CODES]
        if lasting or not backoff.wait():
            e = (lasting or failed)[0]
            raise S3Error(f"deleting s3://{bucket}/{e.get('Key')} failed ({e.get('Code')}: {e.get('Message')})")
        left = [str(e.get("Key")) for e in failed]


def delete_raw(control: Any, bucket: str, key: str, retry_seconds: float) -> None:
    """Delete ``key`` through botocore: a key obstore cannot address (one request per key: a
    DeleteObjects body is XML 1.0, which cannot hold control characters)."""
    retrying(lambda: control.delete_object(Bucket=bucket, Key=key), retry_seconds)


def copy_raw(control: Any, bucket: str, key: str, to: str, retry_seconds: float) -> None:
    """Copy ``key`` to ``to`` server-side through botocore: a key obstore cannot address."""
    retrying(
        lambda: control.copy_object(Bucket=bucket, Key=to, CopySource={"Bucket": bucket, "Key": key}), retry_seconds
    )
