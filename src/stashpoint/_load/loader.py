"""load: read a committed checkpoint straight into the tensors of a live state."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
import xxhash

from stashpoint import _runtime
from stashpoint._core.assign import READ_SHARE_FLOOR, Item, assign_readers
from stashpoint._core.format import Manifest
from stashpoint._core.index import Head
from stashpoint._core.nodeplan import merge
from stashpoint._core.nodes import wrapper_hint
from stashpoint._core.policy import flag, seconds_or_none
from stashpoint._core.reshard import Box, intersect
from stashpoint._core.sealed import short_of_memory
from stashpoint._dist import group as _dist
from stashpoint._dist.group import DistContext, rank_of
from stashpoint._load.applying import apply, apply_together, call
from stashpoint._load.exchange import agree, broadcast_shares, kinded_failure, own_or_agreed
from stashpoint._load.manifest import as_changed, forget, read_head, read_view, remembered, unlisted_shards, writers_of
from stashpoint._load.reads import Fetched, fetch, prepare_reads, run_reads
from stashpoint._load.restore import Planner
from stashpoint._load.restoreplan import Read, with_tied_apart
from stashpoint._load.restoreplan import RestorePlan as Plan
from stashpoint._runtime import gc_paused
from stashpoint._storage import Storage, env_number, storage_for
from stashpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StateMismatchError,
)

log = logging.getLogger("stashpoint")


def load(
    state: Any,
    path: str | os.PathLike[str] | Storage,
    *,
    strict: bool = True,
    partial: bool = False,
    verify: bool = True,
    allow_pickle: bool = False,
    process_group: Any = None,
    exchange: bool | None = None,
    timeout: float | None = None,
    atomic: bool = False,
) -> None:
    """Restore the checkpoint at ``path`` in place into the objects held by ``state``.

    Tensors are read straight into the state's tensors (CPU or CUDA); objects with
    ``load_state_dict`` get their state back; plain values come back whole from the checkpoint.

    Args:
        state: the live state, with the same structure as the saved one.
        path: the checkpoint directory.
        strict: raise :class:`StateMismatchError` listing every missing or unexpected key and
            every shape or dtype difference. With ``strict=False`` what matches is loaded and the
            rest is reported as a warning.
        partial: load only what ``state`` holds: keys of the checkpoint's dicts that the state
            lacks, at any depth (a module's state dict too, and parameters an optimizer no longer
            holds), are skipped and their bytes not read, as DCP does (e.g. ``{"model": model}``
            from a full training checkpoint). Keys the state holds and the checkpoint lacks still
            fail.
        verify: check every tensor's checksum (:class:`CorruptCheckpointError` on mismatch).
        allow_pickle: unpickle values saved with ``allow_pickle=True``. Unpickling runs code
            from the file: only for files you trust.
        process_group: in a distributed run, the group whose ranks load (default: the world);
            every rank of it calls ``load``. Each rank reads only the byte ranges its tensors
            (or DTensor shards) need, whatever the world size and sharding at save time, and
            gets back the plain values its rank saved (rank ``r`` gets those of rank ``r mod N``
            when N ranks saved).
        exchange: in a distributed run, read regions that every rank needs (replicated tensors)
            from storage once in total — each rank reads a share and broadcasts it on the
            checkpoint group — instead of every rank reading everything it needs directly. The
            default (None) exchanges when the ranks span several hosts: ranks on one host share
            its page cache (tensors every rank needs are read through it; the rest with direct
            I/O), so there storage sees each byte about once anyway and reading without the
            exchange is faster (see benchmarks/RESULTS.md).
        timeout: seconds a collective step may wait for the other ranks (default 600).
        atomic: all or nothing: every byte is read and verified into buffers of the load's
            own, and only when that succeeded (on every rank) do the state's tensors, plain
            values and objects change, so a load that raises leaves the state as it was (torch's
            optimizers and LR schedulers are loaded on a copy first; another object's own
            ``load_state_dict`` cannot be tried: it runs last, and one that raises leaves the
            tensors and plain values loaded, as the error says). It
            holds the bytes read once more in host memory until they land and costs 1.5-2.1x
            the load time on CPU tensors (benchmarks/RESULTS.md), hence not the default. Without
            it (the default) plain values and objects change only after every read succeeded,
            but a load that raises may leave some tensors holding the checkpoint's values:
            load a good checkpoint before training on (``CheckpointManager.restore`` does).

    A save to ``path`` still in flight in this process (``async_save``) is waited for first.
    """
    seconds_or_none("timeout", timeout)
    for name, value in (("strict", strict), ("partial", partial), ("verify", verify), ("atomic", atomic)):
        flag(name, value)
    flag("allow_pickle", allow_pickle)
    # a process that never started a save has none in flight: a restarted one loads without
    # importing the save engine (22 ms, a tenth of its first load)
    saved = _runtime.peek("save.engine") is not None or _runtime.peek("save.overlap") is not None
    if saved:
        from stashpoint._save.engine import wait_all, wait_staged

        wait_staged()  # an overlap=True save still copying these objects must not see loaded values
    storage = storage_for(path)
    if saved:
        wait_all(storage.location)  # loading a checkpoint still being saved sees it committed
    rank, world = rank_of(process_group)
    if world > 1 and saved:
        wait_all()  # the checkpoint group is used by one thread at a time: saves in flight first
    # the waits above are not paused: only the load's own work (its small objects must not set
    # off full collections; see gc_paused)
    with gc_paused():
        manifest = Manifest("", "", "", "", (), {}, ({},))
        plan: Plan | None = None
        plan_error: CheckpointError | None = None
        save_id: str | None = None
        try:  # any rank's failure, from the manifest's read on, goes through the ranks' agreement
            head = _head(storage)
            save_id = head.save_id
            if world != head.world_size:
                # one process reading an N-rank checkpoint is an evaluation or an export, as a rule:
                # said for the logs; ranks of another count resuming are told
                log.log(
                    logging.INFO if world == 1 else logging.WARNING,
                    "stashpoint: %s was saved by %d rank%s and is loaded by %d; rank %d restores the per-rank "
                    "values (RNG states, ...) of saved rank %d",
                    storage.location,
                    head.world_size,
                    "s" if head.world_size > 1 else "",
                    world,
                    rank,
                    rank % head.world_size,
                )
            manifest, plan = _plan(storage, head, state, rank, allow_pickle=allow_pickle, partial=partial)
            if plan.problems and strict:
                hint = wrapper_hint(plan.missing, plan.unexpected) or _cast_hint(plan.casts)
                plan_error = StateMismatchError(storage.location, plan.problems, hint=hint)
        except CheckpointError as e:
            plan_error = as_changed(e, storage, save_id)
        except MemoryError as e:  # through the ranks' agreement too: the others must not wait it out
            plan_error = short_of_memory(f"planning the load of {storage.location} on rank {rank}", e)
        if world == 1:
            if plan_error is not None:
                raise plan_error
            assert plan is not None
            _warn_skipped(plan, storage.location, 3)
            fetched, error = _read(storage, manifest, plan, plan.reads, verify=verify, atomic=atomic, shared_host=False)
            if error is not None:
                raise as_changed(error, storage, save_id)
            if fetched is not None:
                fetched.land()
        else:
            ctx = _dist.context(process_group, timeout)
            assert ctx is not None
            plan = _load_together(
                ctx, storage, manifest, plan, plan_error, verify=verify, atomic=atomic, exchange=exchange
            )
            apply_together(ctx, plan, storage.location)
            return
        apply(plan, storage.location)


def _head(storage: Storage) -> Manifest | Head:
    """The checkpoint's manifest (a version-1 one checked for shards it does not list)."""
    head = read_head(storage)
    if isinstance(head, Manifest):  # format version 1: the manifest lists every chunk
        extra = unlisted_shards(storage, head)
        if extra:
            raise CorruptCheckpointError(
                f"shard {storage.location}/{extra[0]} belongs to this checkpoint's save but its manifest does not "
                f"list it ({len(extra)} such file(s)): the manifest is damaged or incomplete. Load an earlier "
                "checkpoint."
            )
    return head


