"""``stashpoint import`` bounds the work a foreign file can ask of it (a security review): keys
crafted to share one hash in a torch.save file, a DCP ``.metadata``, a DCP value or tensor item
are refused before anything unpickles them (each took minutes to hours), and the bytes it may
write are counted against the bytes DCP reads, not against files the checkpoint merely holds."""

from __future__ import annotations

import collections
import io
import pickle
import pickletools
import struct
import time
from pathlib import Path

import pytest
import torch

import stashpoint
from stashpoint._tools import importcheck, picklescan, picklevalues
from stashpoint._tools.convert import import_checkpoint
from stashpoint.errors import CheckpointError


class _AsSet(list):
    """Pickles as ``set(list)``, as a set does, without this process building the set (that is
    the quadratic work the test is about)."""

    def __reduce__(self):
        return (set, (list(self),))


class _AsDict(list):
    """Pairs that pickle as ``OrderedDict()`` filled by SETITEMS, as a dict does, unbuilt here."""

    def __reduce__(self):
        return (collections.OrderedDict, (), None, None, iter(self))


def _complexes(n: int) -> list[complex]:
    """``n`` distinct complex numbers of one hash (the imaginary part's multiplier is 1000003)."""
    values = [complex(1000003.0 * t, -float(t)) for t in range(2, n + 2)]
    assert len({hash(v) for v in values}) == 1
    return values


def _pairs(n: int, target: int = 12345) -> list[tuple[int, int]]:
    """``n`` distinct pairs of ints below 2**61 whose tuple hash is ``target``: CPython's tuple
    hash (xxHash's rounds) is invertible, so the second item is solved for from the first."""
    mask, p1, p2, p5 = (1 << 64) - 1, 11400714785074694791, 14029467366897019727, 2870177450012600261
    rotl = lambda x, r: ((x << r) | (x >> (64 - r))) & mask  # noqa: E731
    acc = rotl((target - (2 ^ (p5 ^ 3527539))) * pow(p1, -1, 1 << 64) & mask, 33)
    out, a = [], 0
    while len(out) < n:
        a += 1
        lane = (acc - (rotl((p5 + a * p2) & mask, 31) * p1 & mask)) * pow(p2, -1, 1 << 64) & mask
        b = lane - (1 << 64) if lane >> 63 else lane
        if abs(b) < (1 << 61) - 1 and b not in (-1, -2):  # an int that hashes to itself
            out.append((a, b))
    assert len({hash(p) for p in out}) == 1
    return out


def _refused(src: Path, out: Path, *needles: str) -> None:
    start = time.monotonic()
    with pytest.raises(CheckpointError) as e:
        import_checkpoint(src, out)
    for n in needles:
        assert n in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and not out.exists()
    assert time.monotonic() - start < 30  # the scan refuses in well under a second


