"""What a node's directory holds of its steps, and the transfers between node leaders that
bring a node what its ranks will read (planned by ``nodelocal``).

A saving rank's files count as held when its index is there and no ``partial-r<rank>`` marker
is: a restore that fetched only a rank's index, or byte ranges of its shards (sparse copies),
marks it, so that neither a later inventory nor a transfer takes those copies for whole ones.
Every byte fetched is still verified by the load against the checksums the manifest seals.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stashpoint._core.naming import MANIFEST_NAME, index_name, parse_save_file, split_group, step_dir
from stashpoint._core.sealed import MAX_MANIFEST_BYTES
from stashpoint._dist.group import DistContext
from stashpoint._dist.nodes import recv_blob, recv_tensor, send_blob, send_tensor
from stashpoint._load.manifest import read_head
from stashpoint._manager.nodelocal import Held, Transfer, expand, ranges
from stashpoint._manager.steps import committed_steps
from stashpoint._save.staging import as_memoryview
from stashpoint._storage import LocalStorage, Storage
from stashpoint.errors import CheckpointError, CorruptCheckpointError

_CHUNK = 64 << 20
_MAX_LISTING = 64 << 20  # a transfer's list of files
_MAX_FILE = 1 << 44
_PARTIAL_RE = re.compile(r"partial-r([0-9]{5,})")


def partial_name(rank: int) -> str:
    return f"partial-r{rank:05d}"


def inventory(root: Storage) -> tuple[Held, ...]:
    """Every committed step under this node's ``root`` and the saving ranks it holds whole."""
    found = []
    for step in committed_steps(root):
        where = root.child(step_dir(step))
        try:
            head = read_head(where)
        except CheckpointError:
            continue  # a damaged manifest: nothing of the step here is usable
        whole, partial = set(), set()
        for name in where.list():
            if (m := _PARTIAL_RE.fullmatch(name)) is not None:
                partial.add(int(m[1]))
            parsed = parse_save_file(name)
            if parsed is not None and parsed[1] == head.save_id and name.rpartition("/")[2] == index_name(*parsed):
                whole.add(parsed[0])
        found.append(Held(step, head.save_id, head.world_size, ranges(whole - partial)))
    return tuple(found)


def _files_of(step: Storage, ranks: set[int], save_id: str, indexes_only: bool) -> list[tuple[str, int]]:
    out = []
    for name in step.list():
        parsed = parse_save_file(name)
        if parsed is None or parsed[0] not in ranks or parsed[1] != save_id:
            continue
        if not indexes_only or name.rpartition("/")[2] == index_name(*parsed):
            out.append((name, step.size(name)))
    return out


def _send_range(ctx: DistContext, peer: int, step: Storage, where: tuple[str, int, int], buf: Any) -> None:
    name, start, end = where
    mv = as_memoryview(buf)
    for off in range(start, end, _CHUNK):
        n = min(_CHUNK, end - off)
        step.readv(name, off, [mv[:n]])
        send_tensor(ctx, peer, buf[:n])


def send_step_files(ctx: DistContext, peer: int, step: Storage, t: Transfer, save_id: str) -> None:
    import torch

    files = _files_of(step, expand(t.ranks), save_id, False) + _files_of(step, expand(t.indexes), save_id, True)
    if t.manifest:
        files.append((MANIFEST_NAME, step.size(MANIFEST_NAME)))
    send_blob(ctx, peer, json.dumps({"files": files, "spans": t.spans}).encode())
    buf = torch.empty(_CHUNK, dtype=torch.uint8)
    for name, size in files:
        _send_range(ctx, peer, step, (name, 0, size), buf)
    for name, _, _, spans in t.spans:
        for a, b in spans:
            _send_range(ctx, peer, step, (name, a, b), buf)


def _listing(raw: bytes, peer: int) -> tuple[list[tuple[str, int]], list[Any]]:
    try:
        doc = json.loads(raw)
        files, spans = doc["files"], doc["spans"]
        ok = all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and type(f[1]) is int for f in files)
        ok = ok and all(isinstance(s, list) and len(s) == 4 and isinstance(s[3], list) for s in spans)
    except (ValueError, TypeError, KeyError):
        ok = False
    if not ok:
        raise CorruptCheckpointError(f"rank {peer} sent a malformed list of files")
    return [(n, s) for n, s in files], spans


