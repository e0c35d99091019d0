"""Collective saves across ranks, coordinated on a dedicated gloo process group.

stashpoint never issues a collective on the training's process group. It creates, once and
lazily, its own gloo group over the same ranks, and every collective of a save runs on the
background writer thread, which owns that group: the caller's thread (the training loop) issues
none, so a background save cannot interleave with the training's all-reduce, and no two threads
ever use the same group.

One save, on every rank's writer thread:

1. exchange a hash of each rank's tensor layout (and, when it changed, the layout itself) and
   compute who writes which chunk — replicated chunks once in total, balanced over their holders;
2. write this rank's shards and make them durable;
3. exchange each rank's outcome and state tree; if any rank failed, every rank raises an error
   naming the failed ranks, and nothing is committed;
4. rank 0 writes the manifest (the commit) and tells the others whether it succeeded.
"""

from __future__ import annotations

import datetime as _dt
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import xxhash

from stashpoint import _runtime
from stashpoint._dist import messages as _messages
from stashpoint._dist.arrival import (
    CollectiveError,
    Mark,
    absent,
    all_came,
    arm,
    came,
    ranks_text,
    settle,
    store,
    watch,
)
from stashpoint._dist.gloo import gloo_group

if TYPE_CHECKING:
    from stashpoint._dist.commit import Plan
from stashpoint.errors import CheckpointError

log = logging.getLogger("stashpoint")

DEFAULT_TIMEOUT_S = 600.0
_T = TypeVar("_T")


