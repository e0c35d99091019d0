"""Transfers of a step's files between node leaders (planned by ``_core.nodeplan``): what a
restore fetches onto a node, and the replicas a save sends to other nodes.

A saving rank's files count as held when its index is there and no ``partial-r<rank>`` marker
is: a restore that fetched only a rank's index, or byte ranges of its shards (sparse copies),
marks it, so that neither a later inventory nor a transfer takes those copies for whole ones.
Every byte fetched is still verified by the load against the checksums the manifest seals.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stashpoint._core.naming import (
    MANIFEST_NAME,
    RECOVERABLE_NAME,
    REPLICA_RE,
    index_name,
    parse_save_file,
    parse_step_dir,
)
from stashpoint._core.nodeplan import REMOTE, Room, Transfer, expand, peak_bytes, replica_peers
from stashpoint._core.sealed import MAX_MANIFEST_BYTES
from stashpoint._core.units import human_bytes
from stashpoint._dist.group import DistContext
from stashpoint._dist.landing import land, needed, replica_name
from stashpoint._dist.memfetch import disk_of, landing_target
from stashpoint._dist.nodes import NodeSave, recv_blob, send_blob
from stashpoint._dist.stream import Stream
from stashpoint._storage import LocalStorage, Storage
from stashpoint._storage.oserror import read_failed, says_damage
from stashpoint.errors import CheckpointError, CorruptCheckpointError, ReplicaError

log = logging.getLogger("stashpoint")

_MAX_LISTING = 64 << 20  # a transfer's list of files
_MAX_FILE = 1 << 44


def _check_space(step: Storage, needed: int) -> None:
    if not isinstance(step, LocalStorage):
        return
    where = step.root if step.root.exists() else step.root.parent
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if needed > free:
        raise CheckpointError(
            f"{where} has {free} bytes free and {needed} are needed: use a larger tier, fewer replicas, or a "
            "smaller keep_last"
        )


def _landing(step: Storage, size: int) -> Storage:
    """Where ``size`` bytes fetched into ``step`` land (memory or the node's directory), once
    both the node's directory, where they end up either way, and that place have the room."""
    _check_space(disk_of(step), size)
    target = landing_target(step, size)
    _check_space(target, size)
    return target


def _room_problem(step: Storage, room: Room | None, ns: NodeSave) -> str | None:
    """Why this node's directory cannot hold its checkpoints with replicas, steps staying this
    size: what it holds at the peak of a save (``peak_bytes``) against its free space plus
    the steps already in it. None when it can, or cannot be told."""
    keep = ns.keep
    if room is None or keep is None or not isinstance(step, LocalStorage):
        return None
    peak = peak_bytes(*room, keep)
    assert peak is not None
    root = step.root.parent
    try:
        st = os.statvfs(root)
        held = sum(_usage(d) for d in root.iterdir() if parse_step_dir(d.name) is not None and not d.is_symlink())
    except OSError:
        return None
    capacity = st.f_bavail * st.f_frsize + held
    if peak <= capacity:
        return None
    own, incoming = room
    h = human_bytes
    return (
        f"node {ns.node}'s directory {root} cannot hold this configuration: at the peak of a save a node holds "
        f"{keep} + 1 steps of its own files (keep_last and the one being written: {keep + 1} x {h(own)}) and two steps "
        f"of the copies it keeps of {ns.replicas} other node(s)' files (2 x {h(incoming)}), {h(peak)} in all, and the "
        f"directory has {h(capacity)} (free, plus the steps already there); use a larger directory, a smaller "
        "keep_last, or fewer replicas"
    )


def _usage(where: Path) -> int:
    """The bytes the files under ``where`` take on disk (sparse copies count what they hold)."""
    total = 0
    for dirpath, _, names in os.walk(where):
        for name in names:
            with contextlib.suppress(OSError):
                total += (Path(dirpath) / name).lstat().st_blocks * 512
    return total


def _files_of(step: Storage, ranks: set[int], save_id: str, indexes_only: bool) -> list[tuple[str, int]]:
    out = []
    for name in step.list():
        parsed = parse_save_file(name)
        if parsed is None or parsed[0] not in ranks or parsed[1] != save_id:
            continue
        if not indexes_only or name.rpartition("/")[2] == index_name(*parsed):
            out.append((name, step.size(name)))
    return out


def send_step_files(ctx: DistContext, peer: int, step: Storage, t: Transfer, save_id: str, *, tag: int = 0) -> None:
    """Send this node's files of a transfer to ``peer``'s leader (:func:`recv_step_files`): their
    listing, then, unless refused, their bytes. A listing that fails is told to the receiver,
    which otherwise would wait for it."""
    failed: CheckpointError | None = None
    try:
        files = _files_of(step, expand(t.ranks), save_id, False) + _files_of(step, expand(t.indexes), save_id, True)
        if t.manifest:
            files.append((MANIFEST_NAME, step.size(MANIFEST_NAME)))
        listing: dict[str, Any] = {"files": files, "spans": t.spans}
    except Exception as e:  # any failure: the receiver waits for this listing
        if isinstance(e, CheckpointError):
            failed = e
        elif isinstance(e, OSError):
            failed = read_failed(f"the files of {step.location}", e)
        else:
            failed = CheckpointError(f"listing the files of {step.location} failed: {type(e).__name__}: {e}")
        listing = {"error": str(failed)[:2000], "damage": says_damage(failed)}
    send_blob(ctx, peer, json.dumps(listing).encode(), tag)
    refused = recv_blob(ctx, peer, 4096, tag)  # the receiver checks the offer and its space first
    if failed is not None:
        raise failed
    if refused:
        raise CheckpointError(f"rank {peer} refused the files: {refused.decode(errors='replace')}")
    stream = Stream(ctx, peer, tag=tag)
    for name, size in files:
        stream.send(step, name, [(0, size)])
    for name, _, _, spans in t.spans:
        stream.send(step, name, spans)
    stream.done_sending()


def _listing(raw: bytes, who: str) -> tuple[list[tuple[str, int]], list[Any]]:
    try:
        doc = json.loads(raw)
        if isinstance(doc, dict) and isinstance(doc.get("error"), str):  # the sender could not list them
            error = CorruptCheckpointError if doc.get("damage") is True else CheckpointError
            raise error(f"{who} could not list its files: {doc['error'][:2000]}")
        files, spans = doc["files"], doc["spans"]
        ok = all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and type(f[1]) is int for f in files)
        ok = ok and all(isinstance(s, list) and len(s) == 4 and isinstance(s[3], list) for s in spans)
    except (ValueError, TypeError, KeyError, RecursionError):
        ok = False
    if not ok:
        raise CorruptCheckpointError(f"{who} sent a malformed list of files")
    return [(n, s) for n, s in files], spans


