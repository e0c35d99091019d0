"""Host staging buffers: allocated once per state structure, reused by later saves.

A buffer is page-aligned shared memory: an anonymous memory file (``memfd_create``) mapped
``MAP_SHARED``, so that the writer process (``_writerproc``) can map the same pages from the
file descriptor and write the staged bytes without a copy, and shard writes can use direct I/O
from it. The first save of a structure pays for touching fresh memory; later saves copy into
touched pages at memory bandwidth. When any tensor lives on a CUDA device the buffers are
pinned in place (``cudaHostRegister``), and copies run on a side stream.

Where ``memfd_create`` is missing (not Linux) the buffer is private anonymous memory, pinned by
torch's allocator on CUDA, and saves use the writer thread.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import mmap
import os
import resource
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stashpoint import _runtime
from stashpoint._core.plan import SavePlan, TensorSpec
from stashpoint._save.pinning import pin, unpin
from stashpoint._state.dtypes import as_memoryview, torch_dtype
from stashpoint.errors import CheckpointError

log = logging.getLogger("stashpoint")

_PAGE = 4096


def _release(fd: int, ptr: int, pinned_on: list[int], token: int) -> None:
    """Finalizer of a :class:`SharedRegion`: unpin, close the descriptor, tell the writer process."""
    for device in pinned_on:
        unpin(ptr, device)
    os.close(fd)
    if report_freed:
        freed.append(token)


#: Tokens of regions freed since the writer process last heard of it (it unmaps them); kept
#: once a writer process has been started (``report_freed``).
freed: list[int] = []
report_freed = False
_tokens = itertools.count(1)


class SharedRegion:
    """``nbytes`` of page-aligned ``MAP_SHARED`` memory backed by an anonymous memory file.

    ``fd`` is what another process maps to see the same pages; ``token`` names the region in
    messages to it. With ``pin_device`` the pages are registered with CUDA (page-locked) for
    that device and unregistered when the region is freed; :attr:`pinned` says whether that
    worked. The mapping itself lives as long as any tensor made from :attr:`mm` does; the
    descriptor is closed (and the pages unpinned) when the region is dropped.
    """

    def __init__(self, nbytes: int, pin_device: int | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"a shared region needs a positive size, got {nbytes}")
        self.token = next(_tokens)
        self.nbytes = nbytes
        fd = os.memfd_create(f"stashpoint-staging-{self.token}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException as e:
            os.close(fd)
            if isinstance(e, OSError) and e.errno == errno.EFBIG:  # a memory file counts as a file
                limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
                raise CheckpointError(
                    f"staging a save needs {nbytes:,} bytes of memory held in a memory file, more than this "
                    f"process's file-size limit allows ({limit:,} bytes: ulimit -f); raise the limit "
                    "(ulimit -f unlimited) or save less state at once"
                ) from None
            raise
        self.fd = fd
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.pin_device = pin_device
        self._pinned_on: list[int] = []  # the device it is registered for, once it is
        self.resident = nbytes  # the first bytes that may hold pages (see trim)
        finalizer = weakref.finalize(self, _release, fd, self.tensor.data_ptr(), self._pinned_on, self.token)
        finalizer.atexit = False  # the process is ending: nothing to unpin or tell
        self.repin()

    @property
    def pinned(self) -> bool:
        """Whether the pages are registered with CUDA (page-locked) now."""
        return bool(self._pinned_on)

    def repin(self) -> bool:
        """Try to pin the region if it was to be pinned and is not (an earlier try failed)."""
        device = self.pin_device
        if device is not None and not self._pinned_on and pin(self.tensor.data_ptr(), self.nbytes, device):
            self._pinned_on.append(device)
        return self.pinned

    def memoryview(self) -> memoryview:
        """A writable byte view of the whole region (no copy)."""
        return memoryview(self.mm)

    @property
    def trimmable(self) -> bool:
        """Whether :meth:`trim` can give pages back: not for pinned memory (the device's mapping
        would keep the old pages), nor without ``MADV_REMOVE`` (not Linux)."""
        return not self.pinned and hasattr(mmap, "MADV_REMOVE")

    def trim(self, keep: int) -> None:
        """Give the pages past the first ``keep`` bytes back to the system (``MADV_REMOVE``: the
        mapping stays, in the writer process too; those bytes read as zeros and cost first touch
        if used again). About 0.2 s per GB here, so it runs in the background."""
        keep = -(-keep // mmap.PAGESIZE) * mmap.PAGESIZE
        if keep >= self.resident or not self.trimmable:
            return
        try:
            self.mm.madvise(mmap.MADV_REMOVE, keep, self.nbytes - keep)
        except OSError as e:  # the memory is only kept longer
            log.debug("stashpoint: could not trim a staging buffer: %s", e)
            return
        self.resident = keep


def _host_buffer(nbytes: int, pin_device: int | None) -> tuple[torch.Tensor, SharedRegion | None]:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8), None
    if hasattr(os, "memfd_create"):
        region = SharedRegion(nbytes, pin_device)
        return region.tensor, region
    if pin_device is not None:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None
    # Page-aligned anonymous memory, so shard writes can use direct I/O straight from it.
    # No transparent huge pages: their first touch is slower (the kernel compacts memory).
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=torch.uint8), None


def _layout_bytes(plan: SavePlan) -> int:
    """Bytes of one buffer holding every file's data, each file starting page-aligned."""
    return sum(-(-f.data_size // _PAGE) * _PAGE for f in plan.files)


def _alloc_bytes(plan: SavePlan) -> int:
    """What a fresh buffer for ``plan`` gets: its layout plus room for a few more files.

    The same tensors laid out into more files (another split of what a rank writes, another
    ``max_shard_bytes``) take up to a page of padding more per file. Without this room such a
    layout would not fit the touched buffer and would take fresh memory (first touch: a second
    or more per GB here) once more.
    """
    return _layout_bytes(plan) + (len(plan.files) + 16) * _PAGE


@dataclass
class StagingBuffers:
    """One host buffer holding the data of every shard file of a plan (each file's region
    page-aligned), and typed views of each tensor's bytes in it.

    ``region`` is the shared memory behind ``buffer`` (None where there is none: an empty
    buffer, or no ``memfd_create``); ``offsets`` is where each view starts in ``buffer``.
    ``pin_device`` is the CUDA device the buffer is to be pinned for (None: pageable);
    :attr:`pinned` says whether it is.
    """

    plan: SavePlan
    specs: tuple[TensorSpec, ...]
    pin_device: int | None
    buffer: torch.Tensor
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    region: SharedRegion | None = None
    offsets: dict[str, int] = field(default_factory=dict)
    trim_to: int | None = None  # pages past this are to be given back (see :meth:`trim`)
    shrink: bool = False  # pinned and much larger than its layout: replaced on release

    @property
    def pinned(self) -> bool:
        """Whether the buffer is page-locked now (pinning can fail; then copies are synchronous)."""
        if self.region is not None:
            return self.region.pinned
        return self.pin_device is not None and self.buffer.numel() > 0 and self.buffer.is_pinned()

    def repin(self) -> bool:
        """Retry pinning a buffer that was to be pinned and is not."""
        return self.region.repin() if self.region is not None else self.pinned

    def trim(self) -> None:
        """Give back the pages this layout does not use, if the pool asked for it (the persist
        calls this in the background: it takes a while, and nothing reads those pages)."""
        if self.trim_to is not None and self.region is not None:
            self.region.trim(self.trim_to)
        self.trim_to = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @functools.cached_property
    def starts(self) -> tuple[int, ...]:
        """The sorted start addresses of the non-empty views (gathered copies check against them)."""
        base = self.buffer.data_ptr()
        return tuple(sorted(base + off for key, off in self.offsets.items() if self.views[key].numel()))

    @property
    def resident(self) -> int:
        """The bytes of the buffer that may hold memory (less than ``nbytes`` once trimmed)."""
        return self.region.resident if self.region is not None else self.nbytes

    def memoryview(self) -> memoryview:
        """A writable byte view of the whole buffer (no copy)."""
        return self.region.memoryview() if self.region is not None else as_memoryview(self.buffer)

    @classmethod
    def allocate(cls, plan: SavePlan, specs: tuple[TensorSpec, ...], pin_device: int | None) -> StagingBuffers:
        buffer, region = _host_buffer(_alloc_bytes(plan), pin_device)
        return cls.layout(buffer, plan, specs, pin_device, region)

    @classmethod
    def layout(
        cls,
        buffer: torch.Tensor,
        plan: SavePlan,
        specs: tuple[TensorSpec, ...],
        pin_device: int | None,
        region: SharedRegion | None = None,
    ) -> StagingBuffers:
        """Lay ``plan`` out in ``buffer`` (at least :func:`_layout_bytes` long)."""
        by_key = {s.key: s for s in specs}
        views: dict[str, torch.Tensor] = {}
        offsets: dict[str, int] = {}
        base = 0
        for f in plan.files:
            for p in f.placements:
                spec = by_key[p.key]
                dtype = torch_dtype(spec.dtype, p.key)
                views[p.key] = buffer[base + p.begin : base + p.end].view(dtype).reshape(spec.shape)
                offsets[p.key] = base + p.begin
            base += -(-f.data_size // _PAGE) * _PAGE
        return cls(plan, specs, pin_device, buffer, views, region, offsets)


_reserved: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()  # open managers' max_inflight


def reserve(owner: object, saves: int) -> None:
    """An open manager's saves keep a buffer each idle between saves (its ``max_inflight``): two
    managers of different states (a GAN's) each reuse their own instead of taking and trimming
    the other's, which the next save of the other then touches anew on the training's thread."""
    _reserved[owner] = saves


def unreserve(owner: object) -> int:
    """The manager closed: the idle buffers still to keep, those of the managers left (at least one)."""
    _reserved.pop(owner, None)
    return reserved()


def reserved() -> int:
    return max(1, sum(_reserved.values()))


class StagingPool:
    """Keeps idle staging memory for reuse (at most ``max_free`` buffers).

    A buffer laid out for the same plan is reused as is. Otherwise an idle buffer that is large
    enough is laid out anew: its pages are already touched, which is what makes a copy fast. If
    it holds much more than the plan needs (a distributed save's second plan copies only what
    the rank writes), the pages past what the plan needs are to be given back
    (:meth:`StagingBuffers.trim`, which the persist calls). Pinned memory cannot be trimmed
    (the device's mapping keeps the pages): a pinned buffer that is too large is used as is and
    replaced by one of the right size when it is released, off the training's path (a DDP
    run's first save copies every replicated tensor, later ones only what the rank writes).
    Only when none fits is fresh memory allocated, and idle buffers are dropped first so memory
    never grows past ``max_free`` idle buffers and those in use. Where the pool may keep several
    (several managers open), a buffer of another structure that would be trimmed is kept for
    it, not taken. A buffer to be pinned whose pinning failed is pinned again when reused.

    ``on_drop`` is called (outside the pool's lock) after idle buffers were dropped: the engine
    uses it to have the writer process unmap them at once, so that their memory is returned.
    """

    def __init__(self, max_free: int = 1) -> None:
        self.max_free = max_free
        self._free: list[StagingBuffers] = []
        self._lock = threading.Lock()
        self.on_drop: Callable[[], None] | None = None
        self.allocations = 0  # fresh buffers allocated so far (each pays first touch)

    def _dropped(self) -> None:
        if self.on_drop is not None:
            self.on_drop()

    def acquire(self, plan: SavePlan, specs: tuple[TensorSpec, ...], pin_device: int | None) -> StagingBuffers:
        """Buffers laid out for ``plan`` and ``specs``, pinned for ``pin_device`` if it is set."""
        got = self._reuse(plan, specs, pin_device)
        if got is not None:
            if pin_device is not None and not got.pinned:
                got.repin()
            return got
        log.debug("stashpoint: allocating %d bytes of fresh staging memory", _alloc_bytes(plan))
        return StagingBuffers.allocate(plan, specs, pin_device)

    def _reuse(self, plan: SavePlan, specs: tuple[TensorSpec, ...], pin_device: int | None) -> StagingBuffers | None:
        need = _layout_bytes(plan)
        want_pin = pin_device is not None
        with self._lock:
            for i, b in enumerate(self._free):
                if b.plan == plan and b.specs == specs and (b.pin_device is not None) == want_pin:
                    return self._free.pop(i)
            room = len(self._free) < self.max_free  # the pool may keep one more idle buffer
            for i, b in enumerate(self._free):
                if (b.pin_device is not None) != want_pin or need > b.nbytes:
                    continue
                too_big = b.resident > _alloc_bytes(plan) + need // 4
                if too_big and room and not _within(specs, b.specs):  # another structure's (another manager's)
                    continue  # kept for it; a part of the same tensors (DDP's later plans) takes and trims it
                old = self._free.pop(i)
                if old.region is not None:
                    old.region.resident = max(old.region.resident, need)
                new = StagingBuffers.layout(old.buffer, plan, specs, old.pin_device, old.region)
                trimmable = old.region is not None and old.region.trimmable
                new.trim_to = _alloc_bytes(plan) if too_big and trimmable else None
                new.shrink = too_big and not trimmable
                return new
            # memory never grows past what the pool keeps: the oldest idle buffers go first
            drop = max(0, len(self._free) - (self.max_free - 1))
            dropped = drop > 0
            del self._free[:drop]
            self.allocations += 1
        if dropped:
            self._dropped()
        return None

    def keep_at_most(self, n: int) -> None:
        """Keep at most ``n`` idle buffers from now on: those beyond go as the next save releases
        its own (the least recently used first), not now, when the oldest may be the buffer of
        the manager that saves next."""
        with self._lock:
            self.max_free = max(1, n)

    def release(self, buffers: StagingBuffers) -> None:
        if buffers.shrink:  # replaced by a buffer of the right size here, not in the next save's call
            buffers.shrink = False
            log.debug("stashpoint: replacing a %d-byte pinned staging buffer by one for its layout", buffers.nbytes)
            buffers = StagingBuffers.allocate(buffers.plan, buffers.specs, buffers.pin_device)
            with self._lock:
                self.allocations += 1
            self._dropped()
        with self._lock:
            self._free.append(buffers)
            extra = max(0, len(self._free) - self.max_free)
            del self._free[:extra]
        if extra:
            self._dropped()


def _within(specs: tuple[TensorSpec, ...], held: tuple[TensorSpec, ...]) -> bool:
    """Whether every tensor of ``specs`` is one of ``held``'s (a plan of part of the same state)."""
    keys = {s.key for s in held}
    return all(s.key in keys for s in specs)


def _streams() -> dict[torch.device, torch.cuda.Stream]:
    return _runtime.slot("save.cuda_streams", dict)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream stashpoint's copies with ``device`` run on (one per device, made once)."""
    streams = _streams()
    if device not in streams:
        streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    return streams[device]
