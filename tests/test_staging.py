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