def _plan(
    storage: Storage, head: Manifest | Head, state: Any, rank: int, *, allow_pickle: bool, partial: bool = False
) -> tuple[Manifest, Plan]:
    """This rank's restore plan and the part of the checkpoint it reads: a version-2 checkpoint
    reads its own rank's index (its tree), plans, then the indexes of the chunks it needs."""
    if isinstance(head, Manifest):
        plan = Planner(head, state, allow_pickle=allow_pickle, where=storage.location, rank=rank, partial=partial).run()
        return head, with_tied_apart(plan, head.tensors)
    plan, have = _own_plan(storage, head, state, rank, partial=partial, allow_pickle=allow_pickle)
    needed = writers_of(head, ((r.key, r.region) for r in plan.reads))
    view = read_view(storage, head, needed, rank % head.world_size, have)
    return view, with_tied_apart(plan, view.tensors)


def _cast_hint(casts: set[tuple[str, str]]) -> str | None:
    """For tensors of the saved shape in another dtype: a load never casts (it reads into the
    state's own memory); say how to get there."""
    if not casts:
        return None
    saved, live = sorted(casts)[0]
    return (
        f"a load does not cast ({saved} saved, {live} in the state): build the model in {saved}, load, "
        f"then cast it (model.to(torch.{live})); or read the tensors with stashpoint.read(path) and copy_() them"
    )


