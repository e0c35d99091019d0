"""Open multipart uploads: aborted when a save fails (an open upload is billed and never
listed as an object), and remembered for the process's next save where the server could not
be reached to abort them."""

from __future__ import annotations

import functools
import logging
import threading
from typing import TYPE_CHECKING

from stashpoint import _runtime
from stashpoint._storage.s3io import server_said
from stashpoint._storage.s3list import list_uploads, retrying

if TYPE_CHECKING:
    from stashpoint._storage.s3 import S3Storage
    from stashpoint._storage.s3config import S3Client

log = logging.getLogger("stashpoint")
_lock = threading.Lock()


def _pending() -> set[tuple[str, str, str]]:
    """(endpoint, bucket, key) of the uploads whose abort failed, retried by the next save there."""
    return _runtime.slot("storage.s3_pending_aborts", set)


def abort_uploads(store: S3Storage, key: str, *, exact: bool = True) -> int:
    """Abort the open multipart uploads of ``key`` (or, ``exact=False``, of every key under that
    prefix); the number aborted. Where the server cannot be reached, ``key`` is remembered for
    :func:`retry_pending_aborts` and 0 returned."""
    c, retry = store.client(), store.options.retry_seconds
    try:
        n = 0
        for up_key, upload_id in list_uploads(c.control, store.bucket, key, retry_seconds=retry):
            if up_key != key if exact else not up_key.startswith(key):
                continue
            retrying(
                functools.partial(
                    c.control.abort_multipart_upload, Bucket=store.bucket, Key=up_key, UploadId=upload_id
                ),
                retry,
            )
            n += 1
    except Exception as e:
        log.warning(
            "stashpoint: could not abort the multipart uploads of s3://%s/%s (%s); will retry at the next save",
            store.bucket,
            key,
            server_said(e),
        )
        with _lock:
            _pending().add((c.endpoint, store.bucket, key))
        return 0
    return n


def retry_pending_aborts(store: S3Storage, c: S3Client) -> None:
    """Abort the uploads of ``store``'s bucket that an earlier abort could not reach."""
    with _lock:
        pending = _pending()
        mine = [p for p in pending if p[:2] == (c.endpoint, store.bucket)]
        pending.difference_update(mine)
    for _, _, key in mine:
        abort_uploads(store, key)