def check_offer(raw: bytes, t: Transfer, save_id: str, who: str) -> list[tuple[str, int]]:
    """The whole files a listing from ``who`` (a peer, or the remote tier) offers, if it offers
    exactly what ``t`` plans: names of its saving ranks and save (index files alone where only
    indexes are planned), the manifest only where planned, sizes in bounds, and the planned
    byte ranges."""
    files, spans = _listing(raw, who)
    whole, idx = expand(t.ranks), expand(t.indexes)
    for name, size in files:
        parsed = parse_save_file(name)
        fits = (name == MANIFEST_NAME and t.manifest and size <= MAX_MANIFEST_BYTES) or (
            parsed is not None
            and parsed[1] == save_id
            and (parsed[0] in whole or (parsed[0] in idx and name.rpartition("/")[2] == index_name(*parsed)))
        )
        if not fits or not 0 <= size <= _MAX_FILE:
            raise CorruptCheckpointError(f"{who} offered {name!r} ({size} bytes), not a file of this transfer")
    offered = [(s[0], s[1], s[2], tuple(tuple(r) for r in s[3])) for s in spans]
    if offered != list(t.spans):
        raise CorruptCheckpointError(f"{who} offered byte ranges other than those planned")
    return files


def recv_step_files(
    ctx: DistContext,
    peer: int,
    step: Storage,
    t: Transfer,
    save_id: str,
    *,
    replica: bool = False,
    refuse: str | None = None,
    tag: int = 0,
) -> int:
    """Receive a :func:`send_step_files` into this node's ``step``; the bytes received. Only
    names of the saving ranks and save this transfer is for are accepted, and only byte ranges
    inside the file's size, and only what fits the free space (the sender is told why not
    before it sends a byte); whole files replace what was there, the manifest is committed
    last. ``replica``: the files are a copy of another node's, marked so that a newer replica
    replaces them. ``refuse``: why this node takes no copy (told to the sender, and raised)."""
    try:
        files = check_offer(recv_blob(ctx, peer, _MAX_LISTING, tag), t, save_id, f"rank {peer}")
        if refuse:
            raise CheckpointError(refuse)
        step = _landing(step, needed(files, t))
    except CheckpointError as e:
        send_blob(ctx, peer, str(e).encode()[:4000], tag)
        raise
    send_blob(ctx, peer, b"", tag)
    return land(step, t, files, Stream(ctx, peer, tag=tag), replica)


