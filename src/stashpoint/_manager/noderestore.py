"""The restore of a manager with node-local directories (planned by ``_core.nodeplan``): agree
on a step the nodes hold between them, fetch onto each node what its ranks will read, then load."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from stashpoint._core.naming import index_name, parse_save_file, step_dir
from stashpoint._core.nodeplan import Held, Transfer, coverable, expand, plan_spans, plan_transfers, ranges
from stashpoint._dist import group as _dist
from stashpoint._dist.group import DistContext
from stashpoint._dist.nodes import NodeMap, NodeSave, agree_nodes, this_node
from stashpoint._dist.transfer import PARTIAL_RE, run_transfers
from stashpoint._load.exchange import agree
from stashpoint._load.loader import ranges_needed, writers_needed
from stashpoint._load.manifest import read_head
from stashpoint._manager.restoring import try_in_order
from stashpoint._manager.steps import committed_steps, move_aside
from stashpoint._manager.tiers import restore_order
from stashpoint._storage import Storage
from stashpoint.errors import CheckpointError, CorruptCheckpointError

log = logging.getLogger("stashpoint")


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
            if (m := PARTIAL_RE.fullmatch(name)) is not None:
                partial.add(int(m[1]))
            parsed = parse_save_file(name)
            if parsed is not None and parsed[1] == head.save_id and name.rpartition("/")[2] == index_name(*parsed):
                whole.add(parsed[0])
        found.append(Held(step, head.save_id, head.world_size, ranges(whole - partial)))
    return tuple(found)


class NodeLocal:
    """A manager's node-local mode on this rank: its node, the job's leaders, the restore."""

    def __init__(self, world: int, replicas: int = 0, timeout: float | None = None) -> None:
        self.me = this_node(world)
        self.world = world
        if world == 1:
            self.map = NodeMap(((0, 0),), ((0, ((0, 1),)),), (0,))
        else:
            ctx = _dist.context(None, timeout)
            assert ctx is not None
            self.map = agree_nodes(ctx, self.me)
        self.leaders = dict(self.map.leaders)
        if replicas and not 0 < replicas < len(self.leaders):
            raise ValueError(
                f"replicas={replicas} needs at least {replicas + 1} nodes (a copy on another node each); this job "
                f"runs on {len(self.leaders)}"
            )
        self._save_id = ""  # rank 0: the save of the step being fetched

    @property
    def owner(self) -> bool:
        """Whether this rank looks after its node's directory (lock, clean-up, retention)."""
        return self.me.leader

    def for_save(self, replicas: int) -> NodeSave | None:
        """What this manager's saves pass on (None in a world of one: nothing to do per node)."""
        return NodeSave(self.me.node, self.map, replicas) if self.world > 1 else None

    def restore(
        self, root: Storage, state: Any, step: int | None, load_one: Callable[[Storage], None], options: dict[str, Any]
    ) -> int | None:
        """Load the newest step the nodes hold between them (or ``step``) into ``state``."""
        from stashpoint._save import engine as _save

        _save.wait_all()
        ctx = _dist.context(options.get("process_group"), options.get("timeout")) or DistContext.solo()
        mine: Any = None
        if self.me.leader:
            try:
                mine = (self.me.node, inventory(root))
            except Exception as e:
                mine = f"rank {ctx.rank}: listing {root.location} failed: {type(e).__name__}: {e}"
        seen = ctx.gather("node-local: what each node holds", mine)
        answer: Any = None
        cover: dict[int, dict[int, Held]] = {}
        if seen is not None:
            errors = [s for s in seen if isinstance(s, str)]
            if errors:
                answer = ("error", "; ".join(errors[:8])[:4000])
            else:
                by_node = dict(s for s in seen if s is not None)
                cover = coverable(by_node)
                torn = sorted({h.step for hs in by_node.values() for h in hs} - cover.keys())
                answer = ("ok", restore_order(sorted(cover), [], step), torn)
        answer = ctx.broadcast("node-local: the steps to try", answer)
        if answer[0] == "error":
            raise CheckpointError("listing the node-local checkpoints failed: " + answer[1])
        order, torn = answer[1], answer[2]
        if self.me.leader:  # no restore can take them (some rank's files are on no node): set aside
            for s in torn:
                if (step is None or s != step) and root.child(step_dir(s)).exists():
                    log.warning("stashpoint: step %d lacks some rank's files on every node; moving it aside", s)
                    move_aside(root, s)
        if step is not None and not order:
            order = [(step, "local")]  # raises CheckpointNotFoundError, naming the path

        def fetch_and_load(candidate: int) -> None:
            at = root.child(step_dir(candidate))
            holders = cover.get(candidate, {})
            self._save_id = next(iter(holders.values())).save_id if holders else ""
            self._fetch(ctx, at, holders, state, options)
            load_one(at)

        found = try_in_order(order, step, lambda s, _t: s, fetch_and_load)
        if found is None:
            return None
        candidate, _, damaged = found
        if step is None and self.me.leader:
            for s, _ in damaged:
                move_aside(root, s)
        return candidate

    def _fetch(
        self, ctx: DistContext, at: Storage, holders: dict[int, Held], state: Any, options: dict[str, Any]
    ) -> None:
        """Every node gets what its ranks read: their own ranks' files whole, then the indexes
        of the ranks that wrote what they read, then the byte ranges they read of those."""
        world = next(iter(holders.values())).world if holders else 1  # rank 0 plans: it has them
        held = {n: expand(h.ranks) for n, h in holders.items()}
        own: dict[int, set[int]] = {}
        for r, n in enumerate(self.map.of_rank):
            own.setdefault(n, set()).add(r % world)
        held = self._transfer(ctx, at, "own files", lambda: plan_transfers(held, own, sorted(self.leaders)))
        kw = {"partial": options.get("partial", False), "allow_pickle": options.get("allow_pickle", False)}
        writers = self._gather_needs(ctx, at, lambda: ranges(writers_needed(at, state, ctx.rank, **kw)))
        need_idx = {n: set().union(*(expand(w) for w in ws)) for n, ws in writers.items()}
        self._transfer(
            ctx, at, "indexes", lambda: plan_transfers(held, need_idx, sorted(self.leaders), indexes_only=True)
        )
        mine = held.get(self.me.node, set())
        spans = self._gather_needs(ctx, at, lambda: ranges_needed(at, state, ctx.rank, skip=mine, **kw))
        need: dict[int, dict[str, tuple[int, int, list[tuple[int, int]]]]] = {}
        for n, per_rank in spans.items():
            for files in per_rank:
                for name, (rank, size, rs) in files.items():
                    need.setdefault(n, {}).setdefault(name, (rank, size, []))[2].extend(rs)
        self._transfer(ctx, at, "byte ranges", lambda: (plan_spans(held, need), held))

    def _gather_needs(self, ctx: DistContext, at: Storage, mine: Callable[[], Any]) -> dict[int, list[Any]]:
        """Each rank's ``mine()``, grouped by node on rank 0 ({} elsewhere); raises on every rank
        when any rank failed."""
        try:
            value: Any = ("ok", mine())
        except CheckpointError as e:
            value = ("error", f"rank {ctx.rank}: {e}")
        gathered = ctx.gather("node-local: what each rank's load reads", value)
        out: dict[int, list[Any]] = {}
        problem = None
        if gathered is not None:
            bad = [g[1] for g in gathered if g[0] == "error"]
            problem = "; ".join(bad[:8])[:4000] if bad else None
            for r, (_, v) in enumerate(gathered):
                out.setdefault(self.map.of_rank[r], []).append(v)
        problem = ctx.broadcast("node-local: planning", problem)
        if problem:
            raise CorruptCheckpointError(f"planning the load of {at.location} failed: {problem}")
        return out

    def _transfer(
        self, ctx: DistContext, at: Storage, what: str, plan_them: Callable[[], tuple[list[Transfer], Any]]
    ) -> dict[int, set[int]]:
        """Rank 0 plans with ``plan_them``; every leader runs its part; all agree it worked.
        Returns the saving ranks each node holds whole afterwards (on every rank)."""
        plan: Any = None
        if ctx.rank == 0:
            try:
                transfers, after = plan_them()
                plan = ("ok", transfers, self._save_id, {n: ranges(rs) for n, rs in after.items()})
            except CheckpointError as e:
                plan = ("error", str(e))
        plan = ctx.broadcast(f"node-local: transfers of {what}", plan)
        if plan[0] == "error":
            raise CorruptCheckpointError(f"fetching {what} of {at.location} across nodes: {plan[1]}")
        t0 = time.perf_counter()
        status = run_transfers(ctx, plan[1], self.leaders, self.me.node, at, save_id=plan[2])
        agree(ctx, f"node-local: {what} fetched", status or 0, CorruptCheckpointError)
        if plan[1]:
            log.info("stashpoint: fetched %s of %s across nodes: %d transfer(s), %.2f s on rank %d", what,
                     at.location, len(plan[1]), time.perf_counter() - t0, ctx.rank)  # fmt: skip
        return {n: expand(rs) for n, rs in plan[3].items()}