def _warn_skipped(plan: Plan, location: str, stacklevel: int) -> None:
    if plan.problems:
        msg = f"stashpoint: loading {location} skipped {len(plan.problems)} mismatch(es):\n  - " + "\n  - ".join(
            plan.problems
        )
        warnings.warn(msg, stacklevel=stacklevel)  # at the caller of load()
        log.info(msg)  # for logs kept; a warning too would print the text twice without logging set up


#: What a failed load that was not atomic adds to its error (a manager's restore, which loads
#: another step in its stead, leaves it out of its log).
PARTLY_LOADED = (
    "Some of the state's tensors (the model's, and the optimizer's moments and step counts) may already hold "
    "this checkpoint's values; its plain values, the optimizer's hyperparameters and other objects are unchanged. "
    "Load a good checkpoint before training on, or load with atomic=True, which leaves the whole state untouched "
    "when a load fails."
)


def _read(
    storage: Storage,
    manifest: Manifest,
    plan: Plan,
    reads: list[Read],
    *,
    verify: bool,
    atomic: bool,
    shared_host: bool,
) -> tuple[Fetched | None, CheckpointError | None]:
    """Read this rank's part: into the state (or, ``atomic``, into buffers landed later, once the
    objects' own loads are known to take their state)."""
    try:
        if atomic:
            fetched = fetch(storage, manifest, reads, verify=verify, ranks_share_host=shared_host)
            for where, check in plan.checks:
                call(check, where, storage.location)
            return fetched, None
        pieces = prepare_reads(storage, manifest, reads, ranks_share_host=shared_host)
    except CheckpointError as e:  # nothing read into the state yet
        return None, e
    try:
        run_reads(storage, pieces, verify=verify)
        return None, None
    except CheckpointError as e:
        if not pieces:
            return None, e
        return None, type(e)(f"{e}\n{PARTLY_LOADED}")


def _load_together(
    ctx: DistContext,
    storage: Storage,
    manifest: Manifest,
    plan: Plan | None,
    plan_error: CheckpointError | None,
    *,
    verify: bool,
    atomic: bool,
    exchange: bool | None,
) -> Plan:
    """The N-rank load: every rank takes the same path (all load, or all raise). With
    ``exchange``, regions every rank needs are read once in total and broadcast."""
    multi_host = ctx.multi_host()  # on every rank, whatever its ``exchange``: a collective the first time
    share = exchange if exchange is not None else multi_host
    reads: list[Read] = [] if plan is None or plan_error else plan.reads
    # Only whole tensors can be wanted by every rank (a part is one rank's shard). Each rank
    # sends a hash of those; when all ranks want the same, each works out alone who reads what.
    wanted = {
        (r.key, r.region): r.region.numel * r.dest.element_size()
        for r in reads
        if share and r.region == Box.whole(manifest.tensors[r.key].shape)
    }
    items = sorted((k, b.offsets, b.shape, n) for (k, b), n in wanted.items())
    floor = int(env_number("STASHPOINT_READ_SHARE_FLOOR", READ_SHARE_FLOOR, 0, 1 << 50))  # agreed with the items
    digest = xxhash.xxh3_128_intdigest(repr((floor, items)).encode())  # not a str: a str status is an error
    try:
        # the checkpoint's identity first: ranks that picked different checkpoints fail together
        status = kinded_failure(plan_error) if plan_error else [manifest.save_id, digest]
        alike = agree(ctx, "load plans", status, CorruptCheckpointError, path=str(storage.location))
    except CheckpointError as agreed:
        raise own_or_agreed(plan_error, agreed, same_class=True) from None
    assert plan is not None  # every rank planned: agree() raised otherwise
    readers: dict[Item, int] = {}
    if share and alike and wanted:
        readers = assign_readers(wanted, ctx.world, floor)  # alike everywhere: every rank's digest agreed
        reads = [r for r in reads if readers.get((r.key, r.region), ctx.rank) == ctx.rank]
    _warn_skipped(plan, storage.location, 4)
    fetched, error = _read(storage, manifest, plan, reads, verify=verify, atomic=atomic, shared_host=not share)
    if error is not None:
        error = as_changed(error, storage, manifest.save_id)
    try:
        agree(
            ctx, "load reads", kinded_failure(error) if error else 0, CorruptCheckpointError, path=str(storage.location)
        )
    except CheckpointError as agreed:
        raise own_or_agreed(error, agreed, same_class=True) from None
    if fetched is not None:  # every rank read and verified its part: now the state changes
        fetched.land()
    if readers:
        dests: dict[Item, torch.Tensor] = {}
        for r in plan.reads:
            dests.setdefault((r.key, r.region), r.dest)
        with torch.no_grad():
            broadcast_shares(ctx, readers, dests)
            for r in plan.reads:  # a second destination of the same region (rare): copy it over
                first = dests[(r.key, r.region)]
                if (r.key, r.region) in readers and r.dest is not first:
                    r.dest.copy_(first)
    return plan


