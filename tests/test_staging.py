"""The staging pool: touched memory is reused across saves, memory never grows."""

from __future__ import annotations

from stashpoint._core.plan import TensorSpec, plan_files
from stashpoint._save.staging import StagingPool


def test_pool_reuses_memory_for_a_new_layout_of_the_same_size_and_allocates_when_too_small():
    specs = tuple(TensorSpec(f"t{i}", "float32", (1000,), 4) for i in range(4))
    first = plan_files(specs, max_file_bytes=1 << 30)
    second = plan_files(specs, max_file_bytes=8000)  # the same tensors in two files
    assert first != second and len(second.files) == 2
    pool = StagingPool()
    a = pool.acquire(first, specs, pin_device=None)
    ptr = a.buffer.data_ptr()
    pool.release(a)
    b = pool.acquire(second, specs, pin_device=None)
    assert b.buffer.data_ptr() == ptr, "a new layout of the same tensors reuses the touched pages"
    assert b.views["t2"].data_ptr() % 4096 == 0, "each file's region starts page-aligned"
    pool.release(b)
    big = tuple(TensorSpec(f"t{i}", "float32", (100_000,), 4) for i in range(4))
    d = pool.acquire(plan_files(big, max_file_bytes=1 << 30), big, pin_device=None)
    assert d.buffer.numel() >= 1_600_000, "too small to reuse: fresh memory, the idle buffer dropped"
    assert pool._free == [] and pool.allocations == 2


def test_a_layout_with_more_padding_still_reuses_the_touched_buffer():
    """A fresh buffer has room for a few more files than its first layout: splitting the same
    tensors into more files adds padding, and must not cost first touch of fresh memory again."""
    from stashpoint._save.staging import _layout_bytes

    specs = tuple(TensorSpec(f"t{i}", "float32", (1025,), 4) for i in range(3))  # 4,100 bytes each
    first = plan_files(specs, max_file_bytes=1 << 30)
    second = plan_files(specs, max_file_bytes=4100)  # a file each
    assert _layout_bytes(second) > _layout_bytes(first), "the split layout needs more room"
    pool = StagingPool()
    a = pool.acquire(first, specs, pin_device=None)
    ptr = a.buffer.data_ptr()
    pool.release(a)
    b = pool.acquire(second, specs, pin_device=None)
    assert b.buffer.data_ptr() == ptr, "fresh memory for a re-plan of the same tensors"
    assert b.plan == second and pool._free == [] and pool.allocations == 1


def _allocated(region) -> int:
    """Bytes of memory the region's memory file holds (its pages, not its size)."""
    import os

    return os.fstat(region.fd).st_blocks * 512


