"""The S3 backend: a checkpoint under ``s3://bucket/prefix`` on AWS S3 or any S3-compatible server.

Object stores cannot rename, so ``commit`` is a plain PUT of the manifest, made after every shard
object is complete: the manifest object's presence is the commit (``atomic_rename = False``). A
PUT is atomic on S3 — readers see the whole object or none.

* Shards are written as multipart uploads: the staged bytes are handed to the upload as they come
  (zero-copy: the staging memory stays valid until ``close()`` returns), ``part_size`` parts,
  ``concurrency`` of them in flight; a file no larger than one part is a single PUT. ``close()``
  completes the upload; ``abort()`` or any failure aborts it, so nothing is left behind.
* Reads are ranged GETs; a large range is split into ``part_size`` GETs fetched in parallel
  straight into the destination buffers (the copy runs outside the GIL).
* Transient errors (connection refused or reset, timeouts, 5xx, throttling) are retried with
  exponential backoff for up to ``retry_seconds`` per request; permanent ones (bad credentials,
  missing bucket) fail at once with the fix in the message.

Configuration and clients: see ``_s3config``.
"""

from __future__ import annotations

import builtins
import concurrent.futures as cf
import dataclasses
import errno
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from stashpoint._core.naming import is_group_dir, split_group
from stashpoint._storage.base import FileWriter, Storage
from stashpoint._storage.s3config import (
    S3Client,
    S3Options,
    addressable,
    check_installed,
    client_for,
    parse_url,
)
from stashpoint._storage.s3io import S3Writer, copy_into, server_said, status_of
from stashpoint._storage.s3list import Backoff, list_prefix, retrying
from stashpoint._storage.s3tree import copy_tree, delete_tree
from stashpoint._storage.s3uploads import abort_uploads, retry_pending_aborts
from stashpoint.errors import S3Error

log = logging.getLogger("stashpoint")
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# The storage


_BEST_EFFORT_RETRY_S = 3.0
_BEST_EFFORT_TIMEOUT_S = 10.0
# a ranged GET's body is taken in pieces of about this size: obstore gathers larger ones slower
# (loads of 0.5 GB from SeaweedFS took 1.2x as long with 8 MiB, 1.6x with a whole 32 MiB part)
_STREAM_CHUNK = 1 << 20


