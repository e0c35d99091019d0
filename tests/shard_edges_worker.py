"""One rank of tests/test_shard_edges.py (run by tests/dist_util.run_world as a real process):
sharded states at their edges, saved and loaded back exactly or refused by key.

    python shard_edges_worker.py SCENARIO ROOT   (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)

Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

import stashpoint

RANK = int(os.environ.get("RANK", "0"))  # 0 where a test imports it


def result(**kw: object) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def scenario_tied_with_an_empty_shard(root: str) -> None:
    """A tensor under two keys (tied weights) whose shard is empty on rank 1 (one row, two ranks)."""
    full = torch.arange(6.0).reshape(1, 6)
    w = distribute_tensor(full.clone(), _mesh(), [Shard(0)])

    def fresh() -> dict[str, torch.Tensor]:
        return {k: distribute_tensor(torch.zeros(1, 6), _mesh(), [Shard(0)]) for k in ("emb", "head")}

    # as a module's state_dict() gives them: a detach() per key, two objects viewing one storage
    stashpoint.save({"emb": w.detach(), "head": w.detach()}, f"{root}/detached")
    state = fresh()
    stashpoint.load(state, f"{root}/detached")
    out = {"detached": all(torch.equal(state[k].full_tensor(), full) for k in state)}
    stashpoint.save({"emb": w, "head": w}, f"{root}/ck")  # one object under both keys
    state = fresh()
    stashpoint.load(state, f"{root}/ck")
    out["loaded"] = all(torch.equal(state[k].full_tensor(), full) for k in state)
    dist.barrier()
    if RANK == 0:
        got = stashpoint.read(f"{root}/ck")
        out["read"] = torch.equal(got["head"], full) and torch.equal(got["emb"], full)
    # the same keys untied in later saves of the process: not the tied saves' layout again
    other = distribute_tensor(torch.full((1, 6), 100.0), _mesh(), [Shard(0)])
    for i in range(2):
        stashpoint.save({"emb": w, "head": other}, f"{root}/untied{i}")
    state = fresh()
    stashpoint.load(state, f"{root}/untied1")
    out["untied"] = [float(state[k].full_tensor()[0, 0]) for k in ("emb", "head")]
    result(**out)


def scenario_fsdp_with_an_empty_parameter(root: str) -> None:
    """FSDP2 keeps a zero-element parameter's shard as (0, 0) where its box is (2, 0)."""
    from torch.distributed.fsdp import fully_shard

    def model() -> torch.nn.Module:
        m = torch.nn.Sequential(torch.nn.Linear(0, 4), torch.nn.Linear(4, 3))
        fully_shard(m, mesh=_mesh())
        return m

    torch.manual_seed(0)
    saved = model()
    stashpoint.save({"model": saved}, f"{root}/ck")
    loaded = model()
    stashpoint.load({"model": loaded}, f"{root}/ck")
    # each rank's own shards (torch's full_tensor() of the empty weight fails in torch itself)
    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(saved.parameters(), loaded.parameters()))
    result(same=same)


def scenario_dtensor_beside_its_own_local_shard(root: str) -> None:
    """A DTensor and its own local shard, under a key of this rank's, in one state."""
    full = torch.arange(48.0).reshape(8, 6)
    w = distribute_tensor(full.clone(), _mesh(), [Shard(0)])
    stashpoint.save({"w": w, f"loc{RANK}": w.to_local()}, f"{root}/ck")
    state = {"w": distribute_tensor(torch.zeros(8, 6), _mesh(), [Shard(0)]), f"loc{RANK}": torch.zeros(4, 6)}
    stashpoint.load(state, f"{root}/ck")
    mine = full[4 * RANK : 4 * RANK + 4]
    result(w=torch.equal(state["w"].full_tensor(), full), local=torch.equal(state[f"loc{RANK}"], mine))


def scenario_load_into_a_partial_dtensor(root: str) -> None:
    """A Partial DTensor as the state's tensor: each rank would take the whole value."""
    a = torch.arange(12.0).reshape(3, 4)
    stashpoint.save({"a": distribute_tensor(a, _mesh(), [Shard(0)])}, f"{root}/ck")
    state = {"a": DTensor.from_local(torch.zeros(3, 4), _mesh(), [Partial()])}
    try:
        stashpoint.load(state, f"{root}/ck")
        result(error=None)
    except stashpoint.CheckpointError as e:
        result(error=type(e).__name__, message=str(e)[:1000], untouched=bool(state["a"].to_local().eq(0).all()))


def stage_model(rank: int | None) -> torch.nn.Module:
    """A four-layer model (seeded), or pipeline stage ``rank`` of it: its two layers under their
    own names, the others left out (as torchtitan's pipeline split does)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4) for _ in range(4)]
    if rank is not None:
        layers = [m if i // 2 == rank else torch.nn.Identity() for i, m in enumerate(layers)]
    return torch.nn.Sequential(*layers)


def scenario_pipeline_stages(root: str) -> None:
    """Each rank saves its own stage: different keys on each rank."""
    stashpoint.save({"model": stage_model(RANK), "step": 7}, f"{root}/ck")
    result(saved=True)


def scenario_sharded_and_whole(root: str) -> None:
    """One state saved sharded over the ranks, and whole by rank 0 alone."""
    from stashpoint._dist.group import LOCAL

    full = torch.arange(24.0).reshape(4, 6)
    stashpoint.save({"w": distribute_tensor(full, _mesh(), [Shard(0)]), "s": torch.tensor(3.0)}, f"{root}/sharded")
    if RANK == 0:
        stashpoint.save({"w": full, "s": torch.tensor(3.0)}, f"{root}/whole", process_group=LOCAL)
    result(saved=True)


def main() -> None:
    scenario, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    Path(root).mkdir(parents=True, exist_ok=True)
    globals()["scenario_" + scenario](root)
    sys.stdout.flush()
    os._exit(0)  # no gloo teardown after DTensor collectives (tests/dist_worker.py says why)


if __name__ == "__main__":
    main()