def _own_plan(
    storage: Storage, head: Head, state: Any, rank: int, *, partial: bool, allow_pickle: bool
) -> tuple[Plan, dict[int, Any]]:
    """This rank's plan from its own index (the tree to plan with), and the indexes read so far
    (each is read once: a load adds the others it needs). Within ``remembering`` (a restore),
    planned once per checkpoint and state."""

    def make() -> tuple[Any, Head, Plan, dict[int, Any]]:
        have: dict[int, Any] = {}
        manifest = read_view(storage, head, (), rank % head.world_size, have)
        where = storage.location
        plan = Planner(manifest, state, allow_pickle=allow_pickle, where=where, rank=rank, partial=partial).run()
        return state, head, plan, have  # held: their ids stay theirs while remembered

    key = ("plan", storage.location, id(state), id(head), rank, partial, allow_pickle)
    # one plan at a time: a restore passing a damaged step by plans the next one, and a fresh
    # optimizer's plan holds state tensors made for it (on the GPU: a second optimizer's worth)
    forget(lambda k: k[0] == "plan" and k != key)
    _, _, plan, have = remembered(key, make)
    return plan, have


def _head_v2(storage: Storage) -> Head:
    head = read_head(storage)
    if isinstance(head, Manifest):
        raise CheckpointError(f"{storage.location} is a format-1 checkpoint; node-local restores read format 2")
    return head


def writers_needed(
    storage: Storage, state: Any, rank: int, *, partial: bool = False, allow_pickle: bool = False
) -> set[int]:
    """The saving ranks whose files a load of ``state`` by ``rank`` reads: its own index's
    rank and the writers of every region it plans to read (a node-local restore fetches what
    its node lacks first). Needs the manifest and this rank's own index only."""
    head = _head_v2(storage)
    plan, _ = _own_plan(storage, head, state, rank, partial=partial, allow_pickle=allow_pickle)
    return {rank % head.world_size} | writers_of(head, ((r.key, r.region) for r in plan.reads))


def ranges_needed(
    storage: Storage, state: Any, rank: int, *, skip: set[int], partial: bool = False, allow_pickle: bool = False
) -> dict[str, tuple[int, int, list[tuple[int, int]]]]:
    """The byte ranges a load of ``state`` by ``rank`` reads of the shards of saving ranks not
    in ``skip``: file -> (its saving rank, its size, [header, every chunk it reads]). Needs the
    indexes of those ranks."""
    head = _head_v2(storage)
    plan, have = _own_plan(storage, head, state, rank, partial=partial, allow_pickle=allow_pickle)
    needed = writers_of(head, ((r.key, r.region) for r in plan.reads)) - skip
    manifest = read_view(storage, head, needed, rank % head.world_size, have)
    out = {f.name: (f.rank, f.size, [(0, f.data_start)]) for f in manifest.files if f.rank in needed}
    for r in plan.reads:
        entry = manifest.tensors.get(r.key)
        for c in entry.chunks if entry is not None else ():
            if c.file in out and intersect(Box(c.offsets, c.shape), r.region) is not None:
                out[c.file][2].append((c.start, c.end))
    # merged before they travel: rank 0 gathers every rank's (one chunk per parameter, unmerged)
    return {name: (rank, size, list(merge(rs))) for name, (rank, size, rs) in out.items()}
