"""The pipelined read path (used for CUDA destinations: pinned buffers, each piece copied to the
device as soon as it is read and verified), exercised here on CPU destinations."""

from __future__ import annotations

import pytest
import torch

import stashpoint
from stashpoint._core.reshard import Box
from stashpoint._load.manifest import read_manifest
from stashpoint._load.reads import _execute_pipelined, plan_pieces
from stashpoint._load.restoreplan import Read
from stashpoint._storage import LocalStorage

CHECKSUM_BLOCK = 4 * 1024 * 1024


def _checkpoint(tmp_path):
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(300, 97 + i) for i in range(12)}  # several shards, many pieces
    stashpoint.save(state, tmp_path / "ck", max_shard_bytes=400_000)
    storage = LocalStorage(tmp_path / "ck")
    return state, storage, read_manifest(storage)


@pytest.mark.parametrize("verify", [True, False])
def test_pipelined_reads_fill_whole_and_partial_destinations(tmp_path, verify):
    state, storage, m = _checkpoint(tmp_path)
    reads = [Read(k, torch.empty_like(v), Box((0, 0), tuple(v.shape))) for k, v in state.items()]
    # partial regions too: rows 100..250 of t3, a column band of t7 (a non-contiguous destination)
    part = torch.empty(150, 100)
    reads.append(Read("t3", part, Box((100, 0), (150, 100))))
    band = torch.empty(104, 300).t()  # (300, 104) with transposed strides
    reads.append(Read("t7", band, Box((0, 0), (300, 104))))
    pieces = plan_pieces(m, reads)
    assert any(not p.whole for p in pieces) and len(pieces) > len(state)
    _execute_pipelined(storage, pieces, verify)
    for r in reads[: len(state)]:
        assert torch.equal(r.dest, state[r.key])
    assert torch.equal(part, state["t3"][100:250])
    assert torch.equal(band, state["t7"])


def test_pipelined_reads_report_every_damaged_piece(tmp_path):
    state, storage, m = _checkpoint(tmp_path)
    shards = sorted((tmp_path / "ck").glob("shard-*"))
    for shard in shards[:2]:
        data = bytearray(shard.read_bytes())
        data[-7] ^= 0x55
        shard.write_bytes(bytes(data))
    reads = [Read(k, torch.empty_like(v), Box((0, 0), tuple(v.shape))) for k, v in state.items()]
    with pytest.raises(stashpoint.CorruptCheckpointError) as info:
        _execute_pipelined(storage, plan_pieces(m, reads), True)
    assert str(info.value).count("checksum mismatch") == 2


def test_whole_tensors_are_marked_shared_only_when_ranks_share_the_host(tmp_path):
    """Ranks on one host that each read what they need: whole tensors (replicated, read by every
    rank) go through the page cache; regions of a tensor (shards: one reader each) do not."""
    from stashpoint._load.pieces import read_jobs

    path = tmp_path / "ck"
    stashpoint.save({"w": torch.arange(4096.0).reshape(64, 64), "b": torch.ones(64)}, path)
    manifest = read_manifest(LocalStorage(path))
    reads = [
        Read("w", torch.empty(32, 64), Box((32, 0), (32, 64))),  # a shard of w
        Read("b", torch.empty(64), Box.whole((64,))),  # all of b
    ]
    marked = {p.key: p.shared for p in plan_pieces(manifest, reads, shared_whole=True)}
    assert marked == {"w": False, "b": True}
    assert not any(p.shared for p in plan_pieces(manifest, reads))
    jobs = read_jobs([p for p in plan_pieces(manifest, reads, shared_whole=True) if p.whole])
    assert [(j.keys, j.shared) for j in jobs] == [(["b"], True)]


