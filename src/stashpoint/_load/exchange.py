"""Loading replicated data at scale: each rank reads a share and the ranks exchange the rest.

When every rank needs the same tensors (a DDP model, replicated optimizer state), reading them
from storage on every rank multiplies the traffic by the world size. Instead the wanted regions
that all ranks share are split over the ranks (balanced by bytes); each rank reads its share
from storage and broadcasts it on the checkpoint group, so storage sees each byte once.
"""

from __future__ import annotations

from typing import Any

import torch

from stashpoint import errors
from stashpoint._core.assign import Item
from stashpoint._dist.arrival import ranks_text
from stashpoint._dist.group import DistContext
from stashpoint._storage.oserror import says_damage
from stashpoint.errors import CheckpointError

# the kinds a failure may name, raised alike on every rank (``except CheckpointNotFoundError``
# catches on all ranks or none)
_KINDS: dict[str, type[CheckpointError]] = {
    k.__name__: k for k in (errors.CheckpointNotFoundError, errors.IncompleteCheckpointError, errors.StateMismatchError)
}


def _order(items: list[tuple[Item, torch.Tensor]]) -> list[tuple[Item, torch.Tensor]]:
    # widest elements first: every tensor starts aligned to its element size in the flat buffer
    return sorted(items, key=lambda it: (-it[1].element_size(), it[0][0], it[0][1].offsets))


_WINDOW = 64 * 1024 * 1024