@dataclass(frozen=True)
class RemoteCopy:
    """The remote tier's copy of the step a restore fetches, and the whole files of a transfer
    planned from it (what a peer's listing would offer: names and sizes)."""

    step: Storage
    files: Callable[[Transfer], list[tuple[str, int]]]


def fetch_remote(remote: RemoteCopy, step: Storage, t: Transfer, save_id: str) -> int:
    """What no node holds, read from the remote tier into this node's ``step`` as a peer's
    transfer lands (checked alike); the bytes read."""
    listing = json.dumps({"files": remote.files(t), "spans": t.spans}).encode()
    files = check_offer(listing, t, save_id, f"the remote tier ({remote.step.location})")
    step = _landing(step, needed(files, t))
    return land(step, t, files, Stream(None, -1, source=remote.step), False)


def run_transfers(
    ctx: DistContext,
    transfers: Sequence[Transfer],
    leaders: Mapping[int, int],
    node: int,
    step: Storage,
    *,
    save_id: str,
    remote: RemoteCopy | None = None,
    tally: dict[str, int] | None = None,
) -> tuple[str, bool] | None:
    """This rank's part of ``transfers`` (in their order): every one of them, whatever failed
    before (its peers wait for it); None, or the errors as a string and whether they all say
    a copy is damaged or gone (a restore then falls back past this step; not when a node had
    no room, a peer or the remote tier failed). The bytes this node received are added to
    ``tally`` under "peers" and "remote" (on its leader)."""
    errors = []
    damage = True
    tally = {} if tally is None else tally
    for t in transfers:
        try:
            if t.src == node and ctx.rank == leaders[node]:
                send_step_files(ctx, leaders[t.dst], step, t, save_id)
            elif t.dst == node and ctx.rank == leaders[node] and t.src == REMOTE:
                if remote is None:
                    raise CheckpointError("the plan reads from a remote tier this manager does not have")
                tally["remote"] = tally.get("remote", 0) + fetch_remote(remote, step, t, save_id)
            elif t.dst == node and ctx.rank == leaders[node]:
                tally["peers"] = tally.get("peers", 0) + recv_step_files(ctx, leaders[t.src], step, t, save_id)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")  # agree() names the rank
            damage = damage and says_damage(e)
    return ("; ".join(errors[:4]), damage) if errors else None


