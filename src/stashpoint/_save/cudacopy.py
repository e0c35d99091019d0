"""Copying the live state into staging views: CPU sources here, CUDA ones on a side stream.

Each device's copies run on its side stream, ordered after the work queued on the current
stream at the time of the save (so they see the values at the call), and end with a
blocking-sync event (a thread waiting on it sleeps instead of spinning a core). Small CUDA
tensors that sit next to each other in a staging buffer are gathered on the device into one
scratch run (one multi-tensor kernel) and copied to the host in one transfer: thousands of
small tensors (MoE experts, norms, biases) then cost a few launches, not a Python-level copy
each. A gathered run overwrites the padding between its tensors with zeros, so nothing but
its own tensors may lie in its span: every other destination of the save is a *fence*.

A run is checked against the sorted start addresses of all the save's destinations (made once
per staging layout) with two bisections: no per-save cost that grows with the other tensors.

The sources are kept alive by the caller until the copies end (the blocking call waits for
them; overlap mode holds them until its events complete), and work queued on the current
stream later waits for them where it could change them, so no ``record_stream`` is needed.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping, Sequence

import torch

from stashpoint._save.staging import side_stream
from stashpoint.errors import CheckpointError

Pair = tuple[torch.Tensor, torch.Tensor]  # (live source, staging view)

SMALL = 1 << 20  # a tensor up to this size may be gathered with its neighbours
RUN = 32 << 20  # at most this many bytes per gathered run (device scratch memory)
GAP = 4096  # neighbours at most this far apart (alignment padding) join one run

Item = tuple[int, int, int, str]  # (buffer, start address, bytes, "small" | "large" | "fence")


def cuda_device(tensors: Iterable[torch.Tensor]) -> int | None:
    """The index of the first CUDA device among ``tensors`` (what staging is pinned for), or None."""
    if not torch.cuda.is_available():
        return None
    for t in tensors:
        if t.device.type == "cuda":
            return t.device.index if t.device.index is not None else torch.cuda.current_device()
    return None


def refuse_capture(devices: Iterable[torch.device]) -> None:
    """Raise if a CUDA graph is being captured on the current stream of one of ``devices``:
    a save's copies and waits would break the capture (or be captured and never run)."""
    for device in {d for d in devices if d.type == "cuda"}:
        with torch.cuda.device(device):
            capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            raise CheckpointError(
                f"a CUDA graph is being captured on {device}: a checkpoint cannot be saved inside a captured "
                "region. Save before torch.cuda.graph(...) begins or after it ends."
            )


def plan_runs(items: Sequence[Item]) -> tuple[list[list[int]], list[int]]:
    """``(runs, singles)``: indices of the copies to gather and of those to copy one by one.

    A run is two or more "small" items adjacent in the same buffer, each within :data:`GAP`
    bytes after the previous one ends, no other item (a "large" copy or a "fence") in between,
    spanning at most :data:`RUN` bytes. Fences are never returned.
    """
    order = sorted(range(len(items)), key=lambda i: (items[i][0], items[i][1]))
    runs: list[list[int]] = []
    singles: list[int] = []
    cur: list[int] = []

    def flush() -> None:
        (runs.append(list(cur)) if len(cur) > 1 else singles.extend(cur))
        cur.clear()

    for i in order:
        buf, start, n, kind = items[i]
        if cur:
            b0, s0, _, _ = items[cur[0]]
            _, sl, nl, _ = items[cur[-1]]
            if kind != "small" or buf != b0 or not 0 <= start - (sl + nl) <= GAP or start + n - s0 > RUN:
                flush()
        if kind == "small":
            cur.append(i)
        elif kind == "large":
            singles.append(i)
    flush()
    return runs, singles


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _gatherable(src: torch.Tensor, dst: torch.Tensor) -> bool:
    n = _nbytes(src)
    return (
        0 < n <= SMALL
        and src.dtype == dst.dtype
        and src.is_contiguous()
        and dst.is_contiguous()
        and dst.device.type == "cpu"
        and not src.is_complex()
        and not src.is_conj()
        and not src.is_neg()
    )


