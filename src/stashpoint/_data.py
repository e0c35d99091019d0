"""StatefulSampler: a shuffling sampler whose position in the data can be checkpointed."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler


class StatefulSampler(Sampler[int]):
    """Yields a seeded permutation of ``range(len(data))`` per epoch and remembers where it is.

    Its order depends only on ``(seed, epoch)``, so restoring ``state_dict()`` resumes the data
    stream exactly: the next index yielded after a load is the one that would have come next.
    Put the sampler in the saved state beside the model::

        sampler = stashpoint.StatefulSampler(dataset, seed=0)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        state = {"model": model, "optim": optim, "sampler": sampler}

    The position counts the indices the DataLoader has taken from the sampler. With
    ``num_workers=0`` that is exactly what the training loop consumed. Worker processes prefetch
    batches ahead, so with ``num_workers > 0`` restore with
    ``sampler.load_state_dict({**sd, "index": batches_consumed * batch_size})``.
    """

    def __init__(self, data: Sized | int, *, shuffle: bool = True, seed: int = 0) -> None:
        self.num_samples = data if isinstance(data, int) else len(data)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.index = 0

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[int]:
        order = self._order().tolist()
        while self.index < self.num_samples:
            i = order[self.index]
            self.index += 1
            yield i
        self.epoch += 1
        self.index = 0

    def __len__(self) -> int:
        return self.num_samples - self.index

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning."""
        self.epoch, self.index = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["num_samples"] != self.num_samples:
            raise ValueError(
                f"the checkpoint's sampler covered {state_dict['num_samples']} samples, this one covers "
                f"{self.num_samples}; the data position cannot be restored onto a different dataset"
            )
        self.epoch = int(state_dict["epoch"])
        self.index = int(state_dict["index"])
        self.seed = int(state_dict["seed"])
        self.shuffle = bool(state_dict["shuffle"])
