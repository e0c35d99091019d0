"""Loads into CUDA tensors copy through a bounded ring of pinned buffers (``_load/pinring.py``):
its segment planning and copy loop, exercised on CPU targets here; a load into CUDA tensors
where a GPU is present."""

from __future__ import annotations

import pytest
import torch

import stashpoint
from stashpoint._core.reshard import Box
from stashpoint._load.manifest import read_manifest
from stashpoint._load.pinring import FLAT, ROWS, SLOT_BYTES, SLOTS, SYNC, Backend, PinnedRing, Segment, segments
from stashpoint._load.reads import execute_reads, fetch
from stashpoint._load.restoreplan import Read
from stashpoint._storage import LocalStorage


def test_a_contiguous_target_is_cut_into_flat_segments_of_at_most_a_slot():
    assert segments((10, 7), 4, True, 64) == [Segment(FLAT, b, min(b + 64, 280)) for b in range(0, 280, 64)]
    assert segments((16,), 4, True, 64) == [Segment(FLAT, 0, 64)]
    assert segments((), 8, True, 64) == [Segment(FLAT, 0, 8)]  # 0-dim: one flat segment
    assert segments((), 8, True, 4) == [Segment(FLAT, 0, 4), Segment(FLAT, 4, 8)]


def test_a_non_contiguous_target_is_cut_into_row_blocks_and_a_long_row_is_copied_whole():
    # rows of 7 * 4 = 28 bytes: two per 64-byte slot
    assert segments((5, 7), 4, False, 64) == [Segment(ROWS, 0, 2), Segment(ROWS, 2, 4), Segment(ROWS, 4, 5)]
    assert segments((3, 2, 2), 2, False, 1000) == [Segment(ROWS, 0, 3)]
    assert segments((3, 20), 4, False, 64) == [Segment(SYNC, 0, 240)]  # a row larger than a slot
    assert segments((), 4, False, 64) == [Segment(SYNC, 0, 4)]


def test_an_empty_piece_needs_no_segment():
    for contiguous in (True, False):
        assert segments((0, 7), 4, contiguous, 64) == []
        assert segments((7, 0), 4, contiguous, 64) == []


