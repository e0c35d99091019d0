"""The object collectives of a checkpoint group, each message tagged with the collective it
belongs to: ranks at different stashpoint calls (one restores while another loads, or one
saves while another loads) pair collectives of different meaning, and would otherwise read
each other's messages as their own (an AttributeError, a bare assertion). A tag that differs
fails the call on the ranks that see it with a :class:`CollectiveError` naming it."""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

import xxhash

from stashpoint._dist.arrival import CollectiveError, ranks_text

if TYPE_CHECKING:
    from stashpoint._dist.group import DistContext

GATHER_SLOT = 496  # a gathered message up to this long travels in one collective
SLOT_HEADER = 16  # before it: its length and its collective's tag (a slot is 512 B)
_ODD = -1  # the length rank 0 sends when some rank's tag differs: every rank raises


class OutOfStep(CollectiveError):
    """Ranks at different collectives of a group: its collectives no longer pair."""


def tag(what: str) -> int:
    """The collective's tag: alike on every rank at the same collective (``what`` names it)."""
    return xxhash.xxh32_intdigest(what.encode())


def mismatch(ctx: DistContext, what: str, odd: list[int] | None) -> CollectiveError:
    """The error of a collective whose ranks are at different stashpoint calls (``odd``: the
    ranks seen elsewhere, where this rank saw them). The group's collectives are out of step
    from here on: the context drops it (the next call makes a fresh one)."""
    who = f"{ranks_text(odd)} at another one" if odd else "some rank at another one (rank 0's error names it)"
    return OutOfStep(
        f"rank {ctx.rank}: the ranks are at different stashpoint calls: this rank is at '{what}', {who}. Every"
        " rank must make the same calls in the same order (save, load, a manager's "
        "save/restore/close), with the same paths: look for a call made on some ranks only"
    )


def all_gather(ctx: DistContext, what: str, obj: Any) -> list[Any]:
    import torch.distributed as dist

    if ctx.world == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world
    mine = tag(what)
    ctx.collective(what, dist.all_gather_object, out, (mine, obj))
    ctx.sent += _size((mine, obj))
    ctx.received += sum(_size(o) for o in out)
    odd = [r for r, o in enumerate(out) if not (isinstance(o, tuple) and len(o) == 2 and o[0] == mine)]
    if odd:
        raise mismatch(ctx, what, odd)
    return [o[1] for o in out]


def gather(ctx: DistContext, what: str, obj: Any) -> list[Any] | None:
    """Every rank's ``obj``, on the group's first rank only (None on the others): each
    rank sends one message and only rank 0 receives R, where ``all_gather`` sends every
    rank all R. Messages up to ``GATHER_SLOT`` bytes take one collective; longer ones two
    more (the longest length, broadcast, then a gather padded to it). Rank 0's own message
    never travels, nor sets the padding (it may carry a listing the others' do not)."""
    import torch
    import torch.distributed as dist

    if ctx.world == 1:
        return [obj]
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    root = ctx.rank == 0
    mine = tag(what)
    slot = torch.zeros(GATHER_SLOT + SLOT_HEADER, dtype=torch.uint8)
    slot[:SLOT_HEADER] = torch.tensor([len(data), mine], dtype=torch.int64).view(torch.uint8)
    if len(data) <= GATHER_SLOT and not root:
        slot[SLOT_HEADER : SLOT_HEADER + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    slots = [torch.empty_like(slot) for _ in range(ctx.world)] if root else None
    ctx.collective(what, dist.gather, slot, gather_list=slots, dst=ctx.ranks[0])
    ctx.sent += len(slot)
    ctx.received += 8 + (len(slot) * ctx.world if root else 0)  # and the length broadcast below
    heads = torch.stack(slots)[:, :SLOT_HEADER].contiguous().view(torch.int64).tolist() if slots else []
    sizes = [h[0] for h in heads]
    odd = [r for r, h in enumerate(heads) if h[1] != mine]
    longest = torch.tensor([_ODD if odd else max(sizes[1:]) if root else 0], dtype=torch.int64)
    ctx.collective(f"{what} (length)", dist.broadcast, longest, src=ctx.ranks[0])
    big = int(longest[0])
    if big == _ODD:
        raise mismatch(ctx, what, odd or None)
    if big > GATHER_SLOT:
        pad = torch.zeros(big, dtype=torch.uint8)
        if not root:
            pad[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bigs = [torch.empty_like(pad) for _ in range(ctx.world)] if root else None
        ctx.collective(f"{what} (long)", dist.gather, pad, gather_list=bigs, dst=ctx.ranks[0])
        ctx.sent += big
        ctx.received += big * ctx.world if root else 0
        if bigs is not None:
            slots = [torch.cat([s[:SLOT_HEADER], b]) for s, b in zip(slots or [], bigs)]
    if slots is None:
        return None
    # messages of this job's own ranks, as all_gather_object unpickles them; never file contents
    start = SLOT_HEADER
    others = [pickle.loads(s[start : start + n].numpy().tobytes()) for s, n in zip(slots[1:], sizes[1:])]  # noqa: S301
    return [pickle.loads(data), *others]  # noqa: S301  # rank 0's: a copy, as the others' are


def scatter(ctx: DistContext, what: str, objs: list[Any] | None) -> Any:
    """Rank ``r``'s item of ``objs`` (given on rank 0 only), sent to it alone."""
    import torch.distributed as dist

    if ctx.world == 1:
        assert objs is not None
        return objs[0]
    mine = tag(what)
    sent = None if objs is None else [(mine, o) for o in objs]
    out: list[Any] = [None]
    ctx.collective(what, dist.scatter_object_list, out, sent, src=ctx.ranks[0])
    if sent is not None:
        ctx.sent += sum(_size(o) for o in sent)
    ctx.received += 8 + _size(out[0])
    return _untagged(ctx, what, mine, out[0], 0)


def broadcast(ctx: DistContext, what: str, obj: Any, src: int = 0) -> Any:
    """``obj`` of the group's rank ``src``, on every rank."""
    import torch.distributed as dist

    if ctx.world == 1:
        return obj
    mine = tag(what)
    box = [(mine, obj)]
    ctx.collective(what, dist.broadcast_object_list, box, src=ctx.ranks[src])
    if ctx.rank == src:
        ctx.sent += 8 + _size(box[0])
    else:
        ctx.received += 8 + _size(box[0])
    return _untagged(ctx, what, mine, box[0], src)


def _untagged(ctx: DistContext, what: str, mine: int, got: Any, src: int) -> Any:
    if not (isinstance(got, tuple) and len(got) == 2 and got[0] == mine):
        raise mismatch(ctx, what, [src])
    return got[1]


def _size(obj: Any) -> int:
    """The pickled size of a message (what the object collectives send), for the byte counts."""
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