@pytest.mark.parametrize("cached", [True, False])
def test_damage_in_any_block_of_a_chunk_read_by_several_jobs_is_named_once(tmp_path, monkeypatch, cached):
    """Jobs check each checksum block right after it lands (cached bytes: a block per read;
    else one read per job): a chunk split over two jobs (over 64 MiB) is checked in every
    block, and small chunks read together are told apart."""
    from stashpoint._core.format import CHECKSUM_BLOCK_BYTES
    from stashpoint._load.pieces import read_jobs

    monkeypatch.setattr(LocalStorage, "cached", lambda self, name, offset: cached)

    state = {"big": torch.arange(18 * CHECKSUM_BLOCK_BYTES // 4, dtype=torch.int32)}
    state |= {f"s{i}": torch.full((1000,), float(i)) for i in range(5)}
    stashpoint.save(state, tmp_path / "ck")
    storage = LocalStorage(tmp_path / "ck")
    m = read_manifest(storage)

    def reads():
        return [Read(k, torch.empty_like(v), Box.whole(tuple(v.shape))) for k, v in state.items()]

    pieces = plan_pieces(m, reads())
    jobs = read_jobs(pieces)
    big = [j for j in jobs if "big" in j.keys]
    assert len(big) == 2  # 72 MiB: a 64 MiB job and the rest
    for j in jobs:
        for most in (CHECKSUM_BLOCK_BYTES, j.size):
            steps = [s for _, s in j._steps(most)]
            assert all(sum(len(v) for v, _, _ in s) <= most for s in steps)
            assert [v.obj for s in steps for v, _, _ in s] == [
                b.obj for b in j.buffers for _ in range(0, len(b), CHECKSUM_BLOCK_BYTES)
            ]
            assert sum(len(v) for s in steps for v, _, _ in s) == j.size
    _execute_pipelined(storage, pieces, True)  # undamaged: every block passes
    for k, v in state.items():
        assert torch.equal(pieces[[p.key for p in pieces].index(k)].target, v)

    def damage(key, block):
        chunk = m.tensors[key].chunks[0]
        path = tmp_path / "ck" / chunk.file
        data = bytearray(path.read_bytes())
        data[chunk.start + block * CHECKSUM_BLOCK_BYTES + 3] ^= 0x10
        path.write_bytes(bytes(data))

    damage("big", 17)  # the last block, read by the second job
    with pytest.raises(stashpoint.CorruptCheckpointError, match="for key 'big'"):
        _execute_pipelined(storage, plan_pieces(m, reads()), True)
    damage("big", 1)  # and one read by the first job, and a small chunk read with the others
    damage("s3", 0)
    with pytest.raises(stashpoint.CorruptCheckpointError) as info:
        _execute_pipelined(storage, plan_pieces(m, reads()), True)
    lines = str(info.value).splitlines()
    assert len(lines) == 2 and "'big'" in lines[0] + lines[1] and "'s3'" in lines[0] + lines[1]
    _execute_pipelined(storage, plan_pieces(m, reads()), False)  # unverified: read as it is


@pytest.mark.parametrize("cached", [True, False])
def test_an_atomic_load_of_a_damaged_checkpoint_changes_nothing_whichever_way_it_reads(tmp_path, monkeypatch, cached):
    """``fetch`` (atomic loads) goes through the same jobs: a block damaged in a tied pair of
    tensors or in a plain one is found before anything lands in the live state."""
    monkeypatch.setattr(LocalStorage, "cached", lambda self, name, offset: cached)
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    state = {"m": lin, "tied": lin.weight, "w": torch.randn(3 << 20)}  # w: 12 MiB, three blocks
    stashpoint.save(state, tmp_path / "ck")
    m = read_manifest(LocalStorage(tmp_path / "ck"))
    chunk = m.tensors["w"].chunks[0]
    path = tmp_path / "ck" / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.start + (9 << 20)] ^= 0x01  # in w's third block
    path.write_bytes(bytes(data))
    live = torch.nn.Linear(64, 64)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    target = {"m": live, "tied": live.weight, "w": torch.zeros(3 << 20)}
    with pytest.raises(stashpoint.CorruptCheckpointError, match="for key 'w'"):
        stashpoint.load(target, tmp_path / "ck", atomic=True)
    assert all(torch.equal(v, before[k]) for k, v in live.state_dict().items())
    assert not target["w"].any()


def test_local_reads_use_no_more_threads_than_cores_and_object_storage_four(tmp_path):
    from types import SimpleNamespace

    from stashpoint._load.reads import _cores, _readers
    from stashpoint._storage import LocalStorage

    assert _readers(LocalStorage(tmp_path)) == max(1, min(4, _cores()))
    assert _readers(SimpleNamespace(local_reads=False)) == 4  # each reader waits on the network


def _interleaved(tmp_path):
    """An FSDP2-like file: large moments with a 4-byte step count between each pair, the step
    counts read by every rank on the host (shared), the moments by one."""
    torch.manual_seed(0)
    state = {}
    for i in range(6):
        state[f"p{i}_exp_avg"] = torch.randn(70_000 + i)
        state[f"p{i}_step"] = torch.tensor(float(i + 1))
    # not kept in the page cache after the save (a read-back in the background): evicted stays evicted
    stashpoint.save(state, LocalStorage(tmp_path / "ck", cache_newest=False), max_shard_bytes=1 << 40)
    storage = LocalStorage(tmp_path / "ck", direct_io=False)
    return state, storage, read_manifest(storage)


def test_small_shared_pieces_between_unshared_ones_do_not_cut_the_reads(tmp_path):
    """A 2-rank FSDP2 load read every step count as a job of its own (300 jobs for 0.25 GB, a
    cached load twice as long): small pieces read otherwise, or apart, join one job."""
    from stashpoint._load.pieces import _SMALL, read_jobs

    state, storage, m = _interleaved(tmp_path)
    reads = [Read(k, torch.empty_like(v), Box.whole(tuple(v.shape))) for k, v in state.items()]
    pieces = plan_pieces(m, reads)
    for p in pieces:
        p.shared = "step" in p.key  # a whole tensor every rank reads; the moments are this rank's shards
    jobs = read_jobs(pieces)
    assert len(jobs) == 1 and not jobs[0].shared  # read as the moments are: directly, by this rank
    assert sorted(jobs[0].keys) == sorted(state)
    # the step counts alone, as the rank whose moments are elsewhere reads them: apart in the
    # file, one job whose reads start where each count lies
    steps = [p for p in pieces if p.shared]
    (job,) = read_jobs(steps)
    assert job.shared and len(job.buffers) == 6
    assert [pos for pos, _ in job._steps(CHECKSUM_BLOCK)] == [p.chunk.start for p in steps]
    # from object storage each read is a request: apart, they stay jobs of their own (in parallel)
    assert len(read_jobs(steps, apart=False)) == 6
    _execute_pipelined(storage, pieces, True)
    for r in reads:
        assert torch.equal(r.dest, state[r.key])
    # a large shared piece keeps its own job (read once through the page cache for every rank)
    big = [p for p in pieces if p.key == "p2_exp_avg"]
    assert len(big[0].mv) > _SMALL
    big[0].shared = True
    assert [j.shared for j in read_jobs(pieces)] == [False, True, False]


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_cached_block_checked_part_by_part_still_finds_damage_anywhere_in_it(tmp_path, monkeypatch, where):
    """Cached bytes are read and checked a part of a block at a time (each part still in the
    core's cache): the block's checksum covers all its parts."""
    from stashpoint._load import pieces as pieces_module
    from stashpoint._load.pieces import _PART, read_jobs

    parted = []
    checked = pieces_module._read_checked
    monkeypatch.setattr(pieces_module, "_read_checked", lambda *a: parted.append(1) or checked(*a))

    torch.manual_seed(0)
    state = {"w": torch.randn(3 << 20)}  # 12 MiB: three blocks, each many parts
    stashpoint.save(state, tmp_path / "ck")
    storage = LocalStorage(tmp_path / "ck", direct_io=False)  # a plain read per part
    m = read_manifest(storage)
    (tmp_path / "ck" / m.tensors["w"].chunks[0].file).read_bytes()  # in the page cache
    assert storage.cached(m.tensors["w"].chunks[0].file, m.tensors["w"].chunks[0].start)
    reads = [Read("w", torch.empty(3 << 20), Box.whole((3 << 20,)))]
    _execute_pipelined(storage, plan_pieces(m, reads), True)
    assert torch.equal(reads[0].dest, state["w"])
    assert len(parted) == 3  # each block read in parts
    chunk = m.tensors["w"].chunks[0]
    at = {"start": 0, "middle": CHECKSUM_BLOCK + 5 * _PART + 17, "end": 3 * CHECKSUM_BLOCK - 1}[where]
    path = tmp_path / "ck" / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.start + at] ^= 0x01
    path.write_bytes(bytes(data))
    assert len(read_jobs(plan_pieces(m, reads))) == 1
    with pytest.raises(stashpoint.CorruptCheckpointError, match="for key 'w'"):
        _execute_pipelined(storage, plan_pieces(m, reads), True)