@dataclass
class DistContext:
    """The checkpoint group a collective save or load runs on."""

    group: Any
    ranks: tuple[int, ...]
    rank: int
    world: int
    timeout_s: float
    # The last plan: every rank's layout hash, every rank's layout, and who writes which chunk.
    # Set on every rank at the same point of the same save, so all ranks decide alike whether
    # it can be reused (the hashes of this save equal its hashes) and skip the layout exchange.
    last_plan: Plan | None = None
    # The last plan was made under constraint (some rank had copied only its part of an older
    # plan): the next save copies everything, to plan freely (balanced) again.
    plan_constrained: bool = False
    # Layout hashes of this rank for which some save found a tensor nobody had copied: for
    # those, this rank copies everything (on every rank alike, so it cannot happen again).
    copy_all: set[str] = field(default_factory=set)
    plans_made: int = 0  # how many times the layouts were exchanged and a plan computed
    plans_described: int = 0  # of those, how many from descriptions (no rank sent its layout)
    saves: int = 0  # collective saves started on this rank: every rank must agree on the count
    calls: int = 0  # collectives issued on this group by this rank (the same count on every rank)
    sent: int = 0  # payload bytes this rank sent on the group (gather slots, pickled messages)
    received: int = 0  # and received (rank 0 receives every gathered slot)
    marks: dict[int, Mark] = field(default_factory=dict)  # this rank's arrivals at its last two collectives
    made: int = 1  # the how-manieth group over these ranks and for this purpose (alike on every rank)

    spans_hosts: bool | None = None
    purpose: str = "save"  # contexts of other purposes (tier uploads) have their own group
    applied_timeout_s: float | None = None  # the group's timeout, set by the thread that uses it
    closed: bool = False  # shutdown() destroyed its group: a holder takes a fresh context (``context``)

    def _apply_timeout(self) -> None:
        if self.applied_timeout_s is None:
            self.applied_timeout_s = self.timeout_s  # the timeout the group was created with
        if self.applied_timeout_s == self.timeout_s or self.group is None:
            return
        from torch.distributed import distributed_c10d

        distributed_c10d._set_pg_timeout(_dt.timedelta(seconds=self.timeout_s), self.group)
        self.applied_timeout_s = self.timeout_s

    @functools.cached_property
    def world_numbered(self) -> bool:
        """Whether group rank ``r`` is global rank ``r`` (as device meshes number ranks); once."""
        return self.ranks == tuple(range(self.world))

    def multi_host(self) -> bool:
        """Whether the ranks run on more than one host (asked once, then remembered)."""
        if self.spans_hosts is None:
            import socket

            names = self.gather("host names", socket.gethostname())  # rank 0 alone receives R
            self.spans_hosts = bool(self.broadcast("several hosts", None if names is None else len(set(names)) > 1))
        return self.spans_hosts

    @classmethod
    def solo(cls) -> DistContext:
        """A world of one process: collectives are trivial."""
        return cls(None, (0,), 0, 1, DEFAULT_TIMEOUT_S)

    def _store_prefix(self) -> str:
        """This group's keys in the job's store: bounded in size whatever the number of ranks
        (the store refuses long keys), by a hash of the ranks; and which group of those ranks
        it is (a group made anew after a failure counts its collectives from 1 again, and the
        marks its ranks set as the old one failed are never taken away)."""
        return self._prefix

    @functools.cached_property
    def _prefix(self) -> str:  # once: the ranks' repr is 100 KB at 16,384 ranks, and every collective asks
        return f"stashpoint/{self.purpose}/{xxhash.xxh3_64_hexdigest(repr(self.ranks).encode())}/{self.made}"

    def collective(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a collective on the checkpoint group; turn failures into a clear error that names
        the ranks that never reached it (each rank marks its arrival in the job's store)."""
        self.calls += 1
        mark = f"{self._prefix}/{self.calls}"
        marks = store() if self.world > 1 else None
        arrived = arm(marks, f"{mark}/{self.rank}") if marks is not None else None
        if self.calls > 2 and (old := self.marks.pop(self.calls - 2, None)) is not None:
            old.forget()  # this rank's mark of two collectives ago (rank 0 may have looked late)
        if arrived is not None:
            self.marks[self.calls] = arrived
        t0 = time.monotonic()
        # a rank done with a rooted collective (a gather's sender) waits, and marks, in the next
        seen = [f"{self._prefix}/{c}" for c in range(self.calls, self.calls + 3)]
        timer = watch(what, self.rank, self.world, self.timeout_s, store=marks, mark=seen)
        try:
            self._apply_timeout()
            return fn(*args, group=self.group, **kwargs)
        except Exception as e:
            import torch.distributed as dist

            forget(self)  # out of step or broken (a timeout closes gloo's pairs): the next call makes a new one
            if arrived is not None:
                arrived.now()

            if what != "shutdown" and _torn_down(dist):  # the program tore the job down under this save
                raise CollectiveError(
                    f"rank {self.rank}: torch.distributed's process group was destroyed while the checkpoint "
                    f"collective '{what}' ran: wait for saves in flight (handle.wait(), the manager's wait() or "
                    "close(), or stashpoint.shutdown()) before torch.distributed.destroy_process_group()"
                ) from e
            # only the group's first rank looks for the absent (R / 256 store calls, not R per rank)
            missing = []
            if self.rank == 0 and marks is not None:
                settle()
                missing = absent(marks, seen, self.world)
            if missing:
                who = f"{ranks_text(missing)} never reached it"
            else:
                who = "a peer rank left it" + ("" if self.rank == 0 else "; rank 0's error names any that never came")
            raise CollectiveError(
                f"rank {self.rank}: the checkpoint collective '{what}' failed after {time.monotonic() - t0:.1f} s "
                f"(timeout {self.timeout_s:.0f} s; a peer rank died, stalled, or left the save: {who}): "
                f"{type(e).__name__}: {str(e)[:300]}"
            ) from e
        finally:
            if arrived is not None:
                arrived.cancel()
            if timer is not None:
                timer.cancel()

    def all_gather(self, what: str, obj: Any) -> list[Any]:
        return self._tagged(_messages.all_gather, what, obj)

    def gather(self, what: str, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on the group's first rank only, None on the others (see
        :func:`stashpoint._dist.messages.gather`)."""
        return self._tagged(_messages.gather, what, obj)

    def scatter(self, what: str, objs: list[Any] | None) -> Any:
        """Rank ``r``'s item of ``objs`` (given on rank 0 only), sent to it alone."""
        return self._tagged(_messages.scatter, what, objs)

    def broadcast(self, what: str, obj: Any, src: int = 0) -> Any:
        """``obj`` of the group's rank ``src``, on every rank."""
        return self._tagged(_messages.broadcast, what, obj, src)

    def _tagged(self, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            return fn(self, *args)
        except _messages.OutOfStep as e:
            forget(self)  # its collectives no longer pair: the next call makes a fresh group
            raise CollectiveError(str(e)) from None


_lock = threading.Lock()


def _contexts() -> dict[tuple[tuple[int, ...], str], DistContext]:
    """stashpoint's groups: one per set of ranks and purpose, whatever the timeouts asked."""
    return _runtime.slot("dist.groups", dict, close=_destroy, order=30)


SHUTDOWN_TIMEOUT_S = 60.0


def _torn_down(dist: Any, wait_s: float = 1.0) -> bool:
    """Whether the program destroyed torch.distributed's groups under a collective that failed.
    A peer's teardown can fail the collective here before this rank's own teardown, begun at
    about the same time, has ended: a failure waits a moment for it."""
    deadline = time.monotonic() + wait_s
    while dist.is_initialized():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# Groups created over these ranks for this purpose: the next one's name (each group's own, so a
# group made after shutdown() destroyed one never meets the old one's rendezvous keys).
_made: dict[tuple[tuple[int, ...], str], int] = {}


def _destroy(contexts: dict[tuple[tuple[int, ...], str], DistContext]) -> None:
    """Destroy stashpoint's groups, each once all its ranks got here (every rank calls
    ``shutdown()``): a rank never tears a group down while a peer still uses it. A group whose
    peers do not all arrive is left to the process's end; so is every group at the exit of a
    process ending on an exception nothing caught (a peer may be waiting on it in a save)."""
    import torch.distributed as dist

    if _runtime.exiting_on_error():  # no barrier: the peers may wait on this rank, which is ending
        contexts.clear()
        return
    for ctx in sorted(contexts.values(), key=lambda c: (c.ranks, c.purpose)):  # the same order on every rank
        if ctx.group is None or not (dist.is_available() and dist.is_initialized()):
            continue
        try:
            ctx.timeout_s = min(ctx.timeout_s, SHUTDOWN_TIMEOUT_S)
            ctx.collective("shutdown", dist.barrier)
            dist.destroy_process_group(ctx.group)
        except Exception as e:
            log.warning("stashpoint: left a checkpoint group of ranks %s in place at shutdown: %s", list(ctx.ranks), e)
    for ctx in contexts.values():
        ctx.closed = True
    contexts.clear()


def forget(ctx: DistContext) -> None:
    """Drop a context whose group failed; the next collective save creates a fresh group."""
    with _lock:
        contexts = _contexts()
        for k, v in list(contexts.items()):
            if v is ctx:
                del contexts[k]


#: ``process_group=LOCAL``: this process alone, even when torch.distributed is initialized (a
#: framework that saves on rank 0 only, e.g. Lightning under DDP): no collective at all.
class _Local:
    def __repr__(self) -> str:
        return "stashpoint's LOCAL group (this process alone)"


LOCAL: Any = _Local()


def context(process_group: Any = None, timeout_s: float | None = None, purpose: str = "save") -> DistContext | None:
    """The checkpoint context for ``process_group`` (default: the world), or None when not
    distributed. Creates stashpoint's own gloo group over the same ranks on first use; every
    member rank must call this (it happens in the first collective save or load).

    Each ``purpose`` gets its own group, for a thread of its own: ``"save"`` (the writer thread,
    and loads once saves are done) and ``"upload"`` (the tier uploader)."""
    import torch.distributed as dist

    if process_group is LOCAL:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise CheckpointError(
                "a process_group was given but torch.distributed is not initialized; call "
                "torch.distributed.init_process_group first"
            )
        return None
    src = process_group if process_group is not None else dist.group.WORLD
    if src is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of the process_group given: only its ranks may save or load "
            "with it (give the others their own group, or call only on its ranks)"
        )
    if not isinstance(src, dist.ProcessGroup):
        hint = " (a DeviceMesh's is mesh.get_group())" if type(src).__name__ == "DeviceMesh" else ""
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup{hint}, not {type(src).__name__}")
    ranks = tuple(dist.get_process_group_ranks(src))
    if dist.get_rank() not in ranks:
        raise ValueError(f"rank {dist.get_rank()} is not in the process_group given (ranks {list(ranks)[:16]})")
    if len(ranks) == 1:
        return None
    timeout = float(timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
    with _lock:
        contexts = _contexts()
        ctx = contexts.get((ranks, purpose))
        if ctx is not None:
            ctx.timeout_s = timeout  # applied by the thread that runs the next collective
        else:
            me = ranks.index(dist.get_rank())
            made = _made.get((ranks, purpose), 0) + 1  # counted once created: alike on every rank
            mark = f"stashpoint/{purpose}/{xxhash.xxh3_64_hexdigest(repr(ranks).encode())}/group-{made}"
            all_came(store(), mark, me, len(ranks), timeout)
            try:
                group = gloo_group(
                    ranks=list(ranks),
                    timeout=_dt.timedelta(seconds=timeout),
                    use_local_synchronization=True,
                    name=mark.replace("/", "-"),
                )
            except Exception as e:
                raise CollectiveError(
                    f"could not create stashpoint's checkpoint process group over {ranks_text(list(ranks))} "
                    f"within {timeout:.0f} s (is every rank alive and saving?): {type(e).__name__}: {str(e)[:300]}"
                ) from e
            _made[(ranks, purpose)] = made
            came(store(), mark, me)
            ctx = DistContext(group, ranks, dist.get_rank(group), len(ranks), timeout, purpose=purpose, made=made)
            contexts[(ranks, purpose)] = ctx
    return ctx


def world_context(purpose: str, make: Callable[[], Any], timeout_s: float) -> DistContext:
    """stashpoint's group over the whole world for ``purpose``, made by ``make()`` (on every
    rank at the same point) where there is none yet, and kept for the next holder: one group
    per purpose for the process, not one per object that needs it, destroyed by ``shutdown()``
    (or dropped by :func:`forget` after a failure)."""
    import torch.distributed as dist

    ranks = tuple(range(dist.get_world_size()))
    with _lock:
        ctx = _contexts().get((ranks, purpose))
    if ctx is not None:
        return ctx
    made = _made.get((ranks, purpose), 0) + 1
    group = make()  # not under the lock: a writer thread's save may make its own group meanwhile
    ctx = DistContext(group, ranks, dist.get_rank(), len(ranks), timeout_s, purpose=purpose, made=made)
    with _lock:
        _made[(ranks, purpose)] = made
        _contexts()[(ranks, purpose)] = ctx
    return ctx


def rank_of(process_group: Any = None) -> tuple[int, int]:
    """``(rank, world size)`` in ``process_group`` (default: the world); ``(0, 1)`` when not distributed."""
    import torch.distributed as dist

    if process_group is LOCAL or not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    src = process_group if process_group is not None else dist.group.WORLD
    return dist.get_rank(src), dist.get_world_size(src)
