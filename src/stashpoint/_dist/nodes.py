"""Nodes of a distributed job: which node each rank runs on, and bytes sent between two ranks.

A node is torchrun's node rank (``GROUP_RANK``), its leader the rank with ``LOCAL_RANK`` 0;
``STASHPOINT_NODE`` and ``STASHPOINT_LOCAL_RANK`` say the same under other launchers. Node
ranks are not stable across restarts (a rendezvous may number the nodes anew), so nothing
stored relies on them: what a node's directory holds is found by listing it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from stashpoint._dist.arrival import CollectiveError
from stashpoint._dist.group import DistContext
from stashpoint.errors import CheckpointError


@dataclass(frozen=True)
class Node:
    """This rank's node and whether it is the node's leader (its first local rank)."""

    node: int
    leader: bool


def _env_int(names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        raw = os.environ.get(name)
        if raw is not None and raw.strip():
            try:
                value = int(raw)
            except ValueError:
                raise CheckpointError(
                    f"{name}={raw!r} is not a whole number; set it to this rank's node number"
                ) from None
            if value < 0:
                raise CheckpointError(f"{name}={raw!r} is negative; node numbers start at 0")
            return name, value
    return None


def this_node(world: int) -> Node:
    """This rank's node, from the launcher's environment (one process: node 0, its leader)."""
    node = _env_int(("STASHPOINT_NODE", "GROUP_RANK"))
    local = _env_int(("STASHPOINT_LOCAL_RANK", "LOCAL_RANK"))
    if world == 1 and (node is None or local is None):
        return Node(0, True)
    if node is None or local is None:
        raise CheckpointError(
            "node-local checkpoints need each rank's node: run under torchrun (which sets GROUP_RANK and "
            "LOCAL_RANK), or set STASHPOINT_NODE (this rank's node number) and STASHPOINT_LOCAL_RANK (its "
            "number within the node) in every rank's environment"
        )
    return Node(node[1], local[1] == 0)


@dataclass(frozen=True)
class NodeMap:
    """The job's nodes as rank 0 found them: each node's leader and ranks (a few numbers per
    node, on every rank); ``of_rank``, each rank's node, on rank 0 only (R entries are not sent)."""

    leaders: tuple[tuple[int, int], ...]  # (node, leader rank), by node
    ranks: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()  # (node, its ranks as [a, b) ranges)
    of_rank: tuple[int, ...] = ()

    def leader_ranks(self) -> list[int]:
        return [r for _, r in self.leaders]


@dataclass(frozen=True)
class NodeSave:
    """What a save to node-local directories needs: this rank's node, the job's nodes, how
    many other nodes get a copy of each node's files (``replicas``), and how many steps each
    node keeps (``keep``; to check that a node's directory can hold them)."""

    node: int
    nodes: NodeMap
    replicas: int = 0
    keep: int | None = None  # how many steps the retention keeps at most (None: no bound)


def _spans(ranks: list[int]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for r in sorted(ranks):
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return tuple((a, b) for a, b in out)


def agree_nodes(ctx: DistContext, me: Node, replicas: int = 0) -> NodeMap:
    """Every rank's node, checked on rank 0 (each node exactly one leader, one ``replicas`` for
    the job: a node sending copies its peer does not wait for waited for ever); the leaders and
    each node's ranks (per node, not per rank) sent to every rank."""
    seen = ctx.gather("node-local: each rank's node", (me.node, me.leader, replicas))
    answer: tuple[Any, ...] | None = None
    of_rank: tuple[int, ...] = ()
    if seen is not None:
        of_rank = tuple(n for n, _, _ in seen)
        leaders: dict[int, list[int]] = {}
        members: dict[int, list[int]] = {}
        counts: dict[int, list[int]] = {}
        for rank, (node, leader, k) in enumerate(seen):
            counts.setdefault(k, []).append(rank)
            leaders.setdefault(node, [])
            members.setdefault(node, []).append(rank)
            if leader:
                leaders[node].append(rank)
        bad = {n: rs for n, rs in leaders.items() if len(rs) != 1}
        if len(counts) > 1:
            shown = "; ".join(f"replicas={k} on rank(s) {_ranks(rs)}" for k, rs in sorted(counts.items()))
            answer = ("error", f"the ranks' node-local managers differ: {shown}; give every rank the same replicas")
        elif bad:
            node, ranks = next(iter(sorted(bad.items())))
            answer = (
                "error",
                f"node {node} has {len(ranks)} leader rank(s) {ranks} (LOCAL_RANK / STASHPOINT_LOCAL_RANK 0); "
                "each node needs exactly one: check the launcher's environment",
            )
        else:
            by_node = sorted(leaders.items())
            answer = ("ok", tuple((n, rs[0]) for n, rs in by_node), tuple((n, _spans(members[n])) for n, _ in by_node))
    answer = ctx.broadcast("node-local: the nodes' leaders", answer)
    assert answer is not None
    if answer[0] == "error":
        raise CheckpointError(answer[1])
    return NodeMap(answer[1], answer[2], of_rank)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" ... ({len(ranks)} in all)" if len(ranks) > 16 else "")


# -- between two ranks (not collectives: only the two take part) ----------------------------------


def _p2p(ctx: DistContext, what: str, fn: Any, tensor: Any, peer: int, *, tag: int) -> None:
    try:
        fn(tensor, ctx.ranks[peer], group=ctx.group, tag=tag)
    except Exception as e:
        raise CollectiveError(f"rank {ctx.rank}: {what} with rank {peer} failed: {type(e).__name__}: {e}") from e


def send_tensor(ctx: DistContext, peer: int, tensor: Any, tag: int = 0) -> None:
    """Send a CPU tensor to group rank ``peer``, which receives it into one of the same size
    (with the same ``tag``: messages of two exchanges running at once between the same two
    ranks, one per thread, are told apart by their tags)."""
    import torch.distributed as dist

    _p2p(ctx, "sending", dist.send, tensor, peer, tag=tag)


def recv_tensor(ctx: DistContext, peer: int, tensor: Any, tag: int = 0) -> None:
    import torch.distributed as dist

    _p2p(ctx, "receiving", dist.recv, tensor, peer, tag=tag)


def send_blob(ctx: DistContext, peer: int, data: bytes, tag: int = 0) -> None:
    """Send a small message: its length, then its bytes."""
    import torch

    send_tensor(ctx, peer, torch.tensor([len(data)], dtype=torch.int64), tag)
    if data:
        send_tensor(ctx, peer, torch.frombuffer(bytearray(data), dtype=torch.uint8), tag)


def recv_blob(ctx: DistContext, peer: int, limit: int, tag: int = 0) -> bytes:
    """A message of :func:`send_blob`; one announced longer than ``limit`` bytes is refused."""
    import torch

    size = torch.zeros(1, dtype=torch.int64)
    recv_tensor(ctx, peer, size, tag)
    n = int(size.item())
    if n < 0 or n > limit:
        raise CheckpointError(f"rank {ctx.rank}: rank {peer} announced a message of {n} bytes (at most {limit})")
    if n == 0:
        return b""
    buf = torch.empty(n, dtype=torch.uint8)
    recv_tensor(ctx, peer, buf, tag)
    return bytes(buf.numpy())