def _evict(path):
    import os

    for f in path.glob("shard-*"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("verify", [True, False])
def test_jobs_reading_small_chunks_apart_place_every_byte_and_name_the_damaged_key(tmp_path, direct_io, cached, verify):
    """Jobs with gaps, parts read otherwise than the job, a small chunk read into two
    destinations, a part of a tensor: every byte lands where it belongs, whichever way the
    storage reads (direct or not, cached or not), and a damaged small chunk read after a gap is
    named alone."""
    from stashpoint._load.pieces import read_jobs

    state, _, m = _interleaved(tmp_path)
    storage = LocalStorage(tmp_path / "ck", direct_io=direct_io)
    if not cached:
        _evict(tmp_path / "ck")

    def reads():
        out = [Read(k, torch.empty_like(v), Box.whole(tuple(v.shape))) for k, v in state.items() if k != "p1_exp_avg"]
        out.append(Read("p3_step", torch.empty(()), Box.whole(())))  # a second destination of one small chunk
        out.append(Read("p1_exp_avg", torch.empty(1000), Box((500,), (1000,))))  # a part: read by itself
        return out

    def planned(rs):
        pieces = plan_pieces(m, rs)
        for p in pieces:
            p.shared = "step" in p.key
        return pieces

    rs = reads()
    pieces = planned(rs)
    jobs = read_jobs([p for p in pieces if p.whole])
    assert any(j.end - j.offset > j.size for j in jobs)  # some job reads across a gap
    _execute_pipelined(storage, pieces, verify)
    for r in rs:
        assert torch.equal(
            r.dest,
            state[r.key][r.region.offsets[0] : r.region.offsets[0] + r.region.shape[0]]
            if r.region.shape
            else state[r.key],
        )
    if not verify:
        return
    chunk = m.tensors["p4_step"].chunks[0]
    path = tmp_path / "ck" / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.start] ^= 0x01
    path.write_bytes(bytes(data))
    if not cached:
        _evict(tmp_path / "ck")
    with pytest.raises(stashpoint.CorruptCheckpointError) as info:
        _execute_pipelined(storage, planned(reads()), True)
    assert str(info.value).count("checksum mismatch") == 1 and "'p4_step'" in str(info.value)


