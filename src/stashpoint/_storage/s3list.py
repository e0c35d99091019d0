"""Listing an S3 prefix through botocore, page by page, with a pagination that cannot loop.

obstore refuses a whole listing over one key it cannot address (a control character, a ``..``
segment: legal in S3, and written there by another tool), and follows continuation tokens with
no end: a server whose pages never end hung ``ls``, ``verify`` and the manager. Here every key
comes back as the server sent it, and a token or an entry seen twice, an entry outside the prefix,
or more entries than any checkpoint run holds, ends the listing with an :class:`S3Error` naming
the prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stashpoint.errors import S3Error

MAX_ENTRIES = 10_000_000  # a run of 16,384 ranks holds about 33k files a step
_TRANSIENT_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling"})


def list_prefix(
    control: Any, bucket: str, prefix: str, *, delimiter: bool, retry_seconds: float
) -> tuple[dict[str, int], list[str]]:
    """``(key -> size, common prefixes)`` under ``prefix`` (empty, or ending with ``/``), every
    page of them; with ``delimiter``, one level only. Raises botocore's error when a request fails
    for good (the caller names it), :class:`S3Error` when the listing does not end."""
    keys: dict[str, int] = {}
    prefixes: list[str] = []
    seen: set[str] = set()
    tokens: set[str] = set()
    request: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    if delimiter:
        request["Delimiter"] = "/"
    while True:
        page = retrying(lambda: control.list_objects_v2(**request), retry_seconds)
        entries = [(o["Key"], int(o.get("Size", 0))) for o in page.get("Contents") or ()]
        entries += [(p["Prefix"], -1) for p in page.get("CommonPrefixes") or ()]
        for name, size in entries:
            if not name.startswith(prefix):  # deleting a tree deletes what its listing names
                raise S3Error(
                    f"listing s3://{bucket}/{prefix}: the server listed {name[:200]!r}, which is not under that "
                    "prefix; it does not honour ListObjectsV2's Prefix (check the server, or its proxy)"
                )
            if name in seen:
                raise S3Error(_endless(bucket, prefix, f"listed {name[:200]!r} twice"))
            seen.add(name)
            if size < 0:
                prefixes.append(name)
            else:
                keys[name] = size
        if len(seen) > MAX_ENTRIES:
            raise S3Error(_endless(bucket, prefix, f"listed more than {MAX_ENTRIES:,} entries"))
        if not page.get("IsTruncated"):
            return keys, prefixes
        token = page.get("NextContinuationToken")
        if not token or token in tokens:
            raise S3Error(_endless(bucket, prefix, "sent a page without a new continuation token"))
        tokens.add(token)
        request["ContinuationToken"] = token


def _endless(bucket: str, prefix: str, what: str) -> str:
    return (
        f"listing s3://{bucket}/{prefix}: the server {what}, so its listing would not end; "
        "it does not paginate ListObjectsV2 as S3 does (check the server, or its proxy)"
    )


def retrying(request: Callable[[], dict[str, Any]], retry_seconds: float) -> dict[str, Any]:
    """``request()``, retried with backoff while it fails transiently, for up to ``retry_seconds``
    (as obstore retries the data requests)."""
    deadline = time.monotonic() + retry_seconds
    pause = 0.1
    while True:
        try:
            return request()
        except Exception as e:
            if not _transient(e) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 8.0)


def _transient(e: BaseException) -> bool:
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code in _TRANSIENT_CODES or status >= 500 or status == 429
    return isinstance(e, (BotoConnectionError, HTTPClientError))