def test_a_much_larger_idle_buffer_is_reused_and_gives_back_what_the_smaller_plan_does_not_need():
    """A distributed save copies every tensor the first time and only the rank's own part from
    the second save on: the touched buffer of the first is reused (no first touch again), and
    the pages past what the second needs are returned to the system, in the writer process too."""
    import mmap

    import pytest

    if not hasattr(mmap, "MADV_REMOVE"):
        pytest.skip("MADV_REMOVE is Linux-only")
    specs = tuple(TensorSpec(f"t{i}", "float32", (250_000,), 4) for i in range(4))  # 1 MB each
    whole = plan_files(specs, max_file_bytes=1 << 30)
    half = plan_files(specs[:2], max_file_bytes=1 << 30)
    pool = StagingPool()
    a = pool.acquire(whole, specs, pin_device=None)
    a.buffer.fill_(7)  # touched, as a save's copies touch it
    region, ptr = a.region, a.buffer.data_ptr()
    assert region is not None and _allocated(region) >= 4_000_000
    pool.release(a)
    b = pool.acquire(half, specs[:2], pin_device=None)
    assert b.buffer.data_ptr() == ptr and pool.allocations == 1, "the touched pages are reused"
    assert b.views["t1"].min().item() != 0, "what the smaller plan uses keeps its pages"
    assert b.trim_to is not None and _allocated(region) >= 4_000_000, "given back later, not in the call"
    b.trim()  # as the persist does, in the background
    assert _allocated(region) < 2_200_000, "the rest is given back"
    assert b.resident < 2_200_000 <= b.nbytes
    b.views["t1"].fill_(1.5)
    pool.release(b)
    c = pool.acquire(whole, specs, pin_device=None)  # the whole state again (the structure changed)
    assert c.buffer.data_ptr() == ptr and pool.allocations == 1, "the mapping is still large enough"
    assert c.views["t3"].abs().max().item() == 0, "given-back pages come back as zeros"
    c.views["t3"].fill_(3.0)
    assert c.resident >= 4_000_000, "what the plan uses counts as held again"


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

    from stashpoint._save import staging as _staging

    specs = (TensorSpec("t", "float32", (300_000,), 4),)
    pool = StagingPool()
    drops: list[int] = []
    pool.on_drop = lambda: drops.append(len(_staging.freed))
    monkeypatch.setattr(_staging, "report_freed", True)  # as once a writer process runs
    a = pool.acquire(plan_files(specs, max_file_bytes=1 << 30), specs, pin_device=None)
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
    b = pool.acquire(plan_files(big, max_file_bytes=1 << 30), big, pin_device=None)
    gc.collect()
    assert drops and token in _staging.freed, "the dropped buffer is reported, for the writer process to unmap"
    assert _memfds(token) == [], "its descriptors are closed"
    assert b.region is not None and b.region.token != token


def test_a_pool_that_keeps_two_buffers_keeps_each_structure_its_own():
    """Two managers' states (a GAN's generator and discriminator): before, the small save took
    the large one's idle buffer and trimmed it, and the large one's next save touched all its
    memory anew on the training's thread."""
    big = tuple(TensorSpec(f"g{i}", "float32", (100_000,), 4) for i in range(4))
    small = tuple(TensorSpec(f"d{i}", "float32", (1000,), 4) for i in range(4))
    plan_big, plan_small = plan_files(big, max_file_bytes=1 << 30), plan_files(small, max_file_bytes=1 << 30)
    pool = StagingPool(max_free=2)
    a = pool.acquire(plan_big, big, pin_device=None)
    ptr = a.buffer.data_ptr()
    pool.release(a)
    for _ in range(3):
        b = pool.acquire(plan_small, small, pin_device=None)
        assert b.buffer.data_ptr() != ptr and b.trim_to is None
        pool.release(b)
        a = pool.acquire(plan_big, big, pin_device=None)
        assert a.buffer.data_ptr() == ptr and a.trim_to is None, "the large state's own touched buffer"
        pool.release(a)
    assert pool.allocations == 2 and len(pool._free) == 2
    b = pool.acquire(plan_small, small, pin_device=None)
    pool.release(b)  # the large state's manager saved before the small one's, which now closes:
    pool.keep_at_most(1)  # the buffer to keep is the one the next save (the large state's) takes
    a = pool.acquire(plan_big, big, pin_device=None)
    assert a.buffer.data_ptr() == ptr and pool.allocations == 2
    pool.release(a)
    assert [f.buffer.data_ptr() for f in pool._free] == [ptr]


def test_a_pool_that_keeps_two_buffers_still_trims_one_for_a_part_of_its_tensors():
    """A DDP rank copies every replicated tensor at its first save and its own part from the
    second on: the first buffer is taken and trimmed, with room in the pool or not."""
    full = tuple(TensorSpec(f"t{i}", "float32", (100_000,), 4) for i in range(8))
    part = full[:2]
    pool = StagingPool(max_free=2)
    a = pool.acquire(plan_files(full, max_file_bytes=1 << 30), full, pin_device=None)
    ptr = a.buffer.data_ptr()
    pool.release(a)
    b = pool.acquire(plan_files(part, max_file_bytes=1 << 30), part, pin_device=None)
    assert b.buffer.data_ptr() == ptr and b.trim_to is not None and pool.allocations == 1