def test_object_storage_reads_small_chunks_apart_as_jobs_of_their_own(tmp_path, monkeypatch):
    """The grouping of parts apart follows the storage: local files yes, object storage no."""
    import stashpoint._load.reads as reads_module

    state, storage, m = _interleaved(tmp_path)
    asked = []
    jobs = reads_module.read_jobs
    monkeypatch.setattr(
        reads_module, "read_jobs", lambda pieces, apart: asked.append(apart) or jobs(pieces, apart=apart)
    )
    reads = [Read(k, torch.empty_like(v), Box.whole(tuple(v.shape))) for k, v in state.items()]
    _execute_pipelined(storage, plan_pieces(m, reads), True)
    monkeypatch.setattr(LocalStorage, "local_reads", False)
    _execute_pipelined(storage, plan_pieces(m, reads), True)
    assert asked == [True, False]


def test_a_view_over_an_evicted_directory_reads_it_in_large_direct_reads(tmp_path, monkeypatch):
    """A node-local restore reads through a view (its memory area over the node's directory):
    bytes not cached are read in one large direct read per job, not in the small checked parts
    of cached bytes (each a buffered read of its own)."""
    from stashpoint._dist.memfetch import FetchView
    from stashpoint._load import pieces as pieces_module

    torch.manual_seed(0)
    state = {"w": torch.randn(4 << 20)}  # 16 MiB
    stashpoint.save(state, LocalStorage(tmp_path / "ck", cache_newest=False))
    (tmp_path / "mem").mkdir()
    view = FetchView(LocalStorage(tmp_path / "mem", direct_io=False), LocalStorage(tmp_path / "ck"))
    parted = []
    checked = pieces_module._read_checked
    monkeypatch.setattr(pieces_module, "_read_checked", lambda *a: parted.append(1) or checked(*a))
    _evict(tmp_path / "ck")
    chunk = read_manifest(view).tensors["w"].chunks[0]
    if LocalStorage(tmp_path / "ck").cached(chunk.file, chunk.start):
        pytest.skip("this file system keeps its pages whatever is asked (tmpfs): nothing is read from a disk")
    reads = [Read("w", torch.empty(4 << 20), Box.whole((4 << 20,)))]
    _execute_pipelined(view, plan_pieces(read_manifest(view), reads), True)
    assert torch.equal(reads[0].dest, state["w"])
    assert not parted
    shared = view.shared_reads()  # as ranks on one host read whole tensors: through the page cache
    _evict(tmp_path / "ck")
    _execute_pipelined(shared, plan_pieces(read_manifest(shared), reads), True)
    assert torch.equal(reads[0].dest, state["w"])
    assert not parted
    (tmp_path / "ck" / m_file(tmp_path)).read_bytes()  # cached now: read and checked in parts
    _execute_pipelined(view, plan_pieces(read_manifest(view), reads), True)
    assert len(parted) == 4


