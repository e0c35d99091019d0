"""What turning live objects into a state tree costs on the save call path: stashpoint's own
adapters against DCP's ``get_state_dict`` (2 FSDP2 ranks, gloo, CPU).

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m benchmarks.bench_state_dict

A GPT-2 from a small config (transformers; 12 blocks of width 256) and 200 FSDP2-sharded
Linear(256, 256) layers, each with AdamW state after one step. For each, rank 0 prints the median
of 7 calls of:

* ``stashpoint``: the tree stashpoint builds in ``async_save`` before staging (modules'
  ``state_dict(keep_vars=True)``, optimizer state re-keyed by parameter name, the buffers' keys);
* ``dcp``: ``get_state_dict(model, optim)`` with its defaults (sharded DTensors, no gather), what
  a DCP ``async_save`` user calls first.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from stashpoint._state.tree import flatten_with_buffers


def _models(mesh):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=12, n_embd=256, n_head=4, vocab_size=4096, n_positions=128, bos_token_id=0, eos_token_id=0)
    gpt = GPT2LMHeadModel(cfg)
    for block in gpt.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(gpt, mesh=mesh)
    layers = [torch.nn.Linear(256, 256) for _ in range(200)]
    mlp = torch.nn.Sequential(*layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(mlp, mesh=mesh)
    return {"gpt2-12x256": (gpt, lambda m: m(input_ids=torch.zeros(1, 8, dtype=torch.long)).logits.sum()),
            "mlp-200": (mlp, lambda m: m(torch.randn(4, 256)).sum())}


def _median_ms(fn, n: int = 7) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    for name, (model, loss) in _models(mesh).items():
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss(model).backward()
        optim.step()
        state = {"model": model, "optim": optim}
        tensors = len(flatten_with_buffers(state)[1])
        ours = _median_ms(lambda s=state: flatten_with_buffers(s))
        dist.barrier()
        theirs = _median_ms(lambda m=model, o=optim: get_state_dict(m, o))
        if dist.get_rank() == 0:
            print(f"{name}: {tensors} tensors per rank; stashpoint tree {ours:.1f} ms, "
                  f"DCP get_state_dict {theirs:.1f} ms ({theirs / ours:.1f}x)", flush=True)
        dist.barrier()
    os._exit(0)  # gloo's teardown at interpreter exit can abort (a torch issue); the figures are out


if __name__ == "__main__":
    main()
