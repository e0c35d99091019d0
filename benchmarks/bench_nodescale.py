"""Node-local restores and replicas at scale (issue 21): rank 0's planning and the messages.

    python -m benchmarks.bench_nodescale [--ranks 512 2048 16384] [--per-node 8]

Synthetic, through the library's own pure planning functions (``_core.nodeplan``,
``_manager.holdings.node_order``, ``_dist.nodecommit.node_room``) on the messages a real
restore and save send, at real world sizes. The job is FSDP-like: each rank wrote one shard
and its index; rank 0 also wrote the replicated values every rank reads (the optimizer's step
counters: a few bytes of its shard). It saved steps 100 and 200 with ``replicas=1``; then node
1 was lost with its disk and replaced by an empty one. The restore: every node's leader reports
what its directory holds (a gather to rank 0); rank 0 orders the steps and plans three passes
(the nodes' own ranks' files, the indexes of the ranks each node reads, the byte ranges read of
other ranks' files), each rank sent its node's part alone (a scatter, which pads every part
to the largest). Reported per world size: what rank 0 receives, rank 0's planning time, what
each rank receives (and what whole plans sent to every rank would be), and the transfers the
node that sends most takes part in (they run one after another on its leader).
"""

from __future__ import annotations

import argparse
import pickle
import time
from typing import Any

from stashpoint._core.nodeplan import Held, expand, plan_parts, plan_spans, plan_transfers, ranges
from stashpoint._dist.nodecommit import node_room, tree_children, tree_parent
from stashpoint._dist.nodes import NodeMap, NodeSave
from stashpoint._manager.holdings import node_order

SAVE_ID = "5e1f0c0ffee0d00d"
SHARD = 256 << 20  # each rank's shard
COUNTERS = 4096  # the replicated bytes of rank 0's shard every rank reads


def size(obj: Any) -> int:
    """What the object collectives send for ``obj`` (their pickled size)."""
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def inventories(world: int, per_node: int, lost: int) -> dict[int, tuple[Held, ...]]:
    """What each node's leader reports: its own ranks' files of steps 100 and 200, and (replicas=1)
    the previous node's of step 200; node ``lost`` holds nothing."""
    nodes = world // per_node
    out = {}
    for n in range(nodes):
        if n == lost:
            out[n] = ()
            continue
        own = range(n * per_node, (n + 1) * per_node)
        prev = (n - 1) % nodes
        kept = range(prev * per_node, (prev + 1) * per_node)
        out[n] = (Held(100, SAVE_ID, world, ranges(own)), Held(200, SAVE_ID, world, ranges([*own, *kept])))
    return out


