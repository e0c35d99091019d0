"""Every structural rule of the manifest holds for any number of chunks, checked in linear time,
on manifests an attacker re-sealed (a valid checksum over hostile contents). Version-1 manifests
list every chunk, so they are the ones crafted here; version 2 shares the same checks."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

import stashpoint
from conftest import v1_doc
from stashpoint._core.format import parse_manifest, seal
from stashpoint._core.naming import MANIFEST_NAME
from stashpoint.errors import CorruptCheckpointError


def _one_element_chunks(tmp_path, n: int) -> tuple[dict, torch.Tensor]:
    """A checkpoint of an n-element tensor re-described as n one-element chunks (re-sealed)."""
    t = torch.arange(float(n))
    stashpoint.save({"t": t}, tmp_path / "c")
    doc = v1_doc(tmp_path / "c")
    (chunk,) = doc["tensors"]["t"]["chunks"]
    chunks = []
    for i in range(n):
        start = chunk["start"] + 4 * i
        sums = [stashpoint._core.format.checksum((tmp_path / "c" / chunk["file"]).read_bytes()[start : start + 4])]
        chunks.append({**chunk, "offsets": [i], "shape": [1], "start": start, "end": start + 4, "checksums": sums})
    doc["tensors"]["t"]["chunks"] = chunks
    return doc, t


def _write(tmp_path, doc) -> None:
    (tmp_path / "c" / MANIFEST_NAME).write_bytes(seal(doc))


def test_many_chunks_that_tile_load_and_a_duplicated_offset_is_refused_at_any_count(tmp_path):
    doc, t = _one_element_chunks(tmp_path, 600)
    _write(tmp_path, doc)
    out = torch.zeros(600)
    stashpoint.load({"t": out}, tmp_path / "c")
    assert torch.equal(out, t)
    doc["tensors"]["t"]["chunks"][17]["offsets"] = [16]  # two chunks at 16, none at 17
    _write(tmp_path, doc)
    out = torch.full((600,), -1.0)
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        stashpoint.load({"t": out}, tmp_path / "c")
    assert not stashpoint.verify(tmp_path / "c").ok


def test_chunks_that_share_bytes_of_a_file_are_refused(tmp_path):
    torch.manual_seed(0)
    stashpoint.save({"a": torch.randn(1000), "b": torch.randn(1000)}, tmp_path / "c")
    doc = v1_doc(tmp_path / "c")
    doc["tensors"]["b"]["chunks"] = [dict(c) for c in doc["tensors"]["a"]["chunks"]]  # b points at a's bytes
    with pytest.raises(CorruptCheckpointError, match="share bytes"):
        parse_manifest(seal(doc), "x")


def test_a_layout_that_is_no_grid_is_refused():
    from stashpoint._core.format import Chunk, TensorEntry, _check_tiling

    # a staircase of 1 x 1 chunks on the diagonal with row and column strips: few chunks, many cells
    n = 200
    chunks = [Chunk("f", (i, i), (1, n - i), 0, 0, ()) for i in range(n)]
    chunks += [Chunk("f", (i + 1, i), (n - i - 1, 1), 0, 0, ()) for i in range(n - 1)]
    entry = TensorEntry("t", "float32", (n, n), tuple(chunks))
    with pytest.raises(CorruptCheckpointError, match="do not form a grid"):
        _check_tiling(entry, "x")


def test_the_tiling_check_is_linear_in_the_chunks():
    from stashpoint._core.format import Chunk, TensorEntry, _check_tiling

    def timed(n: int) -> float:
        entry = TensorEntry("t", "float32", (n, 8), tuple(Chunk("f", (i, 0), (1, 8), 0, 0, ()) for i in range(n)))
        t0 = time.perf_counter()
        _check_tiling(entry, "x")
        return time.perf_counter() - t0

    timed(1000)
    small, large = min(timed(10_000) for _ in range(3)), min(timed(100_000) for _ in range(3))
    assert large < 30 * small, (small, large)  # quadratic would be 100x
    assert large < 5.0


@pytest.mark.parametrize("dim", [10**18, 2**63, 10**30])
def test_a_tensor_of_no_elements_with_huge_dimensions_is_read_or_refused_cleanly(tmp_path, dim):
    from stashpoint._tools.convert import export
    from stashpoint._tools.inspect import describe

    stashpoint.save({"t": torch.zeros(0, 5), "u": torch.ones(3)}, tmp_path / "c")
    doc = v1_doc(tmp_path / "c")
    doc["tensors"]["t"]["shape"] = [0, dim]
    for c in doc["tensors"]["t"]["chunks"]:
        c["shape"] = [0, dim]
    _write(tmp_path, doc)
    for attempt in (
        lambda: stashpoint.load({"u": torch.zeros(3), "t": None}, tmp_path / "c"),
        lambda: stashpoint.read(tmp_path / "c"),
        lambda: export(tmp_path / "c", tmp_path / "out.safetensors"),
        lambda: describe(tmp_path / "c"),
    ):
        try:
            attempt()
        except stashpoint.CheckpointError:
            assert dim >= 2**62


def test_a_manifest_over_the_entry_cap_is_refused_before_its_entries_are_built(tmp_path, monkeypatch):
    doc, _ = _one_element_chunks(tmp_path, 40)
    _write(tmp_path, doc)
    monkeypatch.setattr(stashpoint._core.format, "MAX_MANIFEST_ENTRIES", 41)  # 40 chunks + 1 file + 1 rank
    with pytest.raises(CorruptCheckpointError, match=r"lists 42 chunks, files and ranks \(the cap is 41\)"):
        stashpoint.load({"t": torch.zeros(40)}, tmp_path / "c")
    monkeypatch.setattr(stashpoint._core.format, "MAX_MANIFEST_ENTRIES", 42)
    live = {"t": torch.zeros(40)}
    stashpoint.load(live, tmp_path / "c")
    assert torch.equal(live["t"], torch.arange(40.0))


def test_a_manifest_whose_objects_could_exhaust_memory_is_refused_before_it_is_parsed():
    """50 MiB of empty objects would take over 1 GiB as Python objects (26 bytes per byte): the
    bound on what a parse may allocate refuses it from byte counts alone."""
    raw = b'{"format":"stashpoint","trees":[{"list":[' + b"{}," * ((50 << 20) // 3) + b"0]}]}"
    with pytest.raises(CorruptCheckpointError, match="could take more than 4 GiB to parse"):
        parse_manifest(raw, "m")
    assert stashpoint._core.sealed._parse_memory_bound(raw) > stashpoint._core.sealed.MAX_PARSE_MEMORY


_SHORT_OF_MEMORY = r"""
import resource, sys
import torch  # imported, as a training process has it, before its memory is limited
import stashpoint
import stashpoint._load.loader
from stashpoint._core.naming import MANIFEST_NAME

