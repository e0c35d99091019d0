"""Real training stacks: real model code under real parallelisms, resumed the way users restart.

Each cell runs ``stack_worker.py`` on real gloo ranks (see its docstring): an uninterrupted run,
a run that saves after N steps, and fresh processes that build the model and a *fresh* optimizer,
load, and train on. A few cells run in the default tier; the whole matrix with ``-m slow``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import stashpoint
from dist_util import run_world
from stashpoint._tools.convert import import_checkpoint

WORKER = Path(__file__).with_name("stack_worker.py")
slow = pytest.mark.slow

# id: (model, parallelism, ranks, worker flags)
SAME_WORLD = [
    pytest.param("gpt2", "fsdp2", 2, (), id="gpt2-fsdp2"),
    pytest.param("gpt2", "ddp", 2, (), id="gpt2-ddp"),
    pytest.param("cnn", "single", 1, ("--optim", "sgd", "--scaler"), id="cnn-single-sgd-gradscaler", marks=slow),
    pytest.param("gpt2", "single", 1, ("--compile",), id="gpt2-single-compile", marks=slow),
    pytest.param("gpt2", "ddp", 2, ("--compile",), id="gpt2-ddp-compile", marks=slow),
    pytest.param("llama", "single", 1, ("--optim", "sgd"), id="llama-single-sgd", marks=slow),
    pytest.param("llama", "fsdp2", 2, ("--ac",), id="llama-fsdp2-actckpt", marks=slow),
    pytest.param("gpt2", "fsdp2", 2, ("--ac", "--optim", "sgd"), id="gpt2-fsdp2-actckpt-sgd", marks=slow),
    pytest.param("llama", "tp2d", 4, (), id="llama-fsdp2+tp-2x2", marks=slow),
    pytest.param("llama", "hsdp", 4, (), id="llama-hsdp-2x2", marks=slow),
    pytest.param("gpt2", "hsdp", 4, (), id="gpt2-hsdp-2x2", marks=slow),
    pytest.param("cnn", "ddp", 2, ("--optim", "sgd", "--scaler"), id="cnn-ddp-sgd-gradscaler", marks=slow),
    pytest.param("cnn", "fsdp2", 2, (), id="cnn-fsdp2", marks=slow),
]

# id: (model, saved with, ranks, loaded into, ranks)
RESHARD = [
    pytest.param("gpt2", "fsdp2", 2, "fsdp2", 3, id="gpt2-fsdp2-2to3"),
    pytest.param("gpt2", "fsdp2", 2, "single", 1, id="gpt2-fsdp2-to-plain", marks=slow),
    pytest.param("gpt2", "single", 1, "fsdp2", 2, id="gpt2-plain-to-fsdp2", marks=slow),
    pytest.param("llama", "fsdp2", 4, "fsdp2", 2, id="llama-fsdp2-4to2", marks=slow),
    pytest.param("llama", "tp2d", 4, "fsdp2", 2, id="llama-2d-to-1d", marks=slow),
    pytest.param("llama", "fsdp2", 2, "tp2d", 4, id="llama-1d-to-2d", marks=slow),
    pytest.param("gpt2", "ddp", 2, "fsdp2", 3, id="gpt2-ddp-to-fsdp2-3", marks=slow),
    pytest.param("cnn", "fsdp2", 2, "ddp", 2, id="cnn-fsdp2-to-ddp", marks=slow),
]


def phase(phase: str, d: Path, model: str, par: str, n: int, *flags: str) -> list[dict]:
    results = run_world(n, phase, str(d), model, par, *flags, worker=WORKER, timeout=240)
    for r in results:
        assert "error" not in r, f"{phase} {model} {par} on rank {r.get('rank')}:\n{r['error']}"
    return results


def state_bytes(ckpt: Path) -> int:
    """Bytes of the checkpoint's distinct tensors."""
    seen: dict[int, int] = {}

    def walk(v) -> None:
        if isinstance(v, torch.Tensor):
            seen[id(v)] = v.numel() * v.element_size()
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(stashpoint.read(ckpt))
    return sum(seen.values())


def tensors_of(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(tensors_of(v, f"{prefix}/{k}"))
    return out


def check_dcp_parity(d: Path) -> None:
    """The same state saved with dcp.save (through get_state_dict) and imported, and saved with
    stashpoint: identical model and optimizer-state tensors."""
    import_checkpoint(d / "dcp", d / "imported")
    ours, theirs = stashpoint.read(d / "ckpt"), stashpoint.read(d / "imported")
    for part in ("model", "optim"):
        a = tensors_of(ours[part]["state"] if part == "optim" else ours[part])
        b = tensors_of(theirs[part]["state"] if part == "optim" else theirs[part])
        assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:10]
        bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
        assert not bad, f"{part}: {bad[:10]}"