def restore(world: int, per_node: int) -> dict[str, Any]:
    nodes, lost = world // per_node, 1
    by_node = inventories(world, per_node, lost)
    received = sum(size((n, hs, [])) for n, hs in by_node.items()) + 8 * (world - nodes)  # others send None
    t0 = time.perf_counter()
    order, torn = node_order(by_node, [], None)
    t_order = time.perf_counter() - t0
    assert order == [(200, "local")] and torn == [100], (order[:2], torn)  # step 100 lost its node 1 files
    answer = size(("ok", order, torn))

    # pass 1: each node's own ranks' files, whole
    t0 = time.perf_counter()
    held = {n: expand(h.ranks) for n, hs in by_node.items() for h in hs if h.step == 200}
    own = {n: set(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)}
    transfers, after = plan_transfers(held, own, list(range(nodes)))
    plan1 = ("ok", transfers, SAVE_ID, {n: ranges(rs) for n, rs in after.items()})
    t1 = time.perf_counter() - t0
    # pass 2: each rank's writers (its own rank and rank 0, for the counters), gathered by node
    needs = [ranges({r, 0}) for r in range(world)]
    received_needs = sum(size(("ok", w)) for w in needs)
    t0 = time.perf_counter()
    need_idx = {n: {0} | own[n] for n in range(nodes)}
    sources = {n: set(rs) for n, rs in after.items()}
    idx_transfers, _ = plan_transfers(sources, need_idx, list(range(nodes)), indexes_only=True)
    plan2 = ("ok", idx_transfers, SAVE_ID, {n: ranges(rs) for n, rs in after.items()})
    t2 = time.perf_counter() - t0
    # pass 3: the byte ranges each rank reads of files its node does not hold whole
    name0 = f"shard-r00000-0000-{SAVE_ID}.safetensors"
    span_msgs = [("ok", {} if r < per_node else {name0: (0, SHARD, [(0, COUNTERS)])}) for r in range(world)]
    received_spans = sum(size(m) for m in span_msgs)
    t0 = time.perf_counter()
    need: dict[int, dict[str, tuple[int, int, list[tuple[int, int]]]]] = {}
    for r, (_, files) in enumerate(span_msgs):
        for name, (rank, sz, rs) in files.items():
            need.setdefault(r // per_node, {}).setdefault(name, (rank, sz, []))[2].extend(rs)
    span_transfers = plan_spans(sources, need)
    plan3 = ("ok", span_transfers, SAVE_ID, {n: ranges(rs) for n, rs in after.items()})
    t3 = time.perf_counter() - t0
    of_rank = [r // per_node for r in range(world)]
    leaders = {n: n * per_node for n in range(nodes)}
    every = 0
    for ts, aft in ((transfers, after), (idx_transfers, after), (span_transfers, after)):
        every += max(size(("ok", t, SAVE_ID, h)) for t, h in plan_parts(ts, aft, of_rank, leaders))
    busiest: dict[int, int] = {}
    for t in [*transfers, *idx_transfers, *span_transfers]:
        for n in (t.src, t.dst):
            busiest[n] = busiest.get(n, 0) + 1
    return {
        "rank0_received": received + received_needs + received_spans,
        "rank0_plan_s": t_order + t1 + t2 + t3,
        "broadcast": answer + size(plan1) + size(plan2) + size(plan3),
        "scattered": answer + every,
        "transfers": (len(transfers), len(idx_transfers), len(span_transfers)),
        "busiest": max(busiest.values()),
    }


def save_room(world: int, per_node: int) -> float:
    """The time of rank 0's count of each node's bytes on a save with replicas (16 bytes a
    leader, passed down the commit's tree with the manifest)."""
    nodes = world // per_node
    of_rank = tuple(r // per_node for r in range(world))
    nm = NodeMap(tuple((n, n * per_node) for n in range(nodes)), (), of_rank)
    ns = NodeSave(0, nm, replicas=1, keep=2)
    t0 = time.perf_counter()
    room = node_room(ns, [SHARD + 150_000] * world)
    took = time.perf_counter() - t0
    assert len(room) == nodes
    return took


def commit_fanout(nodes: int) -> tuple[int, int]:
    """The manifest's way to every node's leader at a commit: the copies the busiest leader
    sends, and the rounds until the last leader has it (in round r every leader that has it
    sends to the one 2**r places after it)."""
    rounds = max(((at - tree_parent(at)).bit_length() for at in range(1, nodes)), default=0)
    return max(len(tree_children(at, nodes)) for at in range(nodes)), rounds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_nodescale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--ranks", type=int, nargs="+", default=[512, 2048, 16384])
    ap.add_argument("--per-node", type=int, default=8)
    args = ap.parse_args(argv)
    print(f"node-local restore after one node lost, replicas=1, {args.per_node} ranks per node\n")
    print("| R | nodes | rank 0 receives | rank 0 plans | each rank receives (whole plans would be) "
          "| transfers (own, indexes, ranges) | busiest node's transfers | save: rank 0 counts the room "
          "| save: manifest copies the busiest leader sends, rounds |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world in args.ranks:
        r = restore(world, args.per_node)
        room_s = save_room(world, args.per_node)
        nodes, plan_ms = world // args.per_node, r["rank0_plan_s"] * 1e3
        copies, rounds = commit_fanout(nodes)
        print(
            f"| {world:,} | {nodes:,} | {human(r['rank0_received'])} | {plan_ms:.0f} ms "
            f"| {human(r['scattered'])} ({human(r['broadcast'])}) | {', '.join(map(str, r['transfers']))} "
            f"| {r['busiest']} | {room_s * 1e3:.1f} ms | {copies}, {rounds} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