def _cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target, source) pairs: contiguous and non-contiguous views, several dtypes, some larger
    than the whole ring, a row larger than a slot, 0-dim and empty pieces."""
    torch.manual_seed(0)
    base = torch.zeros(60, 50, dtype=torch.float64)
    param = torch.nn.Parameter(torch.zeros(40, 30))
    cases = [
        (torch.zeros(1000, dtype=torch.float32), torch.randn(1000)),  # 4000 B: several turns of the ring
        (base[10:40, 5:45], torch.randn(30, 40, dtype=torch.float64)),  # a partial region: rows of 320 B
        (base[:, 45:], torch.randn(60, 5, dtype=torch.float64)),
        (torch.zeros(40, 33, dtype=torch.int64).t(), torch.randint(-(2**40), 2**40, (33, 40))),  # transposed
        (torch.zeros(300, dtype=torch.bool), torch.rand(300) > 0.5),
        (torch.zeros(17, 9, dtype=torch.bfloat16), torch.randn(17, 9).bfloat16()),
        (torch.zeros(6, 5, dtype=torch.complex64)[:, 1:4], torch.randn(6, 3, dtype=torch.complex64)),
        (torch.zeros(3, 40, dtype=torch.int16).t()[:, :2], torch.randint(0, 999, (40, 2), dtype=torch.int16)),
        (torch.zeros(2, 400)[:, ::2], torch.randn(2, 200)),  # a row of 800 B: larger than a slot
        (param[5:25, 3:13], torch.randn(20, 10)),  # a view of a parameter
        (torch.zeros(()), torch.tensor(2.5)),
        (torch.zeros(0, 4), torch.zeros(0, 4)),
    ]
    return cases


def test_pieces_go_through_the_ring_into_cpu_targets_and_the_slots_are_reused():
    ring = PinnedRing(3, 512, pin=False)
    kinds = {
        s.kind
        for t, src in _cases()
        for s in segments(tuple(src.shape), src.element_size(), t.is_contiguous() and not t.is_conj(), 512)
    }
    assert kinds == {FLAT, ROWS, SYNC}
    for load in range(2):
        cases = _cases()
        with ring.session():
            for target, src in cases:
                ring.copy(target, src)
        for target, src in cases:
            assert target.dtype == src.dtype and torch.equal(target.detach(), src), (target.shape, src.dtype)
        assert len(ring.buffers) == 3 and all(b.numel() == 512 for b in ring.buffers)
        if load == 0:
            first = [b.data_ptr() for b in ring.buffers]
    assert [b.data_ptr() for b in ring.buffers] == first  # the same memory, load after load


class _Event:
    def __init__(self, log: list[_Event]) -> None:
        self.done = False
        log.append(self)

    def synchronize(self) -> None:
        self.done = True


class _Recording(Backend):
    """Events that count as in flight until waited for."""

    def __init__(self) -> None:
        self.log: list[_Event] = []
        self.most = 0

    def event(self, device: torch.device) -> _Event:
        event = _Event(self.log)
        self.most = max(self.most, sum(not e.done for e in self.log))
        return event


def test_a_slot_is_refilled_only_after_its_last_copy_completed_and_a_load_waits_for_every_copy():
    backend = _Recording()
    ring = PinnedRing(4, 64, pin=False, backend=backend)
    target, src = torch.zeros(100, 8), torch.randn(100, 8)  # 3200 B: 50 segments
    with ring.session():
        ring.copy(target, src)
        assert len(backend.log) == 50
        assert backend.most <= 4 and sum(not e.done for e in backend.log) == 4
    assert all(e.done for e in backend.log) and ring.events == [None] * 4
    assert torch.equal(target, src)


def test_a_failing_copy_still_drains_the_ring():
    backend = _Recording()
    ring = PinnedRing(2, 64, pin=False, backend=backend)
    with pytest.raises(ValueError, match=r"\(4, 3\) tensor into a \(3, 4\)"), ring.session():
        ring.copy(torch.zeros(40), torch.randn(40))
        ring.copy(torch.zeros(3, 4), torch.randn(4, 3))  # shapes differ
    assert backend.log and all(e.done for e in backend.log)
    assert ring.lock.acquire(blocking=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("atomic", [False, True])
def test_loads_into_cuda_tensors_pin_no_more_than_the_ring(tmp_path, atomic):
    from stashpoint._load.pinring import ring

    torch.manual_seed(0)
    state = {
        "big": torch.randn(6000, 4096),  # 94 MiB: more than the whole ring
        "band": torch.randn(300, 104),
        "long": torch.randn(2, 5_000_000),  # rows of 20 MB, more than a slot
        "half": torch.randn(513, 77).bfloat16(),
        "count": torch.arange(1001, dtype=torch.int16),
        "scalar": torch.tensor(3.5),
    }
    stashpoint.save(state, tmp_path / "ck")
    cuda = torch.device("cuda")
    live = {
        "big": torch.empty(6000, 4096, device=cuda),
        "band": torch.empty(104, 300, device=cuda).t(),  # non-contiguous destinations
        "long": torch.empty(5_000_000, 2, device=cuda).t(),
        "half": torch.empty(513, 77, dtype=torch.bfloat16, device=cuda),
        "count": torch.empty(1001, dtype=torch.int16, device=cuda),
        "scalar": torch.empty((), device=cuda),
    }
    stats = getattr(torch.cuda, "host_memory_stats", None)
    pinned_before = stats().get("allocated_bytes.allocated") if stats is not None else None
    stashpoint.load(live, tmp_path / "ck", atomic=atomic)
    for key, value in state.items():
        assert torch.equal(live[key].cpu(), value), key

    # a partial region of a CUDA tensor, non-contiguous (a column band of a transposed tensor):
    # row blocks through the ring
    storage = LocalStorage(tmp_path / "ck")
    manifest = read_manifest(storage)
    region = Box((0, 1000), (6000, 2000))
    cols = torch.empty(2000, 6000, device=cuda).t()
    rows = torch.empty(3000, 4096, device=cuda)
    reads = [Read("big", cols, region), Read("big", rows, Box((1500, 0), (3000, 4096)))]
    if atomic:
        fetch(storage, manifest, reads, verify=True).land()
    else:
        execute_reads(storage, manifest, reads, verify=True)
    assert torch.equal(cols.cpu(), state["big"][:, 1000:3000])
    assert torch.equal(rows.cpu(), state["big"][1500:4500])

    kept = ring().buffers
    assert 0 < len(kept) <= SLOTS and all(b.is_pinned() and b.numel() == SLOT_BYTES for b in kept)
    if pinned_before is None:
        pytest.skip("this torch reports no pinned host memory statistics")
    grown = stats()["allocated_bytes.allocated"] - pinned_before
    assert grown <= SLOTS * SLOT_BYTES, f"the load pinned {grown} bytes"


@pytest.fixture
def slot_reads_on_the_cpu(monkeypatch):
    """Route whole pieces bound for contiguous CPU tensors through the slot reads, with a
    process ring of small pageable slots (the path CUDA targets take on a GPU)."""
    from stashpoint._load import reads
    from stashpoint._load.slotreads import SlotReads

    cpu_ring = PinnedRing(3, 8 << 20, pin=False)  # two slots for readers, 8 MiB = two checksum blocks
    monkeypatch.setattr(SlotReads, "device_type", "cpu")
    monkeypatch.setattr(reads, "_ring_for", lambda pieces: cpu_ring.session())
    return cpu_ring


def test_whole_pieces_read_straight_into_the_slots_land_bit_for_bit(tmp_path, slot_reads_on_the_cpu):
    g = torch.Generator().manual_seed(3)
    state = {
        "big": torch.randn(5 << 20, generator=g),  # 20 MiB: three segments, the last partial
        "exact": torch.randn(2 << 20, generator=g),  # one whole 8 MiB segment
        "small": torch.arange(100, dtype=torch.int16),
        "bf16": torch.randn(3, 1000, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "t": torch.randn(64, 32, generator=g),
    }
    stashpoint.save(state, tmp_path / "ck")
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    out["t"] = torch.zeros(32, 64).t()  # non-contiguous: the bounce path, beside the slot reads
    stashpoint.load(out, tmp_path / "ck")
    for k, v in state.items():
        assert torch.equal(out[k], v), k
    assert 1 <= len(slot_reads_on_the_cpu.buffers) <= 3, "the slots were used, no more than the ring has"
    assert not slot_reads_on_the_cpu.held


def test_a_damaged_block_read_into_a_slot_is_caught_and_named(tmp_path, slot_reads_on_the_cpu):
    state = {"big": torch.randn(5 << 20), "other": torch.ones(10)}
    stashpoint.save(state, tmp_path / "ck")
    storage = LocalStorage(tmp_path / "ck")
    manifest = read_manifest(storage)
    chunk = manifest.tensors["big"].chunks[0]
    path = tmp_path / "ck" / chunk.file
    with open(path, "r+b") as f:  # one byte in the third 4 MiB block of the tensor
        f.seek(chunk.start + 9 * (1 << 20))
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(stashpoint.CorruptCheckpointError, match="'big'"):
        stashpoint.load(out, tmp_path / "ck")
    assert not slot_reads_on_the_cpu.held, "every slot given back after the failure"
