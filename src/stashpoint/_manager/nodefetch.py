"""Fetching a step's files across nodes for a node-local restore: rank 0 plans the transfers
(``_core.nodeplan``) in three passes (the saving ranks' own files, the indexes each node's
ranks need, then the byte ranges they read), each node's leader runs its part, and every rank
agrees it worked before the next pass."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from stashpoint._core.nodeplan import REMOTE, Held, Transfer, expand, plan_parts, plan_spans, plan_transfers, ranges
from stashpoint._core.sealed import short_of_memory
from stashpoint._dist.group import DistContext
from stashpoint._dist.nodes import Node, NodeMap
from stashpoint._dist.transfer import RemoteCopy, run_transfers
from stashpoint._load.exchange import agree, failure, own_or_agreed
from stashpoint._load.loader import ranges_needed, writers_needed
from stashpoint._runtime import gc_paused
from stashpoint._storage import Storage
from stashpoint.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError

log = logging.getLogger("stashpoint")


class NodeFetch:
    """The fetch's part of :class:`~stashpoint._manager.noderestore.NodeLocal` (which sets these)."""

    me: Node
    map: NodeMap
    leaders: dict[int, int]
    _save_id: str
    _remote: RemoteCopy | None
    fetched: dict[str, int]

    def _fetch(
        self,
        ctx: DistContext,
        at: Storage,
        holders: dict[int, Held] | CheckpointError,
        state: Any,
        options: dict[str, Any],
    ) -> None:
        """Every node gets what its ranks read: their own ranks' files whole, then the indexes
        of the ranks that wrote what they read, then the byte ranges they read of those.
        ``holders`` (rank 0's) may be why they could not be told: raised on every rank."""
        failed = holders if isinstance(holders, CheckpointError) else None
        holders = {} if isinstance(holders, CheckpointError) else holders
        world = next(iter(holders.values())).world if holders else 1  # rank 0 plans: it has them
        held = {n: expand(h.ranks) for n, h in holders.items()}
        remote = {REMOTE: held[REMOTE]} if REMOTE in held else {}
        own: dict[int, set[int]] = {}
        for r, n in enumerate(self.map.of_rank):
            own.setdefault(n, set()).add(r % world)

        def own_files() -> tuple[list[Transfer], Any]:
            if failed is not None:
                raise failed
            return plan_transfers(held, own, sorted(self.leaders))

        held = self._transfer(ctx, at, "own files", own_files)
        kw = {"partial": options.get("partial", False), "allow_pickle": options.get("allow_pickle", False)}
        writers = self._gather_needs(ctx, at, lambda: ranges(writers_needed(at, state, ctx.rank, **kw)))
        need_idx = {n: set().union(*(expand(w) for w in ws)) for n, ws in writers.items()}
        nodes = sorted(self.leaders)
        sources = {**held, **remote}  # the nodes once their own files arrived, and the remote tier
        self._transfer(ctx, at, "indexes", lambda: plan_transfers(sources, need_idx, nodes, indexes_only=True))
        mine = held.get(self.me.node, set())
        spans = self._gather_needs(ctx, at, lambda: ranges_needed(at, state, ctx.rank, skip=mine, **kw))
        need: dict[int, dict[str, tuple[int, int, list[tuple[int, int]]]]] = {}
        for n, per_rank in spans.items():
            for files in per_rank:
                for name, (rank, size, rs) in files.items():
                    need.setdefault(n, {}).setdefault(name, (rank, size, []))[2].extend(rs)
        self._transfer(ctx, at, "byte ranges", lambda: (plan_spans(sources, need), held))

    def _gather_needs(self, ctx: DistContext, at: Storage, mine: Callable[[], Any]) -> dict[int, list[Any]]:
        """Each rank's ``mine()``, grouped by node on rank 0 ({} elsewhere); raises on every rank
        when any rank failed."""
        own: CheckpointError | None = None
        try:
            with gc_paused():  # parses and plans as a load does (the load pauses its own)
                value: Any = ("ok", mine())
        except CheckpointError as e:
            own, value = e, ("error", *failure(e))
        except MemoryError as e:  # to every rank, as any failure here: none may wait it out
            own = short_of_memory(f"planning the load of {at.location} on rank {ctx.rank}", e)
            value = ("error", *failure(own))
        gathered = ctx.gather("node-local: what each rank's load reads", value)
        out: dict[int, list[Any]] = {}
        problem = None
        if gathered is not None:
            bad = [(r, g) for r, g in enumerate(gathered) if g[0] == "error"]
            shown = "; ".join(f"rank {r}: {g[1]}" for r, g in bad[:8])[:4000]
            # a damaged copy on every rank that failed: fall back past it; a mismatch of the state, no
            problem = (shown, all(g[2] for _, g in bad)) if bad else None
            for r, g in enumerate(gathered):
                out.setdefault(self.map.of_rank[r], []).append(g[1])
        problem = ctx.broadcast("node-local: planning", problem)
        if problem:
            error = CorruptCheckpointError if problem[1] else CheckpointError
            raise own_or_agreed(own, error(f"planning the load of {at.location} failed: {problem[0]}"))
        return out

    def _transfer(
        self, ctx: DistContext, at: Storage, what: str, plan_them: Callable[[], tuple[list[Transfer], Any]]
    ) -> dict[int, set[int]]:
        """Rank 0 plans with ``plan_them`` and sends each rank its node's part alone; every
        leader runs its part; all agree it worked. Returns the saving ranks each node holds
        whole afterwards: every node's on rank 0 (which plans the next pass), this rank's
        node's elsewhere."""
        parts: list[Any] | None = None
        after: dict[int, set[int]] = {}
        if ctx.rank == 0:
            try:
                transfers, after = plan_them()
                mine = plan_parts(transfers, after, self.map.of_rank, self.leaders)
                parts = [("ok", ts, self._save_id, held) for ts, held in mine]
            except (CheckpointError, MemoryError) as e:
                own = e if isinstance(e, CheckpointError) else short_of_memory(f"planning {what}", e)
                parts = [("error", *failure(own), isinstance(own, IncompleteCheckpointError))] * ctx.world
        plan = ctx.scatter(f"node-local: transfers of {what}", parts)
        if plan[0] == "error":
            kind = IncompleteCheckpointError if plan[3] else CorruptCheckpointError if plan[2] else CheckpointError
            raise kind(f"fetching {what} of {at.location} across nodes: {plan[1]}")
        t0 = time.perf_counter()
        status = run_transfers(
            ctx, plan[1], self.leaders, self.me.node, at, save_id=plan[2], remote=self._remote, tally=self.fetched
        )
        agree(ctx, f"node-local: {what} fetched", status or 0, CorruptCheckpointError)
        if plan[1]:
            log.info("stashpoint: fetched %s of %s across nodes: %d transfer(s) of this node, %.2f s on rank %d",
                     what, at.location, len(plan[1]), time.perf_counter() - t0, ctx.rank)  # fmt: skip
        return after if ctx.rank == 0 else {self.me.node: expand(plan[3])}