path = sys.argv[1]
# within every bound (40 MiB, ~1.3 GiB to parse by the byte counts), but under a limit on this
# process's address space of 400 MiB more than it holds now
raw = b'{"format":"stashpoint","trees":[{"list":[' + b"[]," * ((40 << 20) // 3) + b"0]}]}"
open(f"{path}/{MANIFEST_NAME}", "wb").write(raw)
del raw
with open("/proc/self/statm") as f:
    held = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (held + (400 << 20), resource.RLIM_INFINITY))
try:
    stashpoint.load({}, path)
except stashpoint.CheckpointError as e:
    print("CheckpointError:", e)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="an address-space limit, read from /proc")
def test_a_manifest_too_large_for_the_memory_a_process_may_take_is_a_checkpoint_error(tmp_path):
    """A manifest within the bounds can still need more memory than a process may take (a
    limited container): the load says so as a CheckpointError, never a bare MemoryError."""
    done = subprocess.run(
        [sys.executable, "-c", _SHORT_OF_MEMORY, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "CheckpointError:" in done.stdout and "ran out of memory" in done.stdout, done.stdout
    assert "process with more memory free" in done.stdout


def test_memory_running_short_while_a_load_plans_is_a_checkpoint_error_that_keeps_its_cause(tmp_path, monkeypatch):
    """Raised from the planning, where several ranks agree on their plans: a CheckpointError
    goes through that agreement (every rank raises), a bare MemoryError would leave the others
    waiting for it until their timeout."""
    from stashpoint._load import loader

    stashpoint.save({"w": torch.ones(4)}, tmp_path / "c")

    def short(*args, **kwargs):
        raise MemoryError("allocating the plan (injected)")

    monkeypatch.setattr(loader.Planner, "run", short)
    with pytest.raises(
        stashpoint.CheckpointError, match=r"planning the load of .* on rank 0 ran out of memory"
    ) as info:
        stashpoint.load({"w": torch.zeros(4)}, tmp_path / "c")
    assert isinstance(info.value.__cause__, MemoryError)


def test_memory_running_short_while_a_shard_header_parses_is_a_checkpoint_error(monkeypatch):
    from types import SimpleNamespace

    from stashpoint._core import header

    def short(raw):
        raise MemoryError

    monkeypatch.setattr(header, "json", SimpleNamespace(loads=short))
    raw = (2).to_bytes(8, "little") + b"{}"
    with pytest.raises(stashpoint.CheckpointError, match=r"parsing the header of shard s \(0 MiB of JSON\) ran out"):
        header.parse_header(raw, len(raw), "s")
