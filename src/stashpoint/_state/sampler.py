"""StatefulSampler: a shuffling (and rank-splitting) sampler whose position can be checkpointed."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler


class StatefulSampler(Sampler[int]):
    """Yields a seeded permutation of ``range(len(data))`` per epoch and remembers where it is.

    The order depends only on ``(seed, epoch)``, so restoring ``state_dict()`` resumes the data
    stream exactly: the next index yielded after a load is the one that would have come next.

    In a distributed run each rank takes every ``world_size``-th index of the epoch's permutation
    (starting at its rank), like ``DistributedSampler``; the tail that does not split evenly is
    dropped, so every rank yields the same number of samples. The position is kept as the number
    of samples all ranks together have taken (``index``), so a checkpoint restored on a different
    number of ranks continues the same permutation from the same point: the samples left are
    dealt out over the new ranks, none repeated, and only the fewer than ``world_size`` at the
    end that do not split evenly over them are dropped.

    ``rank`` and ``world_size`` default to the ``torch.distributed`` world when it is initialized.
    Put the sampler in the saved state beside the model::

        sampler = stashpoint.StatefulSampler(dataset, seed=0)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler, generator=torch.Generator())
        state = {"model": model, "optim": optim, "sampler": sampler}

    Give the DataLoader its own ``generator``: each new iterator draws a seed from it, and from
    torch's global generator (which dropout uses) otherwise, so a resumed run would drift. The
    position counts the indices the DataLoader has taken from the sampler: with
    ``num_workers=0`` that is exactly what the loop consumed. Worker processes prefetch ahead (into
    the next epoch, near an epoch's end), so with ``num_workers > 0`` set the position from the
    step count after restoring: ``sampler.seek(batches_taken, batch_size)``.
    """

    def __init__(
        self,
        data: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        # checked here, as the load checks them: a value saved that no load takes loses the position
        # a Sized by its length (an array or a tensor has __index__ too), else a count
        self.num_samples = _whole("len(data)", len(data)) if hasattr(data, "__len__") else _whole("data", data)
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        self.shuffle = shuffle
        self.seed = _whole("seed", seed)
        if rank is None or world_size is None:
            import torch.distributed as dist

            dist_on = dist.is_available() and dist.is_initialized()
            rank = rank if rank is not None else (dist.get_rank() if dist_on else 0)
            world_size = world_size if world_size is not None else (dist.get_world_size() if dist_on else 1)
        rank, world_size = _whole("rank", rank), _whole("world_size", world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.index = 0  # samples of this epoch taken by all ranks together
        self._restored = False  # a position restored, not iterated from yet (set_epoch keeps it)
        self._pass: tuple[object, int] | None = None  # the pass running, and its length
        self._loaded_world: int | None = None  # the world size of the position restored

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g)

    @property
    def _usable(self) -> int:
        return self.num_samples // self.world_size * self.world_size

    def __iter__(self) -> Iterator[int]:
        self._restored = False  # the restored position is taken: a later set_epoch starts afresh
        order = self._order().tolist()
        this = self._pass = (object(), self._left())
        try:
            # Bounded by the epoch's end, not by _usable: a position restored from another world
            # size is no multiple of this one, so the tail that does not split moves with it.
            while self.index + self.world_size <= self.num_samples:
                i = order[self.index + self.rank]
                self.index += self.world_size
                yield i
        except GeneratorExit:  # a pass given up: not another pass's length, begun since
            if self._pass is this:
                self._pass = None
            raise
        self.epoch += 1
        self.index = 0

    def _left(self) -> int:
        return max(0, self.num_samples - self.index) // self.world_size

    def __len__(self) -> int:
        """The samples a pass yields on this rank: a whole epoch's, or after a restore mid-epoch
        the rest of it. The length of the last pass begun holds until the next begins (or the
        position is set): the loader takes a pass's last indices before the loop has their
        batches (a short last batch, workers ahead), and ``i + 1 == len(loader)`` must still
        find the last batch."""
        return self._pass[1] if self._pass is not None else self._left()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; except right after a restore, the epoch restored,
        which keeps its position: DistributedSampler's loop,
        ``for epoch in range(sampler.epoch, E): sampler.set_epoch(epoch)``, resumes mid-epoch.
        Right after a restore at the start of the next epoch, ``epoch`` is the one just done: a
        save at an epoch's last batch finds the sampler past it when that batch was short (the
        loader asked for more), and a loop counting epochs itself names the epoch it was in."""
        epoch = _whole("epoch", epoch)
        self._pass = None
        if self._restored and self.index == 0 and epoch == self.epoch - 1:
            self.epoch, self.index = epoch, self.num_samples  # that epoch's pass yields nothing more
        elif not (self._restored and epoch == self.epoch):
            self.epoch, self.index = epoch, 0
        self._restored = False

    def seek(self, batches: int, batch_size: int, *, drop_last: bool = False) -> None:
        """Stand where a loop stands that has taken ``batches`` batches of ``batch_size`` (per
        rank) from a DataLoader on this sampler, epoch after epoch from epoch 0: the epoch and
        the position in it. For ``num_workers > 0``, whose workers take indices ahead of the loop,
        call it after restoring, with the loop's own count; ``drop_last`` as the DataLoader's.
        The count is of batches at this sampler's world size: after a restart on another number
        of ranks, where the batches before it were of another size, restore the sampler's saved
        position instead (exact with ``num_workers=0``)."""
        batches, batch_size = _whole("batches", batches), _whole("batch_size", batch_size)
        if batch_size < 1:
            raise ValueError(f"seek needs batch_size >= 1, got {batch_size}")
        if self._loaded_world not in (None, self.world_size):
            raise ValueError(
                f"the position restored was saved on {self._loaded_world} rank(s) and seek counts batches on "
                f"{self.world_size}: keep the restored position (exact with num_workers=0) instead of seeking"
            )
        per_rank = self._usable // self.world_size
        per_epoch = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
        if per_epoch == 0:
            raise ValueError(
                f"an epoch of {per_rank} samples per rank makes no batch of {batch_size}"
                + (" with drop_last=True" if drop_last else "")
            )
        self._pass = None
        self.epoch, done = divmod(batches, per_epoch)
        self.index = min(done * batch_size, per_rank) * self.world_size
        self._restored = True  # a set_epoch of this epoch keeps the position, as after a restore

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
        }

    def _stashpoint_check(self, state_dict: Any) -> str | None:
        """Why ``state_dict`` is no state this sampler can take (None if it is)."""
        if not isinstance(state_dict, dict) or set(state_dict) != set(self.state_dict()):
            return f"a sampler state has the keys {sorted(self.state_dict())}"
        for k in ("epoch", "index", "seed", "num_samples", "world_size"):
            v = state_dict[k]
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _BOUND:
                return f"the sampler's {k} must be an integer from 0 to 2**62 - 1, not {str(v)[:40]!r}"
        if not isinstance(state_dict["shuffle"], bool):
            return "the sampler's shuffle must be a bool"
        if state_dict["num_samples"] != self.num_samples:
            return (
                f"the checkpoint's sampler covered {state_dict['num_samples']} samples, this one covers "
                f"{self.num_samples}; the data position cannot be restored onto a different dataset"
            )
        if state_dict["index"] > self.num_samples or state_dict["world_size"] < 1:
            return "the sampler's position is past the end of its epoch"
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        problem = self._stashpoint_check(state_dict)
        if problem is not None:
            raise ValueError(problem)
        if state_dict["num_samples"] != self.num_samples:
            raise ValueError(
                f"the checkpoint's sampler covered {state_dict['num_samples']} samples, this one covers "
                f"{self.num_samples}; the data position cannot be restored onto a different dataset"
            )
        self.epoch = int(state_dict["epoch"])
        self.index = int(state_dict["index"])
        self._loaded_world = int(state_dict["world_size"])
        self._pass = None
        self._restored = True
        self.seed = int(state_dict["seed"])
        self.shuffle = bool(state_dict["shuffle"])


_BOUND = 2**62  # what a saved position holds: far past any dataset, epoch or seed


def _whole(name: str, value: object) -> int:
    """``value`` as an int (a NumPy or torch integer too) from 0 to 2**62 - 1, or an error naming
    ``name``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"StatefulSampler's {name} must be an integer, got {value!r}")
    number = operator.index(value)
    if not 0 <= number < _BOUND:
        raise ValueError(f"StatefulSampler's {name} must be from 0 to 2**62 - 1, got {number}")
    return number
