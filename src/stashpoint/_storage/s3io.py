"""The S3 backend's byte movers: the multipart writer, the GIL-free copy, error texts.

See ``_s3`` for the storage itself.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import re
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

from stashpoint._storage.base import FileWriter

if TYPE_CHECKING:
    from stashpoint._storage.s3 import S3Storage

log = logging.getLogger("stashpoint")


# ---------------------------------------------------------------------------------------------
# Copying outside the GIL


class _PyBuffer(ctypes.Structure):
    _fields_ = (
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    )


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_PyBuffer),)
_PYBUF_WRITABLE = 0x0001


def copy_into(dst: memoryview, src: object) -> None:
    """Copy the contiguous buffer ``src`` into the start of ``dst`` with ``memmove``, which (a
    ctypes foreign call) runs without the GIL: a training loop beside a load keeps running."""
    views = []
    try:
        for obj, flags in ((dst, _PYBUF_WRITABLE), (src, 0)):
            view = _PyBuffer()
            if _get_buffer(obj, ctypes.byref(view), flags) != 0:  # pragma: no cover - raises instead
                raise BufferError("could not get a buffer")
            views.append(view)
        d, s = views
        if s.len > d.len:
            raise ValueError(f"{s.len} bytes do not fit in a {d.len}-byte buffer")
        if s.len:
            ctypes.memmove(d.buf, s.buf, s.len)
    finally:
        for view in views:
            _release_buffer(ctypes.byref(view))


# ---------------------------------------------------------------------------------------------
# Errors


def server_said(e: BaseException) -> str:
    """What the server or client said, in one line (obstore's messages carry XML and debug dumps)."""
    text = str(e)
    code = re.search(r"<Code>(.*?)</Code>", text)
    if code:
        msg = re.search(r"<Message>(.*?)</Message>", text)
        return f"{code.group(1)}: {msg.group(1)}" if msg else code.group(1)
    text = text.split("Debug source", maxsplit=1)[0].strip()
    status = re.search(r"status code: (\d{3}[^:\n]*)", text)
    if status:
        return f"HTTP {status.group(1).strip()}"
    first = text.splitlines()[0] if text else type(e).__name__
    cause = first.rpartition(" - ")[2]  # obstore: "Error performing PUT <url> in 3s, after N retries - <cause>"
    return cause[:300] or first[:300]


def status_of(e: BaseException) -> str:
    """The HTTP status of an obstore error (in its text) or a botocore one (in its response)."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    m = re.search(r"status code: (\d{3})", str(e))
    return m.group(1) if m else ""


# ---------------------------------------------------------------------------------------------
# The writer


_END = object()
_ABORT = object()


class _Aborted(Exception):
    pass


class S3Writer(FileWriter):
    """One object being written. Small files: one PUT at ``close()``. Larger ones: a multipart
    upload on a thread, fed each ``write()``'s memory as it comes (obstore slices it into parts
    without copying)."""

    def __init__(self, storage: S3Storage, name: str, size: int) -> None:
        self._storage, self._name = storage, name
        self._key = storage.key(name)
        self._client = storage.client()
        self._multipart = size > storage.options.part_size
        self._views: list[memoryview] = []
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False

    def _feed(self) -> Iterator[object]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if item is _ABORT:
                raise _Aborted
            yield item

    def _upload(self) -> None:
        import obstore

        opts = self._storage.options
        try:
            obstore.put(
                self._client.store,
                self._key,
                cast("Iterator[memoryview]", self._feed()),
                chunk_size=opts.part_size,
                max_concurrency=opts.concurrency,
            )
        except BaseException as e:
            self._error = e

    def write(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        if not len(mv):
            return
        if not self._multipart:
            self._views.append(mv)
            return
        if self._error is not None:
            raise self._storage.error("uploading", self._name, self._error)
        if self._thread is None:
            self._thread = threading.Thread(target=self._upload, name="stashpoint-s3-upload", daemon=True)
            self._thread.start()
        self._queue.put(mv)

    def close(self) -> None:
        self._closed = True
        if self._thread is None:
            import obstore

            views, self._views = self._views, []
            self._storage.call(
                "uploading", self._name, obstore.put, self._client.store, self._key, views, use_multipart=False
            )
            return
        self._queue.put(_END)
        self._thread.join()
        if self._error is not None:
            self._thread = None  # cleaned up here: abort() need not do it again
            self._storage.best_effort().abort_uploads(self._key)  # the server may be down or stalled
            raise self._storage.error("uploading", self._name, self._error)

    def abort(self) -> None:
        self._views = []
        if self._thread is not None:
            self._queue.put(_ABORT)
            self._thread.join()
            self._storage.best_effort().abort_uploads(self._key)  # the server may be down or stalled
        if not self._closed:  # the object was never completed: nothing to delete
            return
        try:  # close() may have failed after the object was complete (a lost response)
            self._storage.delete(self._name)
        except OSError as e:
            log.warning(
                "stashpoint: could not delete %s after an aborted upload: %s", self._storage.url_of(self._name), e
            )
