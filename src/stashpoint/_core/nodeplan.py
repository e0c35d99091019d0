"""Node-local run directories: each node's ranks keep their files in that node's own root.

What a node holds of a step is found by listing its directory (``holdings.inventory``), never
assumed from node numbers, which a new rendezvous may assign anew. A restore asks every node
(one message per node), takes the newest step whose files the nodes hold between them, and
before loading has every node fetch from the others what its ranks will read: first the files
of its own ranks, then the indexes of the ranks that wrote what they read, then the byte
ranges they read of those ranks' shards (into sparse copies). Only node leaders send and
receive, over stashpoint's own group, in one order every rank computes alike. With a remote
tier, the remote copy of a step is one more holder (:data:`REMOTE`), taken only for what no
node holds: the leader that needs those files reads them from the remote tier itself. This
module is the planning: pure functions.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from stashpoint.errors import IncompleteCheckpointError

K = TypeVar("K", bound=Hashable)

#: A node's bytes of a step: its own ranks' files, and the other nodes' it keeps as replicas
Room = tuple[int, int]

#: The remote tier as a holder of a step: every saving rank's files, read only for what no node holds.
REMOTE = -1


@dataclass(frozen=True)
class Held:
    """What one node's directory holds of one committed step: the saving ranks whose index is
    there, as ``[start, end)`` ranges."""

    step: int
    save_id: str
    world: int
    ranks: tuple[tuple[int, int], ...]
    replicas: tuple[tuple[int, int], ...] = ()  # of ``ranks``, those held as copies of other nodes' files


def ranges(ranks: Iterable[int]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return tuple((a, b) for a, b in out)


def expand(spans: Iterable[tuple[int, int]]) -> set[int]:
    return {r for a, b in spans for r in range(a, b)}


Span = tuple[str, int, int, tuple[tuple[int, int], ...]]  # file, its saving rank, its size, byte ranges


@dataclass(frozen=True)
class Transfer:
    """What the leader of node ``src`` sends the leader of node ``dst``: the files of saving
    ranks ``ranks``, the step's manifest, the index files alone of ``indexes``, and byte
    ranges of files (``spans``, written into sparse copies of the files' full size)."""

    src: int
    dst: int
    ranks: tuple[tuple[int, int], ...] = ()
    manifest: bool = False
    indexes: tuple[tuple[int, int], ...] = ()
    spans: tuple[Span, ...] = ()


def coverable(seen: Mapping[int, Sequence[Held]]) -> dict[int, dict[int, Held]]:
    """The steps the nodes hold every saving rank's files of between them (one save of each:
    copies with another save id are ignored), with what each node holds of them."""
    by_step: dict[int, dict[int, Held]] = {}
    for node, helds in seen.items():
        for h in helds:
            by_step.setdefault(h.step, {})[node] = h
    out = {}
    for step, holders in by_step.items():
        ids = {h.save_id for h in holders.values()}
        if len(ids) != 1:  # two saves of one step (a torn overwrite): trust neither
            continue
        world = next(iter(holders.values())).world
        if expand(s for h in holders.values() for s in h.ranks) >= set(range(world)):
            out[step] = holders
    return out


def orphan_replicas(seen: Mapping[int, Sequence[Held]]) -> dict[int, list[tuple[int, tuple[tuple[int, int], ...]]]]:
    """By node, the ``(step, ranks)`` of the replicas it holds that are the only copies left:
    no node holds those ranks' files of that save as its own (their node was lost). Such a copy
    is the node's own from now on, or the next save's clean-up of older replicas would delete
    a step's last copy of them."""
    by_save: dict[tuple[int, str], dict[int, Held]] = {}
    for node, helds in seen.items():
        for h in helds:
            by_save.setdefault((h.step, h.save_id), {})[node] = h
    out: dict[int, list[tuple[int, tuple[tuple[int, int], ...]]]] = {}
    for (step, _), holders in sorted(by_save.items()):
        own = set().union(*(expand(h.ranks) - expand(h.replicas) for h in holders.values()))
        for node, h in sorted(holders.items()):
            alone = (expand(h.replicas) & expand(h.ranks)) - own
            if alone:
                out.setdefault(node, []).append((step, ranges(alone)))
    return out


def _sources(held: Mapping[int, set[int]]) -> dict[int, list[int]]:
    source_of: dict[int, list[int]] = {}
    for n in sorted(held):
        for r in held[n]:
            source_of.setdefault(r, []).append(n)
    return source_of


def _pick(source_of: dict[int, list[int]], load: dict[int, int], rank: int) -> int:
    """The node holding ``rank``'s files that has sent the least so far (the remote tier
    only when no node holds them)."""
    src = min(source_of[rank], key=lambda n: (n == REMOTE, load[n], n))
    load[src] += 1
    return src


def relay(wants: Sequence[tuple[int, K]], holders: Mapping[K, Iterable[int]]) -> list[tuple[int, int, list[K]]]:
    """Who sends each ``(node, key)`` of ``wants``, and in which order: a node that received a
    key may pass it on, and each goes to the holder that can deliver it first, every node taking
    part in one transfer at a time (simulated in equal steps). Many nodes wanting one key (the
    replicated values one rank wrote and every rank reads) thus get it through a doubling tree,
    in log2(nodes) rounds, instead of from one node that sends to them all in turn. The remote
    tier (:data:`REMOTE`) is taken only for keys no node holds, and serves any number at once.
    Returns ``(src, dst, keys)`` in an order in which every node can run its part one after
    another (a transfer between two nodes carries every key the sender held by the first of
    theirs). Pure."""
    have: dict[K, dict[int, int]] = {}  # key -> node -> the step at which it holds it
    heaps: dict[K, list[tuple[int, int]]] = {}
    for k, hs in holders.items():
        nodes = sorted(set(hs))
        have[k] = dict.fromkeys([n for n in nodes if n != REMOTE] or nodes, 0)
        heaps[k] = [(0, n) for n in have[k]]
        heapq.heapify(heaps[k])
    busy: dict[int, int] = {}
    planned: list[tuple[int, int, int, K]] = []
    for dst, key in wants:
        if dst in have.get(key, {}):
            continue
        heap = heaps.get(key)
        if not heap:
            raise IncompleteCheckpointError(f"{key!r} is on no node of this job and on no remote tier")
        while True:  # the holder free first (entries go stale as holders take other transfers)
            t, src = heap[0]
            free = 0 if src == REMOTE else max(have[key][src], busy.get(src, 0))
            if free == t:
                break
            heapq.heapreplace(heap, (free, src))
        start = max(free, busy.get(dst, 0))
        if src != REMOTE:
            busy[src] = start + 1
            heapq.heapreplace(heap, (start + 1, src))
        busy[dst] = have[key][dst] = start + 1
        heapq.heappush(heap, (start + 1, dst))
        planned.append((start, src, dst, key))
    out: list[tuple[int, int, list[K]]] = []
    starts: list[int] = []
    first: dict[tuple[int, int], int] = {}
    for start, src, dst, key in sorted(planned, key=lambda p: p[:3]):
        i = first.setdefault((src, dst), len(out))
        if i < len(out) and have[key][src] <= starts[i]:
            out[i][2].append(key)
        else:
            out.append((src, dst, [key]))
            starts.append(start)
    return out


def plan_transfers(
    held: Mapping[int, set[int]], need: Mapping[int, set[int]], nodes: Sequence[int], *, indexes_only: bool = False
) -> tuple[list[Transfer], dict[int, set[int]]]:
    """Who sends what so that every node in ``nodes`` holds the files (or, ``indexes_only``,
    the index files) of the saving ranks it ``need``s, and the manifest: each missing rank's
    files come from the node holding them that has sent the fewest so far; index files, which
    many nodes may need of one rank, are passed on by the nodes that received them
    (:func:`relay`). ``held``: the saving ranks each node (and :data:`REMOTE`, if it holds the
    step) holds every file of. Returns the transfers (in the order all ranks run them) and
    which ranks each node of ``nodes`` then holds whole. Pure."""
    held = {n: set(held.get(n, set())) for n in {*nodes, *held}}
    source_of = _sources(held)
    has_step = {n for n in held if held[n]}
    if not has_step:
        raise IncompleteCheckpointError("no node of this job holds this step, nor does a remote tier")
    wants = [(dst, r) for dst in sorted(nodes) for r in sorted(need.get(dst, set()) - held[dst])]
    for _dst, r in wants:
        if not source_of.get(r):
            raise IncompleteCheckpointError(_lost(r))
    if indexes_only:
        order = relay(wants, source_of)
    else:
        load = dict.fromkeys(held, 0)
        pairs: dict[tuple[int, int], list[int]] = {}
        for dst, r in wants:
            pairs.setdefault((_pick(source_of, load, r), dst), []).append(r)
        order = [(src, dst, rs) for (src, dst), rs in sorted(pairs.items())]
    for dst in sorted(set(nodes) - has_step - {d for _, d, _ in order}):
        order.append((min(has_step, key=lambda n: (n == REMOTE, n)), dst, []))
    # one transfer per node that lacks the step brings the manifest: a node's, where one sends
    manifest_at: dict[int, int] = {}
    for i in sorted(range(len(order)), key=lambda i: (order[i][0] == REMOTE, i)):
        manifest_at.setdefault(order[i][1], i)
    transfers = [
        Transfer(
            src,
            dst,
            () if indexes_only else ranges(rs),
            dst not in has_step and manifest_at[dst] == i,
            ranges(rs) if indexes_only else (),
        )
        for i, (src, dst, rs) in enumerate(order)
    ]
    got: dict[int, set[int]] = {}
    for t in transfers:
        got.setdefault(t.dst, set()).update(expand(t.ranks))
    return transfers, {n: held[n] | got.get(n, set()) for n in nodes}


def _lost(rank: int) -> str:
    return (
        f"the files of saving rank {rank} are on no node of this job (their node lost its directory, or is "
        "not in this job) and on no remote tier: restart with the node that holds them, or restore another step"
    )


def merge(spans: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Byte ranges sorted, with overlapping and touching ones joined."""
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out if b > a)


def plan_spans(
    held: Mapping[int, set[int]], need: Mapping[int, Mapping[str, tuple[int, int, Sequence[tuple[int, int]]]]]
) -> list[Transfer]:
    """Transfers of the byte ranges each node ``need``s (file -> its saving rank, size and
    ranges) of files whose ranks it does not hold whole: from the nodes holding the rank, or
    from a node that received the same ranges of the file before (:func:`relay`; the remote
    tier only for what no node holds). Pure."""
    source_of = _sources(held)
    wants: list[tuple[int, Span]] = []
    holders: dict[Span, list[int]] = {}
    for dst in sorted(need):
        for name, (rank, size, spans) in sorted(need[dst].items()):
            if rank in held.get(dst, set()):
                continue
            span = (name, rank, size, merge(spans))
            if not source_of.get(rank):
                raise IncompleteCheckpointError(_lost(rank))
            holders[span] = source_of[rank]
            wants.append((dst, span))
    return [Transfer(src, dst, spans=tuple(sp)) for src, dst, sp in relay(wants, holders)]


def replica_peers(nodes: Sequence[int], node: int, shift: int) -> tuple[int, int]:
    """For replica ``shift`` (1, 2, ...): the node ``node`` sends its files to (``shift``
    places after it in ``nodes``, cyclically) and the node it receives from (``shift`` places
    before it). Pure."""
    i, n = list(nodes).index(node), len(nodes)
    return nodes[(i + shift) % n], nodes[(i - shift) % n]


def replica_bytes(own: Mapping[int, int], replicas: int) -> dict[int, int]:
    """The bytes of other nodes' files each node keeps as replicas of a step, from each node's
    ``own`` bytes of it: for every shift 1..``replicas``, the files of the node that shift
    places before it (:func:`replica_peers`). Pure."""
    nodes = sorted(own)
    incoming = dict.fromkeys(nodes, 0)
    if len(nodes) < 2:
        return incoming
    for shift in range(1, replicas + 1):
        for i, node in enumerate(nodes):
            incoming[nodes[(i + shift) % len(nodes)]] += own[node]
    return incoming


def peak_bytes(own: int, incoming: int, keep: int | None) -> int | None:
    """What a node's directory holds at the peak of a save, steps staying this size: ``keep``
    steps of its own files and the one being written, and the copies of other nodes' files of
    the step before beside those of the new one (older copies go once the new ones are durable).
    None when the retention keeps steps without bound. Pure."""
    return None if keep is None else (keep + 1) * own + 2 * incoming


def plan_parts(
    transfers: Sequence[Transfer], after: Mapping[int, set[int]], of_rank: Sequence[int], leaders: Mapping[int, int]
) -> list[tuple[list[Transfer], tuple[tuple[int, int], ...]]]:
    """Each rank's part of a pass's plan: its node's transfers, in the plan's order (for the
    node's leader; none for the other ranks), and the saving ranks its node then holds whole.
    Sent to each rank alone, a plan costs every rank what its node does, not what the job does.
    Pure."""
    mine: dict[int, list[Transfer]] = {}
    for t in transfers:
        for n in {t.src, t.dst}:
            mine.setdefault(n, []).append(t)
    return [
        (mine.get(n, []) if leaders.get(n) == r else [], ranges(after.get(n, set()))) for r, n in enumerate(of_rank)
    ]


def upload_parts(
    saved_world: int, held: Sequence[tuple[tuple[int, int], ...]]
) -> tuple[list[tuple[tuple[int, int], ...]], list[int]]:
    """Who uploads each saved rank's files of a node-local step, from the saved ranks each live
    rank's node directory holds (``held[rank]``, spans): rank ``s`` itself where it holds them
    (the numbering the step was saved under), else one of their holders, spread. Returns each
    rank's saved ranks (spans) and the saved ranks no rank holds. Pure."""
    holders: dict[int, list[int]] = {}
    for rank, spans in enumerate(held):
        for a, b in spans:
            for s in range(max(0, a), min(b, saved_world)):
                holders.setdefault(s, []).append(rank)
    given: list[list[int]] = [[] for _ in held]
    missing = []
    for s in range(saved_world):
        who = holders.get(s)
        if not who:
            missing.append(s)
            continue
        given[s if s < len(held) and s in who else who[s % len(who)]].append(s)
    return [ranges(g) for g in given], missing