def _dcp_edited(root: Path, state: dict, edit) -> Path:
    """A DCP checkpoint of ``state`` whose metadata ``edit`` changed (unpickled here: our file)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(root), no_dist=True)
    metadata = pickle.loads((root / ".metadata").read_bytes())
    edit(metadata, root)
    (root / ".metadata").write_bytes(pickle.dumps(metadata))
    return root


# -- finding 1: keys of one hash --------------------------------------------------------------


def test_a_set_of_complex_numbers_of_one_hash_in_a_torch_save_file_is_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(4), "s": _AsSet(_complexes(20_000))}, tmp_path / "c.pt")  # 600 KB: 14 s before
    _refused(tmp_path / "c.pt", tmp_path / "o", "more than 1000 complex numbers of one hash", "stashpoint.save")


def test_dict_keys_that_are_tuples_of_one_hash_are_refused(tmp_path: Path) -> None:
    torch.save({"d": _AsDict((p, 0) for p in _pairs(5000))}, tmp_path / "t.pt")
    _refused(tmp_path / "t.pt", tmp_path / "o", "more than 1000 tuples of one hash")


def test_a_key_that_takes_millions_of_steps_to_hash_is_refused(tmp_path: Path) -> None:
    key: tuple = (1,)
    for _ in range(24):  # 24 levels of the memo: a key of 16 million ints, hashed whole at each use
        key = (key, key)
    torch.save({"d": _AsDict([(key, 0)])}, tmp_path / "k.pt")
    _refused(tmp_path / "k.pt", tmp_path / "o", "steps to unpickle")


def test_a_torch_save_file_is_scanned_whatever_zipfile_makes_of_it(tmp_path: Path) -> None:
    """torch tells a zip by its first bytes and reads past a wrong CRC; zipfile finds a zip at the
    end and stops at a wrong CRC; and the legacy format has a fifth pickle after the state. Each
    let a pickle through unscanned."""
    import zipfile

    p = (1 << 61) - 1
    keys = {"d": _AsDict((k * p, 0) for k in range(1, 3000))}  # ints of one hash: the scan before knew them
    legacy, zipped, tail = io.BytesIO(), io.BytesIO(), io.BytesIO()
    torch.save(keys, legacy, _use_new_zipfile_serialization=False)
    zipfile.ZipFile(tail, "w").close()  # an empty zip: its end record alone
    (tmp_path / "legacy.pt").write_bytes(legacy.getvalue() + tail.getvalue())
    _refused(tmp_path / "legacy.pt", tmp_path / "o", "more than 1000 integers of one hash")

    torch.save(keys, zipped)
    raw = zipped.getvalue()
    crc = zipfile.ZipFile(zipped).getinfo("archive/data.pkl").CRC.to_bytes(4, "little")
    assert raw.count(crc) == 2
    (tmp_path / "crc.pt").write_bytes(raw.replace(crc, b"\0\0\0\0"))  # in its local header and directory
    assert torch.load(tmp_path / "crc.pt", weights_only=True)["d"]  # torch reads it all the same
    _refused(tmp_path / "crc.pt", tmp_path / "o", "more than 1000 integers of one hash")  # scanned as torch reads it

    plain = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, plain, _use_new_zipfile_serialization=False)
    data, stream, stops = plain.getvalue(), io.BytesIO(plain.getvalue()), []
    for _ in range(5):
        for _op in pickletools.genops(stream):
            pass
        stops.append(stream.tell())
    fifth = pickle.dumps(_AsSet(_complexes(20_000)), protocol=2)  # where the storages' keys belong
    (tmp_path / "fifth.pt").write_bytes(data[: stops[3]] + fifth + data[stops[4] :])
    _refused(tmp_path / "fifth.pt", tmp_path / "o", "more than 1000 complex numbers of one hash")


def test_a_torch_save_file_written_without_crcs_imports(tmp_path: Path) -> None:
    """torch.serialization.set_crc32_options(False) writes each CRC as 0, which zipfile refuses:
    a scan through zipfile refused such files (a review found the regression)."""
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.arange(5.0)}, tmp_path / "nocrc.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    import_checkpoint(tmp_path / "nocrc.pt", tmp_path / "sp")
    assert torch.equal(stashpoint.read(tmp_path / "sp")["w"], torch.arange(5.0))


def test_memo_indexes_of_one_hash_are_refused() -> None:
    """Protocol 0's PUT takes any int as a memo index: the pure-Python unpickler of DCP's
    metadata puts them in a dict, so indexes crafted to share a hash flood it too."""
    p = (1 << 61) - 1
    raw = b"N" + b"".join(b"p%d\n" % (k * p) for k in range(1, 1500)) + b"."
    with pytest.raises(CheckpointError, match="more than 1000 integers of one hash"):
        importcheck.check_pickle(raw, "memo.pkl")


def test_a_key_nested_past_the_c_stack_is_refused_and_the_scan_never_recurses() -> None:
    """Hashing a tuple a million deep overflows CPython's C stack (the unpickler crashed); the scan
    itself follows nesting of any depth without recursion, and lets plain pickles through."""
    deep_key = b"\x80\x02}" + b")" + b"\x85" * 100_000 + b"K\x00s."  # {((((),),),...): 0}
    with pytest.raises(CheckpointError, match="nested more than 1000 deep"):
        importcheck.check_pickle(deep_key, "deep.pkl")
    n = 100_000
    importcheck.check_pickle(b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b".", "lists.pkl")  # [[[...]]]
    importcheck.check_pickle(b"\x80\x02" + b"(" * 10 + b")" * 10, "damaged.pkl")  # no STOP: the unpickler's
    plain = {"tags": {1, 2.5, (3, "a"), frozenset({4})}, 7: [0.5] * 5000, (1, 2): {(i, i): i for i in range(3000)}}
    importcheck.check_pickle(pickle.dumps(plain), "plain.pkl")


def test_dcp_metadata_with_a_set_of_one_hash_is_refused(tmp_path: Path) -> None:
    def flood(metadata, _root) -> None:
        metadata.planner_data = _AsSet(_complexes(20_000))  # 480 KB: 23 s before

    ck = _dcp_edited(tmp_path / "dcp", {"w": torch.zeros(4)}, flood)
    _refused(ck, tmp_path / "o", ".metadata", "more than 1000 complex numbers of one hash")


def test_dcp_values_and_tensor_items_of_one_hash_are_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    dcp.save({"w": torch.zeros(4), "s": _AsSet(_complexes(20_000))}, checkpoint_id=str(tmp_path / "v"), no_dist=True)
    _refused(tmp_path / "v", tmp_path / "o", "'s'", "more than 1000 complex numbers of one hash")

    def tensor_item(metadata, root) -> None:  # the tensor's bytes: a torch.save of the set instead
        buf = io.BytesIO()
        torch.save(_AsSet(_complexes(20_000)), buf)
        [(index, info)] = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == "w"]
        with open(root / info.relative_path, "ab") as f:
            end = f.tell()
            f.write(buf.getvalue())
        metadata.storage_data[index] = _StorageInfo(info.relative_path, end, len(buf.getvalue()))

    ck = _dcp_edited(tmp_path / "t", {"w": torch.zeros(4)}, tensor_item)
    _refused(ck, tmp_path / "o", "'w'", "more than 1000 complex numbers of one hash")


def _transformer_state() -> dict:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.TransformerEncoder(layer, num_layers=2))
    optim = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.9))
    model(torch.randint(0, 100, (2, 5))).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "epoch": 3, "lr": [0.5, 0.25]}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_transformer_and_its_optimizer_import_from_torch_save_and_dcp(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = _transformer_state()
    torch.save(state, tmp_path / "ck.pt")
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for src in ("ck.pt", "dcp"):
        import_checkpoint(tmp_path / src, tmp_path / f"sp-{src}")
        fresh = _transformer_state()
        fresh["model"] = {k: torch.zeros_like(v) for k, v in fresh["model"].items()}
        fresh["optim"], fresh["epoch"], fresh["lr"] = None, 0, None
        stashpoint.load(fresh, tmp_path / f"sp-{src}")
        assert _same(fresh["model"], state["model"]) and fresh["epoch"] == 3 and fresh["lr"] == [0.5, 0.25], src
        first = 0 if src == "ck.pt" else "0"  # DCP's flattening makes the optimizer's int keys strings
        assert torch.equal(fresh["optim"]["state"][first]["exp_avg"], state["optim"]["state"][0]["exp_avg"]), src


# -- finding 2: the write limit counts what DCP reads -----------------------------------------


def test_dcp_write_limit_counts_only_the_bytes_dcp_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Views of one storage are written whole, at most 8x the bytes read (here with no slack, so
    that the case is small): a sparse file of 16 MiB that DCP never reads must not raise that."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    monkeypatch.setattr(importcheck, "_WRITE_SLACK", 0)
    base = torch.arange(64 << 10, dtype=torch.float32)  # 256 KiB; 64 views of 128 KiB: 8 MiB written
    state = {"w": torch.zeros(4), "blob": tuple(base[i * 64 : i * 64 + (32 << 10)] for i in range(64))}

    def junk(metadata, root) -> None:
        with open(root / "junk", "wb") as f:
            f.truncate(16 << 20)  # no disk used

    def junk_named(metadata, root) -> None:  # and named by an item of the metadata no tensor or value reads
        junk(metadata, root)
        metadata.storage_data[MetadataIndex("unread")] = _StorageInfo("junk", 0, 16 << 20)

    for name, edit in (("unnamed", junk), ("named", junk_named)):
        ck = _dcp_edited(tmp_path / name, state, edit)
        _refused(ck, tmp_path / "o", "would take", "import refuses more than 8x")
    ck = _dcp_edited(tmp_path / "plain", {"w": torch.zeros(4), "blob": state["blob"][:4]}, lambda m, r: None)
    import_checkpoint(ck, tmp_path / "o")  # 512 KiB of views from 256 KiB read


def test_a_sparse_dcp_metadata_is_refused_by_its_size_unread(tmp_path: Path) -> None:
    """The cap on .metadata grows with the data, as held on disk: a sparse file of 64 GiB beside
    it made a sparse .metadata of 300 MiB acceptable, read whole into memory."""
    ck = _dcp_edited(tmp_path / "dcp", {"w": torch.zeros(4)}, lambda m, r: None)
    with open(ck / "junk", "wb") as f:
        f.truncate(64 << 30)
    with open(ck / ".metadata", "r+b") as f:
        f.truncate(300 << 20)
    _refused(ck, tmp_path / "o", "more than any DCP metadata")


# -- files swapped between their check and their read -----------------------------------------


def test_a_file_swapped_for_a_fifo_after_its_check_is_read_as_checked_or_refused(tmp_path, monkeypatch) -> None:
    """Before: the checks went by name and torch and DCP opened the files again by name, so a
    file swapped for a FIFO in between blocked the import for ever (2 of 6 runs, in a race)."""
    import os

    import torch.distributed.checkpoint as dcp

    from stashpoint._tools import convert, dcpread

    def swap(path: Path) -> None:
        path.unlink()
        os.mkfifo(path)

    # a torch.save file: read from the file opened and checked, whatever its name leads to now
    torch.save({"w": torch.arange(4.0)}, tmp_path / "ck.pt")
    opened = convert.open_regular

    def open_then_swap(path: Path, **kw: bool):  # type: ignore[no-untyped-def]
        f = opened(path, **kw)
        swap(path)
        return f

    monkeypatch.setattr(convert, "open_regular", open_then_swap)
    import_checkpoint(tmp_path / "ck.pt", tmp_path / "sp")
    assert torch.equal(stashpoint.read(tmp_path / "sp")["w"], torch.arange(4.0))
    # a DCP checkpoint's data file, swapped once the metadata's places are checked: DCP's own
    # read refuses it (its items' pickles are scanned in the file DCP reads them from)
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    checked = dcpread._check_places

    def check_then_swap(metadata, root):  # type: ignore[no-untyped-def]
        checked(metadata, root)
        for data in (tmp_path / "dcp").glob("*.distcp"):
            swap(data)

    monkeypatch.setattr(dcpread, "_check_places", check_then_swap)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"\.distcp is not a regular file \(a FIFO"):
        import_checkpoint(tmp_path / "dcp", tmp_path / "sp-dcp")
    assert time.monotonic() - t0 < 30


# -- a second review: tables put in again, MetadataIndex keys, opcodes the scan could not follow ----


def _complex_keys_dict(n: int = 1000) -> bytes:
    """Protocol 2: memo 0 holds a dict of ``n`` complex keys of one hash (as many as allowed)."""
    out = [b"\x80\x02]}q\x00("]
    for k, v in enumerate(_complexes(n)):
        call = b"cbuiltins\ncomplex\nq\x01" if k == 0 else b"h\x01"
        out.append(call + b"G" + struct.pack(">d", v.real) + b"G" + struct.pack(">d", v.imag) + b"\x86RN")
    return b"".join(out) + b"ua"


def test_a_dict_of_one_hash_put_in_again_through_the_memo_is_refused() -> None:
    """Each BUILD or copy of a dict of 1000 keys of one hash makes the unpickler compare them all
    again (half a million steps): the scan charged 1000 each, and 148 KB took 18 s to import."""
    table = _complex_keys_dict()
    od, build = b"ccollections\nOrderedDict\n)Rq\x02a", b"h\x02h\x00ba"  # GET od, GET dict, BUILD
    as_state = od + build * 200
    copied = b"ccollections\nOrderedDict\nq\x02" + b"h\x02h\x00\x85Ra" * 200  # OrderedDict(dict)
    for tail in (as_state, copied):
        with pytest.raises(CheckpointError, match="steps to unpickle"):
            importcheck.check_pickle(table + tail + b".", "reused.pkl")
    importcheck.check_pickle(table + od + build * 3 + b".", "thrice.pkl")  # a few uses: fine


class _AsIndex(tuple):
    """Pickles as ``MetadataIndex(fqn, offset)`` called, as a crafted pickle may build one."""

    def __reduce__(self):
        from torch.distributed.checkpoint.metadata import MetadataIndex

        return (MetadataIndex, tuple(self))


def test_dcp_metadata_index_keys_of_one_hash_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``storage_data`` is keyed by MetadataIndex, hashed as ``(fqn, offset)``: offsets of one
    tuple hash made 3000 keys take 6 s to unpickle, unseen by the scan (an opaque object)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    keys = [MetadataIndex("w", torch.Size(p)) for p in _pairs(1500)]
    assert len({hash(k) for k in keys}) == 1

    def flood(metadata, _root) -> None:  # built by NEWOBJ and BUILD, as DCP's own are
        metadata.storage_data = _AsDict([*metadata.storage_data.items(), *((k, None) for k in keys)])

    _refused(_dcp_edited(tmp_path / "dcp", {"w": torch.zeros(4)}, flood), tmp_path / "o", ".metadata", "MetadataIndex")
    called = _AsDict((_AsIndex(("w", torch.Size(p))), 0) for p in _pairs(1500))
    with pytest.raises(CheckpointError, match="more than 1000 MetadataIndex keys of one hash"):
        importcheck.check_pickle(pickle.dumps(called), "called.pkl")
    importcheck.check_pickle(pickle.dumps({MetadataIndex("w", (i, 0)): i for i in range(3000)}), "plain.pkl")

    if picklevalues._slice_hash is None:  # slices hash from Python 3.12: as tuples here, to count them
        monkeypatch.setattr(picklevalues, "_slice_hash", hash)
    p = (1 << 61) - 1
    slices = _AsSet(slice(k * p, None) for k in range(1, 1500))  # starts all of hash 0
    with pytest.raises(CheckpointError, match="more than 1000 slices of one hash"):
        importcheck.check_pickle(pickle.dumps(slices), "slices.pkl")


def test_a_pickle_the_scan_cannot_follow_to_its_stop_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """pickletools reads protocol 0's memo index ``01`` as True and refuses INT's ``0x10``, which
    the unpickler reads as 1 and 16: the scan stopped there and passed all that followed."""
    body = pickle.dumps(_AsSet(_complexes(2000)), protocol=2)
    for prefix in (b"Np01\n0", b"I0x10\n0", b"L0x10L\n0", b"Np1\n0g01\n0"):
        with pytest.raises(CheckpointError, match="more than 1000 complex numbers of one hash"):
            importcheck.check_pickle(prefix + body, "prefixed.pkl")
    picklescan._scan_small.cache_clear()
    monkeypatch.delitem(picklescan._OPS, "DUP")  # an opcode the shadow does not know
    with pytest.raises(CheckpointError, match="an opcode sequence stashpoint's check cannot follow"):
        importcheck.check_pickle(b"\x80\x02N2.", "dup.pkl")
    importcheck.check_pickle(b"\x80\x02N(G\0\0", "cut.pkl")  # cut short before it: the unpickler refuses it
    picklescan._scan_small.cache_clear()