def check_offer(raw: bytes, t: Transfer, save_id: str, peer: int) -> list[tuple[str, int]]:
    """The whole files a peer's listing offers, if it offers exactly what ``t`` plans: names
    of its saving ranks and save (index files alone where only indexes are planned), the
    manifest only where planned, sizes in bounds, and the planned byte ranges."""
    files, spans = _listing(raw, peer)
    whole, idx = expand(t.ranks), expand(t.indexes)
    for name, size in files:
        parsed = parse_save_file(name)
        fits = (name == MANIFEST_NAME and t.manifest and size <= MAX_MANIFEST_BYTES) or (
            parsed is not None
            and parsed[1] == save_id
            and (parsed[0] in whole or (parsed[0] in idx and name.rpartition("/")[2] == index_name(*parsed)))
        )
        if not fits or not 0 <= size <= _MAX_FILE:
            raise CorruptCheckpointError(f"rank {peer} offered {name!r} ({size} bytes), not a file of this transfer")
    offered = [(s[0], s[1], s[2], tuple(tuple(r) for r in s[3])) for s in spans]
    if offered != list(t.spans):
        raise CorruptCheckpointError(f"rank {peer} offered byte ranges other than those planned")
    return files


def recv_step_files(ctx: DistContext, peer: int, step: Storage, t: Transfer, save_id: str) -> None:
    """Receive a :func:`send_step_files` into this node's ``step``. Only names of the saving
    ranks and save this transfer is for are accepted, and only byte ranges inside the file's
    size; whole files replace what was there, the manifest is committed last."""
    import torch

    files = check_offer(recv_blob(ctx, peer, _MAX_LISTING), t, save_id, peer)
    whole, idx = expand(t.ranks), expand(t.indexes)
    step.prepare()
    for r in idx | {rank for _, rank, _, _ in t.spans}:  # marked before any byte of them lands
        step.commit(partial_name(r), b"")
    buf = torch.empty(_CHUNK, dtype=torch.uint8)
    manifest = None
    for name, size in files:
        if name == MANIFEST_NAME:
            manifest = _recv_bytes(ctx, peer, size, buf)
            continue
        step.delete(name)  # a part left by an interrupted transfer, or a sparse copy
        out = step.open_writer(name, size)
        try:
            for off in range(0, size, _CHUNK):
                n = min(_CHUNK, size - off)
                recv_tensor(ctx, peer, buf[:n])
                out.write(as_memoryview(buf[:n]))
            out.close()
        except BaseException:
            out.abort()
            raise
    for span in t.spans:
        _recv_sparse(ctx, peer, step, span, buf)
    step.sync()
    for r in whole:  # whole copies now, where an earlier restore had fetched parts
        step.delete(partial_name(r))
    if manifest is not None:
        step.commit(MANIFEST_NAME, manifest)


def _recv_bytes(ctx: DistContext, peer: int, size: int, buf: Any) -> bytes:
    parts = []
    for off in range(0, size, _CHUNK):
        n = min(_CHUNK, size - off)
        recv_tensor(ctx, peer, buf[:n])
        parts.append(bytes(as_memoryview(buf[:n])))
    return b"".join(parts)


def _recv_sparse(ctx: DistContext, peer: int, step: Storage, span: Any, buf: Any) -> None:
    """Byte ranges of a file (``span``: name, rank, size, ranges) into a copy of its full
    size (the rest a hole), on local disk."""
    name, _, size, spans = span
    if not isinstance(step, LocalStorage):
        raise CheckpointError(f"node-local directories are local; {step.location} is not")
    parts = split_group(name)
    if parts is None or any(not 0 <= a < b <= size for a, b in spans) or size > _MAX_FILE:
        raise CorruptCheckpointError(f"rank {peer} offered byte ranges outside {name!r}")
    path = Path(step.root, *[p for p in parts if p])
    path.parent.mkdir(exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o644)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        for a, b in spans:
            for off in range(a, b, _CHUNK):
                n = min(_CHUNK, b - off)
                recv_tensor(ctx, peer, buf[:n])
                os.pwrite(fd, as_memoryview(buf[:n]), off)
        os.fsync(fd)
    finally:
        os.close(fd)


def run_transfers(
    ctx: DistContext,
    transfers: Sequence[Transfer],
    leaders: Mapping[int, int],
    node: int,
    step: Storage,
    *,
    save_id: str,
) -> str | None:
    """This rank's part of ``transfers`` (in their order); an error as a string, else None."""
    try:
        for t in transfers:
            if t.src == node and ctx.rank == leaders[node]:
                send_step_files(ctx, leaders[t.dst], step, t, save_id)
            elif t.dst == node and ctx.rank == leaders[node]:
                recv_step_files(ctx, leaders[t.src], step, t, save_id)
    except Exception as e:
        return f"rank {ctx.rank}: {type(e).__name__}: {e}"
    return None
