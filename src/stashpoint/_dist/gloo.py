"""Thin layers over ``torch.distributed`` for stashpoint's own groups: how a gloo group is made
(connected lazily at scale) and the max-reduction preemption agrees on every training step."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def tree_max(flag: Any, group: Any) -> None:
    """``all_reduce(flag, MAX)`` over ``group`` in place, as a binomial tree up to its first rank
    and a broadcast down: 2 log2(R) messages in sequence on every training step, where gloo's
    ring all-reduce takes about 4R (seconds at 16,384 ranks)."""
    import torch
    import torch.distributed as dist

    me, size = dist.get_rank(group), dist.get_world_size(group)
    other = torch.empty_like(flag)
    mask = 1
    while mask < size:
        if me & mask:  # this rank's subtree is done: up to its parent
            dist.send(flag, dist.get_global_rank(group, me - mask), group=group)
            break
        if me + mask < size:
            dist.recv(other, dist.get_global_rank(group, me + mask), group=group)
            torch.maximum(flag, other, out=flag)
        mask <<= 1
    dist.broadcast(flag, dist.get_global_rank(group, 0), group=group)


_lazy_lock = threading.Lock()


#: From this many ranks a stashpoint group connects lazily (see :func:`gloo_group`).
LAZY_FROM_RANKS = 256


_naming_lock = threading.Lock()
_eager_said = False


def _warn_if_eager() -> None:
    """torch reads ``TORCH_GLOO_LAZY_INIT`` from 2.8 on: before, a large group connects every
    pair of its ranks as it is made, and nothing says so. Said once per process."""
    global _eager_said
    import torch

    if _eager_said or tuple(int(x) for x in torch.__version__.split(".")[:2] if x.isdigit()) >= (2, 8):
        return
    _eager_said = True
    logging.getLogger("stashpoint").warning(
        "stashpoint: torch %s connects every pair of ranks of a gloo group as it is made (lazy connection needs "
        "torch 2.8 or newer): at thousands of ranks each stashpoint group opens a socket to every other rank and "
        "may exhaust file descriptors or time out; upgrade torch for jobs this large",
        torch.__version__,
    )


@contextmanager
def _named(name: str) -> Iterator[None]:
    """The group this thread makes with ``use_local_synchronization`` is named ``name``.

    torch names such a group by a hash of its ranks and of how many groups the process holds,
    which differs between ranks that belong to different earlier groups (a user's subgroup):
    their store keys never meet and the creation waits out its timeout on every rank. The
    name given is agreed by the group's ranks; other threads' groups keep torch's names."""
    import torch.distributed.distributed_c10d as c10d

    me = threading.get_ident()
    with _naming_lock:
        original = getattr(c10d, "_process_group_name", None)
        if original is None:  # another torch: its own naming
            yield
            return

        def naming(ranks: Any, use_hashed_name: bool) -> Any:
            return name if use_hashed_name and threading.get_ident() == me else original(ranks, use_hashed_name)

        c10d._process_group_name = naming
        try:
            yield
        finally:
            c10d._process_group_name = original


def gloo_group(lazy: bool | None = None, name: str | None = None, **kwargs: Any) -> Any:
    """``dist.new_group(backend="gloo", **kwargs)``; from ``LAZY_FROM_RANKS`` ranks (or with
    ``lazy``) one whose ranks connect to a peer when they first exchange with it (``name``: the
    group's name, agreed by its ranks, with ``use_local_synchronization``): created eagerly,
    each of R ranks reads R addresses from the store and opens R - 1 connections (2 GB read per
    rank, 16,383 sockets per process and group, at 16,384 ranks), where stashpoint's trees and
    rank-0 exchanges use a few peers each. Smaller groups connect eagerly: a collective whose
    peers are connected fails at once when the program destroys the process groups under it
    (a lazy one waits for a peer that never connects, until its timeout). The launcher's own
    ``TORCH_GLOO_LAZY_INIT``, when set, is kept."""
    import torch.distributed as dist

    ranks = kwargs.get("ranks")
    if lazy is None:
        lazy = (len(ranks) if ranks is not None else dist.get_world_size()) >= LAZY_FROM_RANKS
    if name is not None:
        with _named(name):
            return gloo_group(lazy, **kwargs)
    if not lazy:
        return dist.new_group(backend="gloo", **kwargs)
    _warn_if_eager()
    with _lazy_lock:  # the variable is read as the group is made: set around it alone
        before = os.environ.get("TORCH_GLOO_LAZY_INIT")
        if before is None:
            os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
        try:
            return dist.new_group(backend="gloo", **kwargs)
        finally:
            if before is None:
                os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