@pytest.mark.parametrize(("model", "par", "n", "flags"), SAME_WORLD)
def test_resume_in_fresh_processes_with_a_fresh_optimizer_continues_bit_for_bit(tmp_path, model, par, n, flags):
    straight = phase("straight", tmp_path, model, par, n, *flags)
    first = phase("first", tmp_path, model, par, n, "--dcp", *flags)
    if n > 1:  # the first plan from descriptions, except where FSDP2 strides over TP's shards
        assert {r["planned"] for r in first} == {"general" if par == "tp2d" else "described"}, first
        assert all(r["boxes_differ"] == [] and (r["strided"] > 0) == (par == "tp2d") for r in first), first
    assert first[0]["read_vs_dcp_helpers"] == [], "stashpoint.read differs from DCP's get_*_state_dict"
    resumed = phase("resume", tmp_path, model, par, n, *flags)
    assert resumed[0]["vs_ref"] == [], "the loaded state differs from the saved one"
    for s, r in zip(straight, resumed):
        assert r["losses"] == s["losses"], f"rank {r['rank']}: {r['losses']} != {s['losses']}"
        if r["param_type"] == "DTensor":  # optimizer state made like its parameter
            assert "DTensor" in r["state_types"], r
    check_dcp_parity(tmp_path)


@pytest.mark.parametrize(("model", "saved_as", "n", "loaded_as", "m"), RESHARD)
def test_load_into_another_world_size_or_sharding_gives_back_every_saved_tensor(  # noqa: PLR0917
    tmp_path, model, saved_as, n, loaded_as, m
):
    phase("first", tmp_path, model, saved_as, n)
    resumed = phase("resume", tmp_path, model, loaded_as, m)
    assert resumed[0]["vs_ref"] == [], "a gathered parameter or optimizer state differs from the saved one"
    for r in resumed:
        assert r["losses"] and all(math.isfinite(x) for x in r["losses"]), r
        if r["param_type"] == "DTensor":
            assert "DTensor" in r["state_types"], r
    if saved_as == loaded_as == "fsdp2" and m > n:
        # rank 0's slice lies within rank 0's saved chunks: it reads those and nothing else. (A
        # verified read takes whole checksum blocks, larger than these small models' tensors, so a
        # rank whose slice straddles two saved chunks reads both whole here.)
        total = state_bytes(tmp_path / "ckpt")
        assert resumed[0]["read_bytes"] <= total / n * 1.05 + 4096, (resumed[0]["read_bytes"], total)


@slow  # the default tier checks the same bound on the 2 -> 3 load (gpt2-fsdp2-2to3)
def test_a_fresh_optimizer_under_fsdp2_reads_only_its_own_slice(tmp_path):
    phase("first", tmp_path, "gpt2", "fsdp2", 2)
    resumed = phase("resume", tmp_path, "gpt2", "fsdp2", 2)
    total = state_bytes(tmp_path / "ckpt")
    for r in resumed:
        assert r["state_types"] == ["DTensor", "Tensor"], r  # moments are DTensors, the step a plain scalar
        assert r["read_bytes"] <= total / 2 * 1.05 + 4096, (r["read_bytes"], total)
    assert sum(r["read_bytes"] for r in resumed) >= total * 0.95  # and together they read it all


def test_fsdp1_is_refused_with_what_to_use_instead(tmp_path):
    from torch.distributed.fsdp import FullyShardedDataParallel

    # FSDP1 cannot be constructed without an accelerator; the refusal looks only at the type
    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    torch.nn.Module.__init__(fsdp1)
    with pytest.raises(stashpoint.UnsupportedStateError, match=r"FSDP1.*fully_shard"):
        stashpoint.save({"model": fsdp1}, tmp_path / "ckpt")
    with pytest.raises(stashpoint.UnsupportedStateError, match="FSDP2"):
        stashpoint.save({"model": torch.nn.Linear(2, 2)}, tmp_path / "plain")
        stashpoint.load({"model": fsdp1}, tmp_path / "plain")
    assert not (tmp_path / "ckpt" / "manifest.json").exists()
    # wrapped around a part of the model, or under torch.compile: before, saved through the
    # training's process group (only the root was looked at)
    for outer in (torch.nn.Sequential(fsdp1, torch.nn.Linear(2, 2)), torch.compile(torch.nn.Sequential(fsdp1))):
        with pytest.raises(stashpoint.UnsupportedStateError, match="FSDP1"):
            stashpoint.save({"model": outer}, tmp_path / "nested")
    assert not (tmp_path / "nested" / "manifest.json").exists()
    # a model saved once, then wrapped in place (FSDP1's auto-wrap sets the wrappers into it)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    stashpoint.save({"model": model}, tmp_path / "before")
    model[1] = fsdp1
    with pytest.raises(stashpoint.UnsupportedStateError, match="FSDP1"):
        stashpoint.save({"model": model}, tmp_path / "after")