def broadcast_shares(ctx: DistContext, readers: dict[Item, int], dests: dict[Item, torch.Tensor]) -> int:
    """After each rank has read its items into ``dests``, send them to the others.

    Small tensors travel packed in one reused 64 MiB window per broadcast; a tensor larger than
    the window is broadcast on its own, straight from and into its memory when it is contiguous
    on the CPU. Returns the bytes this rank received.
    """
    import torch.distributed as dist

    window = torch.empty(_WINDOW, dtype=torch.uint8)
    received = 0

    def send(src: int, batch: list[torch.Tensor], used: int) -> None:
        nonlocal received
        if not batch:
            return
        if ctx.rank == src:
            off = 0
            for t in batch:
                n = t.numel() * t.element_size()
                window[off : off + n].copy_(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
                off += n
        ctx.collective("broadcast a read share", dist.broadcast, window[:used], src=ctx.ranks[src])
        if ctx.rank != src:
            off = 0
            for t in batch:
                n = t.numel() * t.element_size()
                t.copy_(window[off : off + n].view(t.dtype).reshape(t.shape))
                off += n
            received += used

    by_reader: dict[int, list[tuple[Item, torch.Tensor]]] = {}
    for item, r in readers.items():
        by_reader.setdefault(r, []).append((item, dests[item]))
    for src in sorted(by_reader):  # the ranks that read something: a few, whatever the world size
        batch: list[torch.Tensor] = []
        used = 0
        for _, t in _order(by_reader[src]):
            n = t.numel() * t.element_size()
            if n > _WINDOW:
                direct = t.device.type == "cpu" and t.is_contiguous() and t.dim() > 0
                if direct:
                    buf = t
                elif ctx.rank == src:
                    buf = t.detach().cpu().contiguous()
                else:  # a receiver's destination (on a GPU, say) is overwritten: nothing to copy out
                    buf = torch.empty(t.shape, dtype=t.dtype)
                ctx.collective("broadcast a read share", dist.broadcast, buf, src=ctx.ranks[src])
                if ctx.rank != src:
                    if not direct:
                        t.copy_(buf)
                    received += n
                continue
            if used + n > _WINDOW:
                send(src, batch, used)
                batch, used = [], 0
            batch.append(t)
            used += n
        send(src, batch, used)
    return received


def failure(e: CheckpointError) -> tuple[str, bool]:
    """A rank's failed status for :func:`agree`: its message, and whether it says the copy is
    damaged or incomplete (a restore falls back past such a copy, and no other)."""
    return str(e), says_damage(e)


def kinded_failure(e: CheckpointError) -> tuple[str, bool, str]:
    """:func:`failure` and the error's class: where every failed rank's is the same, every rank
    raises that class."""
    return str(e), says_damage(e), type(e).__name__


def agree(
    ctx: DistContext, what: str, status: Any, error: type[CheckpointError] = CheckpointError, *, path: str = ""
) -> bool:
    """Tell rank 0 one status per rank; raise on every rank if any rank failed, so that all
    ranks take the same path (e.g. all fall back to an older checkpoint, or none does). A
    failed status is a :func:`failure`; any other is a success. Raises ``error`` when
    every failure says the copy is damaged, else a plain :class:`CheckpointError` (a rank that
    raises its own error instead checks the kind with :func:`own_or_agreed`). Returns whether
    every rank's status was the same. Each rank sends one status and receives one small
    answer (rank 0 alone sees all R). ``path``: the checkpoint's, for an agreed
    :class:`StateMismatchError`."""
    statuses = ctx.gather(what, status)
    verdict: tuple[str, Any, bool, str] | None = None
    if statuses is not None:
        failed = [(r, s) for r, s in enumerate(statuses) if isinstance(s, tuple)]
        shown = "; ".join(f"rank {r}: {s[0]}" for r, s in failed[:16])[:4000]
        if failed:
            ranks = ", ".join(str(r) for r, _ in failed[:64]) + (" ..." if len(failed) > 64 else "")
            kinds = {s[2] if len(s) > 2 else "" for _, s in failed}
            kind = kinds.pop() if len(kinds) == 1 else ""
            damaged = all(s[1] for _, s in failed)
            verdict = ("failed", f"loading failed on rank(s) {ranks}: {shown}", damaged, kind)
        elif odd := _other_checkpoint(statuses, path):
            verdict = ("failed", odd, False, "")
        else:
            verdict = ("ok", all(s == statuses[0] for s in statuses), True, "")
    verdict = ctx.broadcast(f"{what} (verdict)", verdict)
    assert verdict is not None
    if verdict[0] == "failed":
        raise _agreed(_KINDS.get(verdict[3]) or (error if verdict[2] else CheckpointError), verdict[1], path)
    return bool(verdict[1])


def _other_checkpoint(statuses: list[Any], path: str) -> str | None:
    """Where statuses are ``[checkpoint's save id, ...]``: the error of ranks that opened
    different checkpoints (each picked its own newest, or was given its own path)."""
    ids = [s[0] if isinstance(s, list) and s else None for s in statuses]
    odd = [r for r, i in enumerate(ids) if i != ids[0]]
    if not odd or ids[0] is None:
        return None
    return (
        f"the ranks opened different checkpoints: {ranks_text(odd)} opened another one than rank 0 ({path}, "
        f"save {ids[0]}; rank {odd[0]}: save {ids[odd[0]]}). Every rank must load the same checkpoint: choose the "
        "path on one rank and broadcast it, or restore through a CheckpointManager, which agrees on the step"
    )


def _agreed(kind: type[CheckpointError], message: str, path: str) -> CheckpointError:
    """``kind(message)``; a :class:`StateMismatchError` (made from a path and problems) holds
    the other ranks' message as its one problem."""
    if not issubclass(kind, errors.StateMismatchError):
        return kind(message)
    e = kind.__new__(kind)
    Exception.__init__(e, message)
    e.path, e.problems, e.hint = path, [message], None
    return e


def own_or_agreed(own: CheckpointError | None, agreed: CheckpointError, *, same_class: bool = False) -> CheckpointError:
    """What a rank raises once :func:`agree` raised ``agreed``: its own error where that is of
    the same kind (a damaged copy or not), so that every rank takes the same path; with
    ``same_class``, only where it is of the agreed class too (every rank raises one class)."""
    if own is not None and says_damage(own) == says_damage(agreed) and (not same_class or type(own) is type(agreed)):
        return own
    return agreed
