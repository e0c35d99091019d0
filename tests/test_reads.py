"""The pipelined read path (used for CUDA destinations: pinned buffers, each piece copied to the
device as soon as it is read and verified), exercised here on CPU destinations."""

from __future__ import annotations

import pytest
import torch

import stashpoint
from stashpoint._core.reshard import Box
from stashpoint._load.manifest import read_manifest
from stashpoint._load.reads import _execute_pipelined, plan_pieces
from stashpoint._load.restore import Read
from stashpoint._storage import LocalStorage


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
    from stashpoint._load.reads import _read_jobs

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
    jobs = _read_jobs([p for p in plan_pieces(manifest, reads, shared_whole=True) if p.whole])
    assert [(j.keys, j.shared) for j in jobs] == [(["b"], True)]
