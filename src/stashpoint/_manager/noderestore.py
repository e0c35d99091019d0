"""The restore of a manager with node-local directories (planned by ``_core.nodeplan``): agree
on a step the nodes hold between them, fetch onto each node what its ranks will read, then load.

With a remote tier, each step is tried from the nodes first, reading from the remote copy only
what no node holds (a node lost without replicas), then from the remote copy alone (loaded
straight from it); a step only the remote tier holds is loaded straight from it."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from stashpoint._core.naming import step_dir
from stashpoint._core.nodeplan import (
    REMOTE,
    Held,
    coverable,
    expand,
    orphan_replicas,
)
from stashpoint._dist import group as _dist
from stashpoint._dist import memfetch, stream
from stashpoint._dist.group import DistContext
from stashpoint._dist.landing import adopt_replicas
from stashpoint._dist.nodes import NodeMap, NodeSave, agree_nodes, this_node
from stashpoint._dist.transfer import RemoteCopy
from stashpoint._load.manifest import read_head
from stashpoint._manager.holdings import inventory, mark_damaged, node_order, remote_copy
from stashpoint._manager.nodefetch import NodeFetch
from stashpoint._manager.restoring import RestoreReport, reachable, try_in_order, unseen_remote
from stashpoint._manager.steps import committed_steps, move_aside
from stashpoint._storage import LocalStorage, Storage
from stashpoint.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError

log = logging.getLogger("stashpoint")


class _Recheck(Exception):
    """The local copy of ``step`` failed its load: every node checks its copy before the next try."""

    def __init__(self, step: int, error: CheckpointError) -> None:
        super().__init__(step, error)
        self.step, self.error = step, error


def _settle(mem: Path, disk: Storage, stop: threading.Event) -> None:
    """A restore's fetched files from the memory area ``mem`` into the node's step directory
    ``disk`` (logged, never raised: a later restore fetches again what is not there), then the
    area emptied."""
    t0 = time.perf_counter()
    with contextlib.suppress(OSError, AttributeError):  # training runs beside it: it takes what CPU is left
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    try:
        assert isinstance(disk, LocalStorage)
        n = memfetch.settle(mem / disk.root.name, disk, stop)
        log.info("stashpoint: copied %d fetched bytes from memory to %s in %.2f s", n, disk.location,
                 time.perf_counter() - t0)  # fmt: skip
    except Exception as e:
        log.warning("stashpoint: keeping the fetched files of %s failed (%s); a later restore fetches them again",
                    disk.location, e)  # fmt: skip
    finally:
        memfetch.wipe(mem)


class NodeLocal(NodeFetch):
    """A manager's node-local mode on this rank: its node, the job's leaders, the restore."""

    def __init__(self, world: int, replicas: int = 0, timeout: float | None = None) -> None:
        self.me = this_node(world)
        self.world = world
        self.remote_unseen = False  # a restore could not list the remote tier
        if world == 1:
            self.map = NodeMap(((0, 0),), ((0, ((0, 1),)),), (0,))
        else:
            ctx = _dist.context(None, timeout)
            assert ctx is not None
            self.map = agree_nodes(ctx, self.me, replicas)
        self.leaders = dict(self.map.leaders)
        if replicas and not 0 < replicas < len(self.leaders):
            raise ValueError(
                f"replicas={replicas} needs at least {replicas + 1} nodes (a copy on another node each); this job "
                f"runs on {len(self.leaders)}"
            )
        if self.me.leader and len(self.leaders) > 1:  # leaders move files between nodes: buffers made meanwhile
            stream.warm()
        self._save_id = ""  # rank 0: the save of the step being fetched
        self._remote: RemoteCopy | None = None  # the remote copy of the step being fetched
        self.fetched: dict[str, int] = {}  # bytes fetched onto this node by the last restore (leader)
        self.fetched_into = ""  # where they landed: "memory" or "disk" (leader)
        self._settling: threading.Thread | None = None  # the leader's copy of them to the disk
        self._stop = threading.Event()
        self._area: Path | None = None  # the leader's memory area, and its lock (None: claimed at the next restore)
        self._claim: int | None = None

    def settled(self, *, stop: bool = False) -> None:
        """Wait until what the last restore fetched into memory is in the node's directory
        (a save, a restore and the manager's ``wait`` call this first); ``stop``: have the copy
        give up within 64 MiB (a preemption's save has a deadline)."""
        if self._settling is not None:
            if stop:
                self._stop.set()
            self._settling.join()
            self._settling = None
            self._stop.clear()

    def close(self) -> None:
        """Wait for the last restore's copy, then remove the memory area and let it go."""
        self.settled()
        memfetch.release(self._claim, self._area)
        self._claim = None

    @property
    def owner(self) -> bool:
        """Whether this rank looks after its node's directory (lock, clean-up, retention)."""
        return self.me.leader

    def for_save(self, replicas: int, keep: int | None) -> NodeSave | None:
        """What this manager's saves pass on (None in a world of one: nothing to do per node)."""
        return NodeSave(self.me.node, self.map, replicas, keep) if self.world > 1 else None

    def restore(  # noqa: PLR0917
        self,
        root: Storage,
        state: Any,
        step: int | None,
        load_one: Callable[[Storage], None],
        options: dict[str, Any],
        remote: Storage | None = None,
    ) -> RestoreReport:
        """Load the newest step the nodes hold between them (or ``step``) into ``state``; with
        a ``remote`` tier's root, from its copy what no node holds."""
        from stashpoint._save import engine as _save

        _save.wait_all()
        self.settled()
        self.fetched, self.fetched_into = {}, ""
        mem = memfetch.area(root.root) if isinstance(root, LocalStorage) else None
        if self.me.leader:
            if self._claim is None:  # held while the manager is open; leftovers of crashes removed
                self._area, self._claim = mem, memfetch.claim(mem)
            mem = self._area if self._claim is not None and mem == self._area else None
        ctx = _dist.context(options.get("process_group"), options.get("timeout")) or DistContext.solo()
        checked: dict[int, str] = {}  # steps whose copies every leader has checked, after a failed load: why
        rechecked: list[tuple[int, str, str]] = []
        while True:
            order, by_node, mem = self._agree(ctx, root, remote, step, mem, checked=checked)

            def fetch_and_load(
                candidate: tuple[int, str], by_node: dict[int, tuple[Held, ...]] = by_node, mem: Path | None = mem
            ) -> None:
                s, tier = candidate
                if tier == "remote":
                    assert remote is not None
                    load_one(remote.child(step_dir(s)))
                    return
                if self.me.leader:
                    memfetch.wipe(mem)  # what an earlier try (or a crash) left there
                at = memfetch.view(root.child(step_dir(s)), mem / step_dir(s) if mem else None)
                self._remote = remote_copy(remote.child(step_dir(s))) if remote is not None else None
                holders: dict[int, Held] | CheckpointError = {}
                if ctx.rank == 0:
                    try:  # a failure goes to every rank with the first plan
                        holders = self._holders(s, by_node, remote)
                    except CheckpointError as e:
                        holders = e
                try:  # a damaged file met by the fetch (a peer's copy) or by the load: agreed by every rank
                    self._fetch(ctx, at, holders, state, options)
                    load_one(at)
                except (CorruptCheckpointError, IncompleteCheckpointError) as e:
                    if s in checked and isinstance(e, IncompleteCheckpointError):  # its damaged files are gone
                        raise CorruptCheckpointError(f"{e} (checked after: {checked[s]})") from None
                    if s in checked:
                        raise
                    raise _Recheck(s, e) from e  # the same on every rank: the load's failure is agreed

            found = None
            try:
                found = try_in_order(order, step, lambda s, t: (s, t), fetch_and_load)
            except _Recheck as r:
                # A damaged copy on one node must not cost the step while another node holds
                # a good one: each leader checks its copy, marks the damaged ranks partial (no
                # longer held there), and the nodes agree on what to try anew.
                log.error(
                    "stashpoint: the local copy of step %d is unusable (%s); checking each node's", r.step, r.error
                )
                rechecked.append((r.step, "local", str(r.error)[:2000]))
                checked[r.step] = str(r.error)[:2000]
                if self.me.leader:
                    try:  # whatever happens here, this leader goes on to the agreement the others wait in
                        mark_damaged(root, r.step, str(r.error))
                    except Exception as e:
                        log.warning("stashpoint: checking this node's copy of step %d failed: %s", r.step, e)
                continue
            finally:  # the memory area: copied to the node's directory once loaded, else emptied
                loaded = found[0] if found is not None and found[1] == "local" else None
                if self.me.leader and mem is not None and loaded is not None and (mem / step_dir(loaded)).is_dir():
                    self.fetched_into = "memory"  # every rank of the node has loaded (the load agrees at its end)
                    self._settling = threading.Thread(
                        target=_settle, args=(mem, root.child(step_dir(loaded)), self._stop), name="stashpoint-settle"
                    )
                    self._settling.start()
                elif self.me.leader:
                    memfetch.wipe(mem)
                    self.fetched_into = "disk" if self.fetched else ""
            break
        if found is None:
            return RestoreReport(None, None, tuple(order), tuple(rechecked))
        candidate, tier, damaged = found
        if step is None:
            for s, t, _ in damaged:
                if t == "local" and self.me.leader:
                    move_aside(root, s)
                elif t == "remote" and ctx.rank == 0 and remote is not None:
                    move_aside(remote, s)
        return RestoreReport(candidate, tier, tuple(order), tuple(rechecked + damaged))

    def _agree(
        self,
        ctx: DistContext,
        root: Storage,
        remote: Storage | None,
        step: int | None,
        mem: Path | None,
        *,
        checked: Mapping[int, str],  # steps rechecked after a failed load: why
    ) -> tuple[list[tuple[int, str]], dict[int, tuple[Held, ...]], Path | None]:
        """Every node's holdings gathered and the copies to try agreed (newest first), with
        what each node holds and this node's memory area (None where its ranks read its
        directory alone); the last copies of lost nodes' files adopted, and the steps no
        restore can take set aside."""
        mine: Any = None
        damaged = dict(checked)  # the steps this node found damaged, and why; then any node's that no restore can take
        if self.me.leader:
            try:
                remote_steps = reachable(lambda: committed_steps(remote)) if ctx.rank == 0 and remote else []
                held = inventory(root, damaged)
                mine = (self.me.node, held, remote_steps, mem is not None, {k: v[:300] for k, v in damaged.items()})
            except Exception as e:
                mine = f"rank {ctx.rank}: listing {root.location} failed: {type(e).__name__}: {e}"
        seen = ctx.gather("node-local: what each node holds", mine)
        answer: Any = None
        by_node: dict[int, tuple[Held, ...]] = {}
        if seen is not None:
            errors = [s for s in seen if isinstance(s, str)]
            if errors:
                answer = ("error", "; ".join(errors[:8])[:4000])
            else:
                by_node = {s[0]: s[1] for s in seen if s is not None}
                on_disk = sorted(s[0] for s in seen if s is not None and not s[3])  # leaders without an area
                unseen = seen[0][2] is None  # the remote tier could not be listed: nothing is torn for sure
                order, torn = node_order(by_node, seen[0][2] or [], step)
                torn = [] if unseen else torn
                harmed = {k: f"node {n[0]}: {why}" for n in reversed(seen) if n is not None for k, why in n[4].items()}
                answer = (
                    "ok",
                    order,
                    torn,
                    on_disk,
                    orphan_replicas(by_node),
                    unseen,
                    {k: harmed[k] for k in torn if k in harmed},
                )
        answer = ctx.broadcast("node-local: the steps to try", answer)
        if answer[0] == "error":
            raise CheckpointError("listing the node-local checkpoints failed: " + answer[1])
        order, torn, damaged = answer[1], answer[2], answer[6]
        if self.me.node in answer[3]:  # the node's ranks read through its area only where its leader holds it
            mem = None
        if self.me.leader and isinstance(root, LocalStorage):
            for s, rs in answer[4].get(self.me.node, ()):
                log.warning("stashpoint: this node's replicas of step %d are the last copies; kept as its own", s)
                adopt_replicas(root.root / step_dir(s), expand(rs))
        if self.me.leader:  # no restore can take them (some rank's files are on no node): set aside
            for s in torn:
                if (step is None or s != step) and s in damaged and root.child(step_dir(s)).exists():
                    log.warning(
                        "stashpoint: step %d cannot be restored (%s) and no other node holds what that copy lacks; "
                        "it is moved aside as step-N.damaged-<time>", s, damaged[s],
                    )  # fmt: skip
                    move_aside(root, s, "damaged")
                elif (step is None or s != step) and root.child(step_dir(s)).exists():
                    log.warning(
                        "stashpoint: step %d lacks some saving rank's files on every node of this job (a node that "
                        "saved it lost its directory, or is not in this job); it is moved aside as "
                        "step-N.incomplete-<time>, kept: if the nodes holding the rest come back, rename it back on "
                        "each node and restart with them",
                        s,
                    )
                    move_aside(root, s, "incomplete")
        self.remote_unseen = bool(answer[5]) and remote is not None
        if self.remote_unseen and not order and remote is not None:
            raise unseen_remote(remote.location)
        if step is not None and step in torn and step in checked:  # the damaged files were all it had
            raise CorruptCheckpointError(
                f"step {step} at {root.location}: no node holds an undamaged copy of some of its files "
                f"({checked[step]}); restore another step"
            )
        if step is not None and step in torn:
            raise IncompleteCheckpointError(
                f"step {step} at {root.location} is incomplete on this job's nodes: some saving rank's files are "
                "on no node of this job (a node that saved it lost its directory or is not in this job, or the "
                f"nodes hold different saves of it){' and on no remote tier' if remote is not None else ''}; "
                "restart with the nodes that hold them, or restore another step"
            )
        if step is not None and not order:
            order = [(step, "local")]  # raises CheckpointNotFoundError, naming the path
        return order, by_node, mem

    def _holders(self, step: int, by_node: dict[int, tuple[Held, ...]], remote: Storage | None) -> dict[int, Held]:
        """Rank 0: what each node holds of ``step`` (one save of it), and the remote tier's
        copy as :data:`REMOTE` where the nodes do not hold it all."""
        nodes = {n: h for n, hs in by_node.items() for h in hs if h.step == step}
        covered = coverable({n: (h,) for n, h in nodes.items()})
        if step in covered or remote is None:
            self._save_id = next(iter(nodes.values())).save_id if nodes else ""
            return covered.get(step, nodes)
        at = remote.child(step_dir(step))
        head = read_head(at)
        self._save_id = head.save_id
        ours = {n: h for n, h in nodes.items() if h.save_id == head.save_id}
        return {**ours, REMOTE: Held(step, head.save_id, head.world_size, ((0, head.world_size),))}