class S3Storage(Storage):
    """A checkpoint (or a run directory of them) under ``s3://bucket/prefix``."""

    atomic_rename = False
    has_directories = False

    def __init__(self, url: str, options: S3Options | None = None) -> None:
        check_installed()
        self.bucket, self.prefix = parse_url(url)
        self.options = options if options is not None else S3Options.from_env()

    def best_effort(self) -> S3Storage:
        """A copy that retries transient errors for at most a few seconds, each request within a
        shorter time limit (clean-up after a failure: a server that is down or stalled should
        fail the save in seconds, not after every delete's budget and timeout)."""
        o = self.options
        quick = dataclasses.replace(
            o,
            retry_seconds=min(o.retry_seconds, _BEST_EFFORT_RETRY_S),
            timeout_seconds=min(o.timeout_seconds, _BEST_EFFORT_TIMEOUT_S),
        )
        return self if quick == o else S3Storage(self.url, quick)

    # -- naming ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The normalized ``s3://bucket/prefix``; ``storage_for(url)`` gives this storage back."""
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @property
    def location(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, S3Storage) and (other.url, other.options) == (self.url, self.options)

    def __hash__(self) -> int:
        return hash((self.url, self.options))

    def key(self, name: str) -> str:
        """The object key of the checkpoint's file ``name`` (a plain name, or ``g00012/name``)."""
        if split_group(name) is None:
            raise ValueError(f"{name!r} is not a file name inside a checkpoint under {self.url}")
        return self._under(name)

    def _under(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def client(self) -> S3Client:
        return client_for(self.bucket, self.options)

    # -- errors ---------------------------------------------------------------------------------

    def error(self, op: str, name: str | None, e: BaseException) -> BaseException:
        """The error to raise for ``e`` (from obstore or botocore) while ``op`` on ``name``."""
        from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError

        if isinstance(e, (S3Error, EOFError)):
            return e
        c = self.client()
        where = self.url_of(name) if name else self.url
        said = server_said(e)
        if "NoSuchBucket" in said or "NoSuchBucket" in str(e):
            return S3Error(
                f"{op} {where}: the bucket {self.bucket!r} does not exist at {c.endpoint}. Create it "
                f"(aws s3 mb s3://{self.bucket}), or point AWS_ENDPOINT_URL at the server that has it"
            )
        if isinstance(e, (NotFoundError, FileNotFoundError)):
            return FileNotFoundError(errno.ENOENT, f"{where} does not exist")
        refused = isinstance(e, (PermissionDeniedError, UnauthenticatedError)) or status_of(e) in ("401", "403")
        if refused or type(e).__name__ == "NoCredentialsError":  # botocore's, when it has none to sign with
            return S3Error(f"{op} {where} was refused by {c.endpoint} ({said}); {c.credentials_hint()}")
        return S3Error(
            f"{op} {where} failed ({said}) after retrying for up to {self.options.retry_seconds:g} s; "
            f"{c.endpoint_hint()}. The retry budget is STASHPOINT_S3_RETRY_SECONDS"
        )

    def call(self, op: str, name: str | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise self.error(op, name, e) from e

    # -- the checkpoint level -------------------------------------------------------------------

    def prepare(self) -> None:
        """Check that the bucket exists and is ours to use (objects need no directory; asked once
        per process and client), and abort the multipart uploads of earlier failed saves whose
        abort could not reach the server."""
        from botocore.exceptions import BotoCoreError, ClientError

        c = self.client()
        if "bucket" in c.checked:
            retry_pending_aborts(self, c)
            return
        try:
            retrying(lambda: c.control.head_bucket(Bucket=self.bucket), self.options.retry_seconds)
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise self.error("saving to", None, Exception("NoSuchBucket")) from None
            if code in ("401", "403", "AccessDenied", "Forbidden"):
                raise S3Error(
                    f"saving to {self.url}: {c.endpoint} refused access to the bucket {self.bucket!r} ({code}); "
                    f"{c.credentials_hint()}"
                ) from None
            raise S3Error(f"saving to {self.url}: checking the bucket failed ({e})") from None
        except BotoCoreError as e:
            raise S3Error(f"saving to {self.url}: {e}; {c.endpoint_hint()}") from None
        c.checked.add("bucket")
        retry_pending_aborts(self, c)

    def open_writer(self, name: str, size: int) -> FileWriter:
        return S3Writer(self, name, size)

    def sync(self) -> None:
        """Nothing to do: a completed upload is durable."""

    def commit(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        import obstore

        store, key = self.client().store, self.key(name)
        if not exclusive:
            self.call("writing", name, obstore.put, store, key, data, use_multipart=False)
            return
        backoff = Backoff(self.options.retry_seconds)
        while True:
            try:  # a conditional PUT (If-None-Match: *): the store refuses it if the key exists
                obstore.put(store, key, data, use_multipart=False, mode="create")
                return
            except Exception as e:
                # obstore does not retry a conditional PUT whose connection broke, and its reply
                # may be lost after the server stored it (a retry is then refused as existing):
                # what is there now says whether this commit happened. A refusal for good (400,
                # 403) is not read back nor sent again.
                status = status_of(e)
                lasting = status not in ("409", "412", "429") and not status.startswith("5")
                if status and lasting and "RequestTimeout" not in str(e):  # S3's slow request: a 400
                    raise self.error("writing", name, e) from e
                there = self._commit_there(name, data, e)
                if there:
                    return
                if not backoff.wait():
                    raise self.error("writing", name, e) from e

    def _commit_there(self, name: str, data: bytes, error: Exception) -> bool:
        """After the conditional PUT of ``data`` failed with ``error``: True when the object holds
        ``data`` (the PUT happened), False when there is none (try again); FileExistsError when
        it holds other bytes (another save committed), ``error`` when it cannot be read."""
        try:
            held = self.read(name, 0, len(data) + 1)
        except FileNotFoundError:
            held = None
        except Exception:
            raise self.error("writing", name, error) from error
        if held == data:
            log.info("stashpoint: %s was committed by a request whose reply was lost", self.url_of(name))
            return True
        if held is not None:
            raise FileExistsError(errno.EEXIST, "already exists", self.location + "/" + name) from None
        return False

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        import obstore

        if length is not None:  # a cap (a manifest's, say): hold only what the server has
            if length <= 0:
                return b""
            try:
                return b"".join(self._body(name, offset, length))
            except EOFError:
                return b""  # past the end, like reading a file past its end
        store, key = self.client().store, self.key(name)
        try:
            opts: Any = {"range": {"offset": offset}} if offset else {}
            return bytes(obstore.get(store, key, options=opts).bytes())
        except Exception as e:
            if status_of(e) == "416":
                return b""
            raise self.error("reading", name, e) from e

    def _body(self, name: str, start: int, want: int) -> Iterator[memoryview]:
        """The bytes from ``start`` on, at most ``want`` of them, as they stream in: a body longer
        than the range asked for (a broken or hostile server) is refused once it passes it, never
        held whole. Past the object's end: EOFError."""
        import obstore

        try:
            result = obstore.get(self.client().store, self.key(name), options={"range": (start, start + want)})
            got = 0
            for chunk in result.stream(min_chunk_size=min(want, _STREAM_CHUNK)):
                piece = memoryview(chunk)
                got += len(piece)
                if got > want:
                    raise S3Error(
                        f"reading {self.url_of(name)}: the server sent more than the {want} bytes asked for "
                        f"from byte {start}; it does not serve ranged GETs as S3 does"
                    )
                yield piece
        except Exception as e:
            if status_of(e) == "416":
                raise EOFError(
                    f"{self.url_of(name)} ended before byte {start}, before the data it should hold"
                ) from None
            raise self.error("reading", name, e) from e

    def _fetch(self, name: str, start: int, dests: list[memoryview]) -> None:
        """Fill ``dests`` with the bytes from ``start`` on, as they stream in (see :meth:`_body`)."""
        want = sum(len(d) for d in dests)
        filled, i, at = 0, 0, 0  # dests[i][at:] is the next place to fill
        for piece in self._body(name, start, want):
            filled += len(piece)
            src = piece
            while src:
                take = min(len(src), len(dests[i]) - at)
                copy_into(dests[i][at : at + take], src[:take])
                src, at = src[take:], at + take
                if at == len(dests[i]):
                    i, at = i + 1, 0
        if filled < want:
            raise EOFError(f"{self.url_of(name)} ended at byte {start + filled}, before the data it should hold")

    def readv(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        part = self.options.part_size
        pieces: list[tuple[int, list[memoryview]]] = []
        start, cur, filled = offset, [], 0
        for b in buffers:
            mv = memoryview(b).cast("B")
            while len(mv):
                take = min(len(mv), part - filled)
                cur.append(mv[:take])
                mv, filled = mv[take:], filled + take
                if filled == part:
                    pieces.append((start, cur))
                    start, cur, filled = start + filled, [], 0
        if cur:
            pieces.append((start, cur))
        if len(pieces) <= 1:
            for s, dests in pieces:
                self._fetch(name, s, dests)
            return
        with cf.ThreadPoolExecutor(min(self.options.concurrency, len(pieces)), "stashpoint-s3-get") as pool:
            futures = [pool.submit(self._fetch, name, s, dests) for s, dests in pieces]
            for f in futures:
                f.result()

    def size(self, name: str) -> int:
        import obstore

        meta = self.call("reading", name, obstore.head, self.client().store, self.key(name))
        return int(meta["size"])

    def exists(self, name: str | None = None) -> bool:
        if name is None:
            objects, prefixes = self._list_level()
            return bool(objects or prefixes)
        try:
            self.size(name)
        except FileNotFoundError:
            return False
        return True

    def _list_level(self) -> tuple[dict[str, int], builtins.list[str]]:
        """Object names (with their sizes) and sub-prefix names directly under the prefix."""
        keys, prefixes = self._listing(delimiter=True)
        cut = len(self.prefix) + 1 if self.prefix else 0
        # Some servers (SeaweedFS) show an emptied "directory" as an object named like the prefix.
        objects = {name: n for k, n in keys.items() if (name := k[cut:]) and not name.endswith("/")}
        return objects, [name for p in prefixes if (name := p[cut:].rstrip("/"))]

    def _listing(self, *, delimiter: bool) -> tuple[dict[str, int], builtins.list[str]]:
        prefix = f"{self.prefix}/" if self.prefix else ""
        control, retry = self.client().control, self.options.retry_seconds
        return self.call(
            "listing", None, list_prefix, control, self.bucket, prefix, delimiter=delimiter, retry_seconds=retry
        )

    def sizes(self) -> dict[str, int]:
        """The objects directly under the prefix, and those under its group prefixes as
        ``g00012/name``, with their sizes: one listing a level, no request per object."""
        objects, prefixes = self._list_level()
        for group in filter(is_group_dir, prefixes):
            objects |= {f"{group}/{name}": n for name, n in self.child(group)._list_level()[0].items()}
        return {name: n for name, n in sorted(objects.items()) if split_group(name) is not None}

    def list(self) -> builtins.list[str]:
        """The names :meth:`sizes` gives (only names a checkpoint can hold)."""
        return builtins.list(self.sizes())

    def listed(self, name: str) -> bool:
        """One listing of the keys that start with ``name``'s (not a listing of every file)."""
        keys, _ = self.call(
            "listing", name, list_prefix, self.client().control, self.bucket, self.key(name),
            delimiter=True, retry_seconds=self.options.retry_seconds,
        )  # fmt: skip
        return self.key(name) in keys

    def delete(self, name: str) -> None:
        import obstore

        self.call("deleting", name, obstore.delete, self.client().store, self.key(name))

    # -- the run-directory level ----------------------------------------------------------------

    def child(self, name: str) -> S3Storage:
        return S3Storage(f"{self.url}/{name}", self.options)

    def children(self) -> builtins.list[str]:
        """The sub-prefixes a :meth:`child` can be made for (another tool's ``tmp\x01dir`` is
        left out: it is no step, and the data client cannot address it)."""
        return sorted(p for p in self._list_level()[1] if not is_group_dir(p) and addressable(p))

    def tree(self) -> builtins.list[str] | None:
        """See :meth:`Storage.tree` (folder markers left out)."""
        cut = len(self.prefix) + 1 if self.prefix else 0
        return sorted(k[cut:] for k in self._all_keys() if not k.endswith("/"))

    def _all_keys(self) -> builtins.list[str]:
        """Every object key under the prefix, at any depth."""
        return builtins.list(self._listing(delimiter=False)[0])

    def remove_tree(self) -> None:
        """Delete every object under the prefix and abort any multipart upload still open under
        it (a save that crashed)."""
        delete_tree(self, self._all_keys())
        self.abort_uploads(f"{self.prefix}/" if self.prefix else "", exact=False)

    def move(self, name: str) -> S3Storage:
        """Copy every object to the sibling prefix ``name`` (server-side, manifests last) and then
        delete the originals (manifests first)."""
        if not self.prefix:
            raise ValueError(f"{self.url} is a whole bucket; it cannot be moved")
        parent = self.prefix.rpartition("/")[0]
        target = S3Storage(
            f"s3://{self.bucket}/{parent}/{name}" if parent else f"s3://{self.bucket}/{name}", self.options
        )
        if target.exists(None):
            raise FileExistsError(errno.EEXIST, f"cannot move {self.url} to {target.url}: it already holds objects")
        keys = self._all_keys()
        if not keys:
            raise FileNotFoundError(errno.ENOENT, f"cannot move {self.url}: nothing is stored there")
        copy_tree(self, target, keys)
        delete_tree(self, keys)
        return target

    # -- multipart upload hygiene ---------------------------------------------------------------

    def abort_uploads(self, key: str, *, exact: bool = True) -> int:
        """Abort the open multipart uploads of ``key`` (or, ``exact=False``, of every key under
        that prefix). If the server cannot be reached, remember them for the next ``prepare()``."""
        return abort_uploads(self, key, exact=exact)
