"""RNGState and StatefulSampler round trips."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import stashpoint


def _draw() -> tuple:
    return (random.random(), float(np.random.rand()), float(np.random.randn()), torch.rand(3).tolist())


def test_rng_state_restores_every_generator(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()
    np.random.randn()  # leaves a cached gaussian in NumPy's legacy state
    stashpoint.save({"rng": stashpoint.RNGState()}, tmp_path / "ck")
    expected = [_draw() for _ in range(3)]
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    stashpoint.load({"rng": stashpoint.RNGState()}, tmp_path / "ck")
    assert [_draw() for _ in range(3)] == expected


def test_sampler_resumes_mid_epoch_and_across_epochs(tmp_path):
    data = list(range(23))
    sampler = stashpoint.StatefulSampler(data, seed=5)
    loader = DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator())
    it = iter(loader)
    for _ in range(3):
        next(it)
    stashpoint.save({"sampler": sampler}, tmp_path / "ck")
    rest = [b.tolist() for b in it] + [b.tolist() for b in loader]  # rest of epoch 0, then epoch 1

    fresh = stashpoint.StatefulSampler(data, seed=0)
    stashpoint.load({"sampler": fresh}, tmp_path / "ck")
    assert fresh.state_dict() == {
        "epoch": 0,
        "index": 12,
        "seed": 5,
        "shuffle": True,
        "num_samples": 23,
        "world_size": 1,
    }
    loader2 = DataLoader(data, batch_size=4, sampler=fresh, generator=torch.Generator())
    assert [b.tolist() for b in loader2] + [b.tolist() for b in loader2] == rest
    assert sorted(x for b in rest[-6:] for x in b) == data, "epoch 1 is a full permutation"


def test_the_distributed_samplers_loop_with_set_epoch_resumes_mid_epoch(tmp_path):
    """``for epoch in range(sampler.epoch, E): sampler.set_epoch(epoch)`` after a restore: before,
    set_epoch put the restored epoch back to its start, and the resume replayed its batches."""
    data = list(range(10))

    def batches(sampler, loader, start, stop, cut=None):
        out = []
        for epoch in range(start, stop):
            sampler.set_epoch(epoch)
            for b in loader:
                out.append(b.tolist())
                if cut is not None and len(out) == cut:
                    return out
        return out

    def fresh():
        sampler = stashpoint.StatefulSampler(data, seed=3)
        return sampler, DataLoader(data, batch_size=2, sampler=sampler)

    s, loader = fresh()
    whole = batches(s, loader, 0, 3)
    s, loader = fresh()
    head = batches(s, loader, 0, 3, cut=7)  # two batches into epoch 1
    stashpoint.save({"sampler": s}, tmp_path / "ck")
    s2, loader2 = fresh()
    stashpoint.load({"sampler": s2}, tmp_path / "ck")
    assert head + batches(s2, loader2, s2.epoch, 3) == whole
    s3, loader3 = fresh()
    next(iter(loader3))  # a batch peeked (shape inference) before the loop: not a restore
    assert batches(s3, loader3, 0, 3) == whole, "set_epoch(0) starts epoch 0 afresh"


def test_sampler_refuses_another_dataset_size():
    s = stashpoint.StatefulSampler(10)
    with pytest.raises(ValueError, match="covered 10 samples, this one covers 11"):
        stashpoint.StatefulSampler(11).load_state_dict(s.state_dict())
    assert list(stashpoint.StatefulSampler(4, shuffle=False)) == [0, 1, 2, 3]


def test_sampler_splits_over_ranks_and_resumes_on_another_world_size():
    n = 40
    full = list(stashpoint.StatefulSampler(n, seed=3))
    two = [stashpoint.StatefulSampler(n, seed=3, rank=r, world_size=2) for r in range(2)]
    its = [iter(s) for s in two]
    taken = [next(its[r]) for _ in range(5) for r in range(2)]  # 5 samples per rank, in lockstep
    assert sorted(taken) == sorted(full[:10])
    saved = two[0].state_dict()
    assert saved["index"] == 10, "the position counts samples of all ranks together"
    three = [stashpoint.StatefulSampler(n, seed=0, rank=r, world_size=3) for r in range(3)]
    for s in three:
        s.load_state_dict(saved)
    assert len(three[0]) == 10, "(40 - 10 taken) // 3 ranks"
    rest = [i for s in three for i in s]
    assert sorted(rest) == sorted(full[10:]), "the 30 left split over 3 ranks: none skipped or repeated"
    # 11 left over 3 ranks: the 2 at the end that do not split evenly are the only ones dropped
    # (they were counted from the epoch's start, which dropped 3 of the 6 left in 10 samples)
    for n, taken, ws, kept in ((41, 30, 3, 9), (10, 4, 3, 6), (10, 3, 2, 6), (7, 6, 2, 0)):
        src = stashpoint.StatefulSampler(n, seed=1, rank=0, world_size=1)
        src.index = taken
        ranks = [stashpoint.StatefulSampler(n, seed=1, rank=r, world_size=ws) for r in range(ws)]
        for s in ranks:
            s.load_state_dict({**src.state_dict(), "world_size": 1})
        assert [len(s) for s in ranks] == [kept // ws] * ws, (n, taken, ws)
        got = [i for s in ranks for i in s]
        whole = list(stashpoint.StatefulSampler(n, seed=1))
        assert sorted(got) == sorted(whole[taken : taken + kept]), (n, taken, ws)
    with pytest.raises(ValueError, match="rank must be in"):
        stashpoint.StatefulSampler(4, rank=2, world_size=2)


def test_seek_puts_a_loader_with_workers_where_the_loop_was_across_epochs():
    """With workers the loader takes indices ahead of the loop, near an epoch's end into the next
    epoch: the docs' earlier formula (the index alone) skipped the rest of epoch 0 there."""
    n, bs, world, per_epoch = 64, 4, 2, 8  # 32 samples per rank: 8 batches an epoch

    def batches(sampler: stashpoint.StatefulSampler, epochs: int, workers: int = 0) -> Iterator[list[int]]:
        for _ in range(epochs):
            loader = DataLoader(list(range(n)), batch_size=bs, sampler=sampler, num_workers=workers,
                                generator=torch.Generator())  # fmt: skip
            for b in loader:
                yield b.tolist()

    straight = list(batches(stashpoint.StatefulSampler(n, seed=1, rank=1, world_size=world), 3))
    for done in (3, per_epoch - 1, per_epoch + 2):
        sampler = stashpoint.StatefulSampler(n, seed=1, rank=1, world_size=world)
        it = batches(sampler, 2, workers=2)
        seen = [next(it) for _ in range(done)]
        taken = sampler.state_dict()
        assert (taken["epoch"], taken["index"]) != (done // per_epoch, done % per_epoch * bs * world), "ahead"
        it.close()
        fresh = stashpoint.StatefulSampler(n, seed=0, rank=1, world_size=world)
        fresh.load_state_dict(taken)
        fresh.seek(done, bs)
        rest = list(batches(fresh, 3 - done // per_epoch))
        assert seen + rest == straight, done
    with pytest.raises(ValueError, match="no batch of 64"):
        stashpoint.StatefulSampler(n, world_size=2).seek(1, 64, drop_last=True)


def test_each_rank_resumes_its_own_stateful_dataloader_in_fresh_processes(tmp_path):
    """A torchdata StatefulDataLoader's state holds its sampler's generator as a tensor, under
    one key on every rank: taken for a replica, one copy was saved, and every rank resumed with
    rank 0's shuffle order. Kept per rank now."""
    pytest.importorskip("torchdata")
    from dist_util import run_world

    worker = Path(__file__).with_name("loader_worker.py")
    saved = run_world(2, "save", str(tmp_path / "ck"), worker=worker)
    assert saved[0]["next"] != saved[1]["next"], "the ranks shuffle apart"
    resumed = run_world(2, "resume", str(tmp_path / "ck"), worker=worker)
    assert [r["next"] for r in resumed] == [s["next"] for s in saved], (saved, resumed)


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_stateful_dataloader_saved_with_its_tensors_as_tensors_still_loads(tmp_path, monkeypatch, shuffle):
    """Checkpoints saved before a loader's state was kept per rank hold its tensors as tensors
    (without shuffling, its state holds none)."""
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from stashpoint._state import perrank

    def loader() -> StatefulDataLoader:
        shuffled = torch.Generator().manual_seed(7)
        return StatefulDataLoader(list(range(20)), batch_size=2, shuffle=shuffle, generator=shuffled)

    dl = loader()
    it = iter(dl)
    next(it)
    with monkeypatch.context() as m:
        m.setattr(perrank, "is_loader", lambda obj: False)  # as the save before
        stashpoint.save({"loader": dl}, tmp_path / "old")
    stashpoint.save({"loader": dl}, tmp_path / "new")
    want = [next(it).tolist() for _ in range(3)]
    for name in ("old", "new"):
        fresh = loader()
        stashpoint.load({"loader": fresh}, tmp_path / name)
        got = iter(fresh)
        assert [next(got).tolist() for _ in range(3)] == want, name


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loaders_length_holds_through_a_pass_and_finds_its_last_batch(workers):
    """len() counted the samples not yet taken, so it shrank as the loader took them (by how far
    the workers had run ahead): `i + 1 == len(loader)` fired mid-epoch. It is now a pass's length:
    a whole epoch, or after a restore mid-epoch the rest of it."""
    sampler = stashpoint.StatefulSampler(20, seed=1)
    data = list(range(20))
    loader = DataLoader(data, batch_size=2, sampler=sampler, num_workers=workers, generator=torch.Generator())
    for _ in range(2):
        seen = [(i, len(loader)) for i, _ in enumerate(loader)]
        assert {n for _, n in seen} == {10} and [i for i, n in seen if i + 1 == n] == [9], seen
    it = iter(sampler)
    for _ in range(6):
        next(it)
    restored = stashpoint.StatefulSampler(20, seed=1)
    restored.load_state_dict(sampler.state_dict())
    loader = DataLoader(
        list(range(20)), batch_size=3, sampler=restored, num_workers=workers, generator=torch.Generator()
    )
    seen = [(i, len(loader)) for i, _ in enumerate(loader)]  # 14 left: 3 x 4 and a short one
    assert {n for _, n in seen} == {5} and [i for i, n in seen if i + 1 == n] == [4], seen
    sought = stashpoint.StatefulSampler(40, seed=0)
    sought.seek(3, 3)  # 9 samples taken: 31 left, 10 x 3 and a short one
    loader = DataLoader(list(range(40)), batch_size=3, sampler=sought, num_workers=workers, generator=torch.Generator())
    seen = [(i, len(loader)) for i, _ in enumerate(loader)]
    assert {n for _, n in seen} == {11} and [i for i, n in seen if i + 1 == n] == [10], seen


@pytest.mark.parametrize("batch", [3, 5])
def test_a_loop_counting_epochs_itself_resumes_from_a_save_at_an_epochs_last_batch(tmp_path, batch):
    """With a short last batch the loader had asked the sampler for more, which moved it to the
    next epoch's start: a loop that counts epochs itself called set_epoch(0) after the restore,
    and epoch 0 was trained again whole. With a full last batch it was right."""

    def run(cut: bool, resume: bool) -> list[tuple[int, list[int]]]:
        sampler = stashpoint.StatefulSampler(10, seed=0)
        loader = DataLoader(list(range(10)), batch_size=batch, sampler=sampler, generator=torch.Generator())
        state: dict = {"sampler": sampler, "epoch": 0}
        if resume:
            stashpoint.load(state, tmp_path / "ck")
        seen = []
        for epoch in range(state["epoch"], 2):
            state["epoch"] = epoch
            sampler.set_epoch(epoch)
            for i, b in enumerate(loader):
                seen.append((epoch, b.tolist()))
                if cut and epoch == 0 and i + 1 == len(loader):  # the save at epoch 0's last batch
                    stashpoint.save(state, tmp_path / "ck", overwrite=True)
                    return seen
        return seen

    straight = run(cut=False, resume=False)
    first = run(cut=True, resume=False)
    assert first + run(cut=False, resume=True) == straight


def test_seek_after_restoring_a_position_of_another_world_size_is_refused():
    """seek counts batches at this world size; before, after a restore from 2 ranks onto 1 it
    moved the position back, and samples were trained again, silently."""
    two = stashpoint.StatefulSampler(24, seed=0, rank=0, world_size=2)
    it = iter(two)
    for _ in range(6):
        next(it)
    one = stashpoint.StatefulSampler(24, seed=0, rank=0, world_size=1)
    one.load_state_dict(two.state_dict())
    with pytest.raises(ValueError, match="saved on 2 rank"):
        one.seek(3, 2)
    same = stashpoint.StatefulSampler(24, seed=0, rank=0, world_size=2)
    same.load_state_dict(two.state_dict())
    same.seek(3, 2)
    assert (same.epoch, same.index) == (0, 12)
    with pytest.raises(ValueError, match=r"makes no batch of 4$"):
        stashpoint.StatefulSampler(1, world_size=2, rank=0).seek(1, 4)


class _Buffered(torch.utils.data.IterableDataset):
    """An iterable dataset whose state holds a buffer of 2 MiB (a shuffle buffer's size)."""

    def __init__(self) -> None:
        self.pos = 0
        self.buf = torch.arange(1 << 19, dtype=torch.float32)

    def __iter__(self):  # type: ignore[no-untyped-def]
        while self.pos < 20:
            self.pos += 1
            yield self.pos

    def state_dict(self):  # type: ignore[no-untyped-def]
        return {"pos": self.pos, "buf": self.buf}

    def load_state_dict(self, sd):  # type: ignore[no-untyped-def]
        self.pos, self.buf = sd["pos"], sd["buf"]


def test_a_loaders_large_tensors_stay_tensors_and_named_tuples_keep_their_fields(tmp_path):
    """As JSON, a loader's large tensors bloated the index (past 190 MiB the save failed); and
    a named tuple rebuilt from one generator failed with a TypeError."""
    pytest.importorskip("torchdata")
    from collections import namedtuple

    from torchdata.stateful_dataloader import StatefulDataLoader

    from stashpoint._state import perrank

    pos = namedtuple("pos", "epoch offset")
    small = {"p": pos(1, torch.ones(2)), "big": torch.zeros(1 << 19)}
    plain = perrank.as_plain(small)
    assert plain["big"] is small["big"] and type(plain["p"]) is pos
    back = perrank.as_tensors(plain)
    assert back["p"].epoch == 1 and torch.equal(back["p"].offset, torch.ones(2))

    dl = StatefulDataLoader(_Buffered(), batch_size=2)
    it = iter(dl)
    next(it)
    dl.dataset.buf.fill_(7)
    stashpoint.save({"loader": dl}, tmp_path / "ck")
    assert max(p.stat().st_size for p in (tmp_path / "ck").glob("index-*")) < 1 << 20
    fresh = StatefulDataLoader(_Buffered(), batch_size=2)
    stashpoint.load({"loader": fresh}, tmp_path / "ck")
    assert next(iter(fresh)).tolist() == next(it).tolist()
    assert torch.equal(fresh.dataset.buf, torch.full((1 << 19,), 7.0))