def copy_pairs(pairs: Sequence[Pair], fences: Sequence[int] | None = None) -> None:
    """Queue every copy on the current stream, gathering small neighbours (see the module
    docstring). ``fences``: the sorted start addresses of every non-empty destination of the save
    (:attr:`StagingBuffers.starts`); a run is gathered only if no other destination starts inside
    its span. None: ``pairs`` are all the destinations there are. Works for any source device
    (CPU sources make it synchronous: the tests use that)."""
    if fences is None:
        fences = sorted(d.data_ptr() for _, d in pairs if _nbytes(d))
    items: list[Item] = []
    for src, dst in pairs:
        kind = "small" if _gatherable(src, dst) else "large"
        items.append((dst.untyped_storage().data_ptr(), dst.data_ptr(), _nbytes(dst), kind))
    runs, singles = plan_runs(items)
    for run in runs:
        for part in _split_at_fences(run, items, fences):
            if len(part) > 1:
                _gather([pairs[i] for i in part])
            else:
                singles.extend(part)
    for i in singles:
        src, dst = pairs[i]
        dst.copy_(src, non_blocking=True)


def _split_at_fences(run: list[int], items: Sequence[Item], fences: Sequence[int]) -> list[list[int]]:
    """Cut ``run`` wherever another destination starts between two of its members (the
    destinations never overlap, so nothing else can start inside a member)."""
    parts: list[list[int]] = [[run[0]]]
    for prev, cur in itertools.pairwise(run):
        between = bisect.bisect_left(fences, items[cur][1]) - bisect.bisect_left(fences, items[prev][1])
        if between != 1:  # more starts than ``prev``'s own: someone else's bytes lie in between
            parts.append([])
        parts[-1].append(cur)
    return parts


def _gather(run: list[Pair]) -> None:
    """Copy adjacent small tensors with one gather on the device and one transfer to the host."""
    start = run[0][1].data_ptr()
    span = run[-1][1].data_ptr() + _nbytes(run[-1][1]) - start
    scratch = torch.zeros(span, dtype=torch.uint8, device=run[0][0].device)  # padding lands as zeros
    outs = [scratch[d.data_ptr() - start : d.data_ptr() - start + _nbytes(d)] for _, d in run]
    torch._foreach_copy_(outs, [s.reshape(-1).view(torch.uint8) for s, _ in run])
    storage = run[0][1].untyped_storage()
    host = torch.empty(0, dtype=torch.uint8).set_(storage, start - storage.data_ptr(), (span,), (1,))
    host.copy_(scratch, non_blocking=True)


def launch_cuda(
    pairs: Sequence[Pair],
    *,
    after: Mapping[torch.device, torch.cuda.Event] | None = None,
    fences: Sequence[int] | None = None,
) -> list[tuple[torch.device, torch.cuda.Event]]:
    """Queue the copies of CUDA sources without waiting for them; return one event per device.

    Each device's copies run on its side stream after ``after[device]`` (an event recorded on
    the current stream at the time of the save, when the copies are launched later from
    another thread) or else after the work queued on the current stream now.
    """
    by_device: dict[torch.device, list[Pair]] = {}
    for src, dst in pairs:
        by_device.setdefault(src.device, []).append((src, dst))
    events = []
    used: list[torch.cuda.Stream] = []
    try:
        for device, items in by_device.items():
            stream = side_stream(device)
            used.append(stream)
            if after is not None and device in after:
                stream.wait_event(after[device])
            else:
                stream.wait_stream(torch.cuda.current_stream(device))
            # the device first: leaving a stream context on a thread whose current device is
            # another (the copy thread's is 0) sets that device, making a context on GPU 0
            with torch.cuda.device(device), torch.cuda.stream(stream):
                copy_pairs(items, fences)
                event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                event.record(stream)
            events.append((device, event))
    except BaseException:
        # copies queued before the failure (a gather's scratch out of GPU memory) still run into
        # the staging buffers, which the caller hands back to the pool once this raises
        for stream in used:
            try:
                stream.synchronize()
            except Exception:  # noqa: S112 - the launch's error is the one to report
                continue
        raise
    return events


def mark_now(devices: Iterable[torch.device]) -> dict[torch.device, torch.cuda.Event]:
    """An event on each device's current stream: "the work queued so far" (for :func:`launch_cuda`)."""
    out = {}
    for device in set(devices):
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        out[device] = event
    return out


def stage(pairs: Sequence[Pair], fences: Sequence[int] | None = None) -> None:
    """Copy each ``(source, staging view)`` pair; returns once every copy has completed.
    ``fences``: as for :func:`copy_pairs`."""
    cuda = []
    for src, dst in pairs:
        if src.is_cuda:  # an attribute: ``device.type`` makes a device object per tensor
            cuda.append((src, dst))
        else:
            dst.copy_(src)
    if cuda:
        for _, event in launch_cuda(cuda, fences=fences):
            event.synchronize()