def m_file(tmp_path):
    return read_manifest(LocalStorage(tmp_path / "ck")).tensors["w"].chunks[0].file


@pytest.mark.parametrize("verify", [True, False])
def test_a_shard_cut_short_names_the_keys_past_its_end(tmp_path, verify):
    """One job reads many small keys and a large one: a cut inside the large one names it, not
    the first keys of the job (unchecked, or from a disk, the job is one read)."""
    torch.manual_seed(0)
    state = {f"a{i:02d}": torch.randn(100) for i in range(10)} | {"z_last": torch.randn(2 << 20)}
    stashpoint.save(state, LocalStorage(tmp_path / "ck", cache_newest=False))
    storage = LocalStorage(tmp_path / "ck")
    m = read_manifest(storage)
    chunk = m.tensors["z_last"].chunks[0]
    path = tmp_path / "ck" / chunk.file
    with open(path, "r+b") as f:
        f.truncate(chunk.start + (1 << 20))
    path.read_bytes()  # cached: checked block by block; unchecked: one read whatever the cache holds
    reads = [Read(k, torch.empty_like(v), Box.whole(tuple(v.shape))) for k, v in state.items()]
    with pytest.raises(stashpoint.CorruptCheckpointError, match="is truncated inside 'z_last':"):
        _execute_pipelined(storage, plan_pieces(m, reads), verify)
