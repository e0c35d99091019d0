"""Page-locking (pinning) host memory in place for CUDA copies, through the CUDA driver API.

The runtime's ``cudaHostRegister`` (as torch's binding exposes it) leaves the calling thread's
"last error" set when it fails, and the next kernel launched on that thread then raises an
unrelated CUDA error: a failed pin would crash training instead of falling back to pageable
memory. The driver API reports errors through its return value only. Registration runs in the
primary context of the device the state lives on (not whatever device happens to be current,
which would create a stray context on GPU 0 for a rank that never called ``set_device``), with
the portable flag, as torch's own pinned memory.

A pin that fails is not fatal: staging works from pageable memory, only its device copies are
synchronous. The first failure is logged as a warning, later ones at debug level.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger("stashpoint")

_PORTABLE = 0x01  # CU_MEMHOSTREGISTER_PORTABLE == cudaHostRegisterPortable


class PinError(OSError):
    """CUDA refused to pin or unpin a range (the message names the driver's error)."""


class Driver:
    """The few driver entry points pinning needs (``libcuda``, loaded by torch's runtime)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._fn: dict[str, Any] = {}  # ctypes function pointers
        for name, alts in {
            "init": ("cuInit",),
            "device": ("cuDeviceGet",),
            "retain": ("cuDevicePrimaryCtxRetain",),
            "release": ("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"),
            "push": ("cuCtxPushCurrent_v2", "cuCtxPushCurrent"),
            "pop": ("cuCtxPopCurrent_v2", "cuCtxPopCurrent"),
            "register": ("cuMemHostRegister_v2", "cuMemHostRegister"),
            "unregister": ("cuMemHostUnregister",),
            "error": ("cuGetErrorString",),
        }.items():
            fn = next((getattr(lib, a) for a in alts if hasattr(lib, a)), None)
            if fn is None:
                raise PinError(f"the CUDA driver library has no {alts[0]}")
            fn.restype = ctypes.c_int
            self._fn[name] = fn
        self._fn["register"].argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._fn["unregister"].argtypes = [ctypes.c_void_p]
        self._check(self._fn["init"](0), "cuInit")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            text = ctypes.c_char_p()
            self._fn["error"](rc, ctypes.byref(text))
            raise PinError(f"{what} failed: {(text.value or b'').decode(errors='replace') or 'error'} ({rc})")

    @contextmanager
    def primary_context(self, device: int) -> Iterator[None]:
        """Make ``device``'s primary context current on this thread for the block."""
        dev = ctypes.c_int()
        self._check(self._fn["device"](ctypes.byref(dev), device), f"cuDeviceGet({device})")
        ctx = ctypes.c_void_p()
        self._check(self._fn["retain"](ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        try:
            self._check(self._fn["push"](ctx), "cuCtxPushCurrent")
            try:
                yield
            finally:
                self._fn["pop"](ctypes.byref(ctypes.c_void_p()))
        finally:
            self._fn["release"](dev)

    def register(self, ptr: int, nbytes: int, device: int) -> None:
        with self.primary_context(device):
            self._check(self._fn["register"](ptr, nbytes, _PORTABLE), f"cuMemHostRegister({nbytes} bytes)")

    def unregister(self, ptr: int, device: int) -> None:
        with self.primary_context(device):
            self._check(self._fn["unregister"](ptr), "cuMemHostUnregister")


@functools.cache
def driver() -> Driver | None:
    """The CUDA driver, or None where it cannot be loaded (the runtime's path is used then)."""
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError) as e:
        log.debug("stashpoint: the CUDA driver API is not available (%s); pinning through the runtime", e)
        return None


def _clear_runtime_error() -> None:
    """Reset the runtime's per-thread last error (the library torch loaded, found by its mapping)."""
    try:
        with open("/proc/self/maps") as f:
            path = next((line.split()[-1] for line in f if "libcudart" in line and "/" in line), None)
        if path is not None:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


def _runtime_call(fn: Callable[[], int], what: str, device: int) -> None:
    with torch.cuda.device(device):
        rc = fn()
    try:
        torch.cuda.check_error(rc)
    except Exception as e:
        _clear_runtime_error()
        raise PinError(f"{what} failed: {e}") from None


_state = {"warned": False}
_lock = threading.Lock()


def _warn(nbytes: int, error: str) -> None:
    with _lock:
        first = not _state["warned"]
        _state["warned"] = True
    (log.warning if first else log.debug)(
        "stashpoint: could not pin %d bytes of staging memory (%s); copies from the GPU into it are "
        "synchronous until a later save's retry succeeds (SaveStats.staging_pinned says which)",
        nbytes,
        error,
    )


def pin(ptr: int, nbytes: int, device: int) -> bool:
    """Pin ``nbytes`` at ``ptr`` for asynchronous copies with CUDA device ``device``; False
    (logged) if CUDA refuses, with no CUDA error left behind for the training's next kernel."""
    try:
        drv = driver()
        if drv is not None:
            drv.register(ptr, nbytes, device)
        else:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            _runtime_call(lambda: cudart.cudaHostRegister(ptr, nbytes, _PORTABLE), "cudaHostRegister", device)
    except PinError as e:
        _warn(nbytes, str(e))  # not the exception: a kept log record would keep its frames alive
        return False
    return True


def unpin(ptr: int, device: int) -> None:
    """Undo :func:`pin` (failures are logged at debug level: at exit CUDA may be gone)."""
    try:
        drv = driver()
        if drv is not None:
            drv.unregister(ptr, device)
        else:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            _runtime_call(lambda: cudart.cudaHostUnregister(ptr), "cudaHostUnregister", device)
    except Exception as e:
        log.debug("stashpoint: unpinning staging memory failed: %s", e)
