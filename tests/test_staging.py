"""The staging pool: touched memory is reused across saves, memory never grows."""

from __future__ import annotations

from stashpoint._plan import TensorSpec, plan_files, plan_staging
from stashpoint._staging import StagingPool


def test_pool_reuses_memory_for_a_new_layout_of_the_same_size_and_drops_it_otherwise():
    specs = tuple(TensorSpec(f"t{i}", "float32", (1000,), 4) for i in range(4))
    first = plan_files(specs, max_file_bytes=1 << 30)
    second = plan_staging(specs, frozenset({"t1", "t3"}), max_file_bytes=1 << 30)
    assert first != second and len(second.files) == 2
    pool = StagingPool()
    a = pool.acquire(first, specs, pinned=False)
    ptr = a.buffer.data_ptr()
    pool.release(a)
    b = pool.acquire(second, specs, pinned=False)
    assert b.buffer.data_ptr() == ptr, "a distributed save's second layout reuses the touched pages"
    assert b.views["t1"].data_ptr() == ptr, "the files of what the rank writes come first"
    assert b.views["t0"].data_ptr() % 4096 == 0, "each file's region starts page-aligned"
    pool.release(b)
    c = pool.acquire(first, specs, pinned=False)
    pool.release(c)
    big = tuple(TensorSpec(f"t{i}", "float32", (100_000,), 4) for i in range(4))
    d = pool.acquire(plan_files(big, max_file_bytes=1 << 30), big, pinned=False)
    assert d.buffer.numel() >= 1_600_000, "too small to reuse: fresh memory, the idle buffer dropped"
    assert pool._free == []


def test_a_second_layout_with_more_padding_still_reuses_the_touched_buffer():
    """A distributed save's first layout (nobody knows who writes what) against the next one
    (the rank's own files first): splitting the files adds padding, and the buffer of the first
    must still take the second, or every 2-rank run pays first-touch of fresh memory again."""
    from stashpoint._staging import _layout_bytes

    specs = tuple(TensorSpec(f"t{i}", "float32", (1025,), 4) for i in range(3))  # 4,100 bytes each
    first = plan_files(specs, max_file_bytes=1 << 30)
    second = plan_staging(specs, frozenset({"t0"}), max_file_bytes=1 << 30)
    assert _layout_bytes(second) > _layout_bytes(first), "the split layout needs more room"
    pool = StagingPool()
    a = pool.acquire(first, specs, pinned=False)
    ptr = a.buffer.data_ptr()
    pool.release(a)
    b = pool.acquire(second, specs, pinned=False)
    assert b.buffer.data_ptr() == ptr, "fresh memory for a re-plan of the same tensors"
    assert b.plan == second and pool._free == []


def _memfds(token: int) -> list[int]:
    """This process's descriptors of the staging region ``token``."""
    import os

    name = f"/memfd:stashpoint-staging-{token} "
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if (os.readlink(f"/proc/self/fd/{fd}") + " ").startswith(name):
                found.append(int(fd))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return found


def test_buffers_are_shared_memory_whose_descriptors_go_when_the_pool_drops_them(monkeypatch):
    import gc

    from stashpoint import _staging

    specs = (TensorSpec("t", "float32", (300_000,), 4),)
    pool = StagingPool()
    drops: list[int] = []
    pool.on_drop = lambda: drops.append(len(_staging.freed))
    monkeypatch.setattr(_staging, "report_freed", True)  # as once a writer process runs
    a = pool.acquire(plan_files(specs, max_file_bytes=1 << 30), specs, pinned=False)
    region = a.region
    assert region is not None, "memfd shared memory where the OS has it"
    token = region.token
    assert region.fd in _memfds(token), "a descriptor kept to hand to the writer process"
    assert a.buffer.data_ptr() % 4096 == 0 and a.nbytes >= 1_200_000
    a.views["t"].fill_(2.5)
    assert bytes(region.memoryview()[:4]) == a.views["t"][:1].numpy().tobytes(), "one memory, no copy"
    del region
    pool.release(a)
    del a
    big = (TensorSpec("t", "float32", (3_000_000,), 4),)
    b = pool.acquire(plan_files(big, max_file_bytes=1 << 30), big, pinned=False)
    gc.collect()
    assert drops and token in _staging.freed, "the dropped buffer is reported, for the writer process to unmap"
    assert _memfds(token) == [], "its descriptors are closed"
    assert b.region is not None and b.region.token != token
