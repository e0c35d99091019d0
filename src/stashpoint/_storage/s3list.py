"""Listing an S3 prefix through botocore, page by page, with a pagination that cannot loop.

obstore refuses a whole listing over one key it cannot address (a control character, a ``..``
segment: legal in S3, and written there by another tool), and follows continuation tokens with
no end: a server whose pages never end hung ``ls``, ``verify`` and the manager. Here every key
comes back as the server sent it, and a token or an entry seen twice, an entry outside the prefix,
more entries than any checkpoint run holds, or a long run of empty pages that say more follow,
ends the listing with an :class:`S3Error` naming the prefix; so do names longer than S3 allows
or more bytes of names than memory should hold. The open multipart uploads under a prefix are
listed with the same bounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stashpoint.errors import S3Error

MAX_ENTRIES = 10_000_000  # a run of 16,384 ranks holds about 33k files a step
# S3 keys are at most 1,024 bytes of UTF-8; a listing holds its names in memory, so a server
# sending longer ones, or more of them than this in all, is refused instead of filling it
MAX_KEY_BYTES = 1024
MAX_LISTED_BYTES = 512 << 20
# S3 may send a page with fewer keys than asked, even none, and more to follow; a server whose
# empty pages never end (each with a fresh token) sent 28,000 requests a minute
MAX_EMPTY_PAGES = 1000
TRANSIENT_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling"})


def list_prefix(
    control: Any, bucket: str, prefix: str, *, delimiter: bool, retry_seconds: float
) -> tuple[dict[str, int], list[str]]:
    """``(key -> size, common prefixes)`` under ``prefix`` (empty, or ending with ``/``), every
    page of them; with ``delimiter``, one level only. Raises botocore's error when a request fails
    for good (the caller names it), :class:`S3Error` when the listing does not end."""
    keys: dict[str, int] = {}
    prefixes: list[str] = []
    seen: set[str] = set()
    pages = Pages(f"s3://{bucket}/{prefix}", "ListObjectsV2")
    held = _Held(pages)
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
                raise S3Error(pages.endless(f"listed {name[:200]!r} twice"))
            held.add(name)
            seen.add(name)
            if size < 0:
                prefixes.append(name)
            else:
                keys[name] = size
        if len(seen) > MAX_ENTRIES:
            raise S3Error(pages.endless(f"listed more than {MAX_ENTRIES:,} entries"))
        if not page.get("IsTruncated"):
            return keys, prefixes
        token = page.get("NextContinuationToken")
        pages.next(token, len(entries))
        held.add(str(token), token=True)  # each token is kept, to see one again
        request["ContinuationToken"] = token


def list_uploads(control: Any, bucket: str, prefix: str, *, retry_seconds: float) -> list[tuple[str, str]]:
    """``(key, upload id)`` of every multipart upload open under ``prefix``, every page of them,
    within the bounds of :func:`list_prefix`."""
    found: list[tuple[str, str]] = []
    pages = Pages(f"s3://{bucket}/{prefix}", "ListMultipartUploads")
    held = _Held(pages)
    request: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    while True:
        page = retrying(lambda: control.list_multipart_uploads(**request), retry_seconds)
        uploads = [(str(u.get("Key", "")), str(u.get("UploadId", ""))) for u in page.get("Uploads") or ()]
        for key, upload in uploads:
            held.add(key)
            held.add(upload, token=True)  # an id: counted, not a name S3 bounds
        found += uploads
        if len(found) > MAX_ENTRIES:
            raise S3Error(pages.endless(f"listed more than {MAX_ENTRIES:,} open uploads"))
        if not page.get("IsTruncated"):
            return found
        marker = (page.get("NextKeyMarker"), page.get("NextUploadIdMarker"))
        pages.next(marker if marker[0] else None, len(uploads))
        held.add(str(marker), token=True)
        for field, value in zip(("KeyMarker", "UploadIdMarker"), marker):
            if value:
                request[field] = value
            else:  # botocore refuses a None
                request.pop(field, None)


class Pages:
    """The bounds of one paginated listing: every page must name a new place to go on from, and
    at most :data:`MAX_EMPTY_PAGES` empty pages in a row may say that more follow."""

    def __init__(self, where: str, call: str) -> None:
        self.where, self.call = where, call
        self._tokens: set[object] = set()
        self._empty = 0

    def next(self, token: object, entries: int) -> None:
        if not token or token in self._tokens:
            raise S3Error(self.endless("sent a page without a new continuation token"))
        self._tokens.add(token)
        self._empty = 0 if entries else self._empty + 1
        if self._empty > MAX_EMPTY_PAGES:
            raise S3Error(self.endless(f"sent {MAX_EMPTY_PAGES:,} empty pages in a row, each saying more follow"))

    def endless(self, what: str) -> str:
        return (
            f"listing {self.where}: the server {what}, so its listing would not end; "
            f"it does not paginate {self.call} as S3 does (check the server, or its proxy)"
        )


class _Held:
    """The bytes of names a listing holds, refused past :data:`MAX_KEY_BYTES` a name and
    :data:`MAX_LISTED_BYTES` in all."""

    def __init__(self, pages: Pages) -> None:
        self.pages, self.total = pages, 0

    def add(self, *names: str, token: bool = False) -> None:
        for name in names:
            n = len(name.encode("utf-8", "surrogatepass"))
            self.total += n
            if n > MAX_KEY_BYTES and not token:
                raise S3Error(
                    f"listing {self.pages.where}: the server listed a name of {n:,} bytes ({name[:100]!r}...); S3 "
                    f"allows {MAX_KEY_BYTES:,}: it is not an S3 listing (check the server, or its proxy)"
                )
            if self.total > MAX_LISTED_BYTES:
                raise S3Error(
                    f"listing {self.pages.where}: the server listed more than {MAX_LISTED_BYTES >> 20} MiB of names, "
                    "more than any checkpoint run holds (check the server, or its proxy)"
                )


class Backoff:
    """The pauses between tries of a request that failed for now: 0.1 s, doubling to 8 s, while
    the next try still starts within ``seconds`` of the first."""

    def __init__(self, seconds: float) -> None:
        self.deadline, self.pause = time.monotonic() + seconds, 0.1

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def wait(self) -> bool:
        """Sleep until the next try; False, at once, when it would start past the deadline."""
        if time.monotonic() + self.pause > self.deadline:
            return False
        time.sleep(self.pause)
        self.pause = min(self.pause * 2, 8.0)
        return True


def retrying(request: Callable[[], dict[str, Any]], retry_seconds: float) -> dict[str, Any]:
    """``request()``, retried with backoff while it fails transiently, for up to ``retry_seconds``
    (as obstore retries the data requests)."""
    backoff = Backoff(retry_seconds)
    while True:
        try:
            return request()
        except Exception as e:
            if not _transient(e) or not backoff.wait():
                raise


def _transient(e: BaseException) -> bool:
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code in TRANSIENT_CODES or status >= 500 or status == 429
    return isinstance(e, (BotoConnectionError, HTTPClientError))