def replicate(ctx: DistContext, step: Storage, ns: NodeSave, save_id: str, room: Room | None) -> None:
    """After a step committed on every node: each node's leader sends its own ranks' files of
    it to the leaders of the next ``ns.replicas`` nodes, one replica after another; for each,
    every leader sends to the node after it while it receives from the node before it (a ring
    of full-duplex transfers, all at once). Each receiver then drops the replicas it kept of
    older steps. A node whose directory cannot hold ``room`` (its own bytes of the step, and
    the replicas it keeps) at the peak of a save takes no copy. Raises :class:`ReplicaError`
    on every rank alike if any failed."""
    leaders, ranks = dict(ns.nodes.leaders), dict(ns.nodes.ranks)
    status = None
    kept = 0  # bytes of other nodes' files this node received
    theirs: set[int] = set()  # their saving ranks
    if ctx.rank == leaders.get(ns.node):
        errors = []
        refuse = _room_problem(step, room, ns)
        nodes = sorted(leaders)
        # tags: the two directions between one pair of nodes (two nodes: each other's sender
        # and receiver) are told apart by their sender's place in the ring
        mine = 1 + nodes.index(ns.node)
        for shift in range(1, ns.replicas + 1):
            dst, src = replica_peers(nodes, ns.node, shift)
            out, into = Transfer(ns.node, dst, ranks=ranks[ns.node]), Transfer(src, ns.node, ranks=ranks[src])
            with cf.ThreadPoolExecutor(1, thread_name_prefix="stashpoint-replica") as pool:
                sending = pool.submit(send_step_files, ctx, leaders[dst], step, out, save_id, tag=mine)
                try:  # whatever fails, both directions run to their end: the peers wait for them
                    got = recv_step_files(
                        ctx, leaders[src], step, into, save_id, replica=True, refuse=refuse, tag=1 + nodes.index(src)
                    )
                    kept += got
                    theirs |= set(expand(ranks[src]))
                except Exception as e:
                    errors.append(f"receiving from node {src}: {type(e).__name__}: {e}")
                try:
                    sending.result()
                except Exception as e:
                    errors.append(f"sending to node {dst}: {type(e).__name__}: {e}")
        status = f"rank {ctx.rank} (node {ns.node}): " + "; ".join(errors[:4]) if errors else None
    statuses = ctx.gather("replicas: each node's outcome", status)
    verdict = None
    if statuses is not None:
        bad = [s for s in statuses if s]
        verdict = "; ".join(bad[:8])[:4000] if bad else None
    verdict = ctx.broadcast("replicas: the verdict", verdict)
    if not verdict and ctx.rank == leaders.get(ns.node):
        own = sum(size for _, size in _files_of(step, set(expand(ranks[ns.node])), save_id, False))
        doc = {"replicas": ns.replicas, "nodes": len(leaders), "own_bytes": own, "replica_bytes": kept}
        _mark_recoverable(step, doc)
        if isinstance(step, LocalStorage):  # only now: until every node has its copy, the older ones stand
            try:
                _drop_older_replicas(step.root)
            except OSError as e:
                log.warning("stashpoint: could not drop the replicas older than %s: %s", step.location, e)
        # in this host's memory too, as the node's own newest files are: a replica is read when
        # another node is lost, and from the page cache it leaves at memory's speed, not the disk's
        try:  # a hint: the step is committed and copied whatever happens here
            step.keep_cached([name for name, _ in _files_of(step, theirs, save_id, False)], beside=own)
        except (OSError, CheckpointError) as e:
            log.debug("stashpoint: the replicas in %s not kept in the page cache: %s", step.location, e)
    if verdict:
        raise ReplicaError(
            f"the step at {step.location} is committed on every node, but copying it to other nodes failed "
            f"({verdict}); a node lost now takes its files of this step with it"
        )


def _mark_recoverable(step: Storage, doc: dict[str, int]) -> None:
    """Say in this node's step directory that every node's files of the step now have live
    copies on ``replicas`` other nodes (the step is recoverable without storage), and what this
    node holds of it: its own ranks' files and the copies it keeps for others. Not fatal."""
    try:
        step.commit(RECOVERABLE_NAME, json.dumps(doc).encode())
    except OSError as e:
        log.warning("stashpoint: could not mark %s recoverable without storage: %s", step.location, e)


def _drop_older_replicas(step_root: Path) -> None:
    """Replicas are kept of the newest step alone: other nodes' files in older steps go (and
    with them their steps' claim to be recoverable without storage)."""
    for other in step_root.parent.iterdir():
        # only the step directories the manager writes (a set-aside step is kept as it is)
        if other == step_root or parse_step_dir(other.name) is None or not other.is_dir() or other.is_symlink():
            continue
        try:
            _drop_replicas_of(other)
        except OSError as e:  # a step directory with entries not of ours: left as it is
            log.warning("stashpoint: could not drop the older replicas in %s: %s", other, e)


def _drop_replicas_of(step: Path) -> None:
    marks = ((REPLICA_RE.fullmatch(p.name), p) for p in step.iterdir())
    marked = {int(m[1]) for m, p in marks if m and p.is_file() and not p.is_symlink()}  # only markers we write
    (step / RECOVERABLE_NAME).unlink(missing_ok=True)
    if not marked:
        return
    storage = LocalStorage(step)
    for name in storage.list():
        parsed = parse_save_file(name)
        if parsed is not None and parsed[0] in marked:
            storage.delete(name)
    for r in marked:
        storage.delete(replica_name(r))
