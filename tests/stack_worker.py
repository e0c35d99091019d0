"""One cell of the real-training-stack matrix: real model code under a real parallelism on gloo ranks.

    python stack_worker.py PHASE DIR MODEL PAR [--optim adamw|sgd] [--compile] [--ac] [--scaler] [--steps N]

MODEL: ``gpt2`` (tied embeddings), ``llama`` (rotary, RMSNorm, untied head), ``cnn`` (BatchNorm).
PAR: ``single``, ``ddp``, ``fsdp2`` (per block + root), ``hsdp`` (2 x world/2: replicate x shard),
``tp2d`` (world/2 x 2: FSDP2 over dp, colwise/rowwise tensor parallel over tp), ``fsdp1``.

PHASE:
* ``straight``: 2N steps uninterrupted; the losses of steps N+1..2N.
* ``first``: N steps, then the references (DCP's ``get_*_state_dict``, full), ``dcp.save`` of the
  same state into DIR/dcp, ``async_save`` into DIR/ckpt, one more step while it persists, wait;
  rank 0 checks that ``stashpoint.read`` of the checkpoint equals the references.
* ``resume``: fresh processes build the model and a *fresh* optimizer, ``load``, check the gathered
  state against the references, count the bytes each rank read, then train N steps.

Each rank prints ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import stashpoint
from stashpoint._storage import LocalStorage

warnings.filterwarnings("ignore")
torch.use_deterministic_algorithms(True)


class CountingStorage(LocalStorage):
    read_bytes = 0

    def readv(self, name, offset, buffers):
        type(self).read_bytes += sum(len(b) for b in buffers)
        super().readv(name, offset, buffers)


def build_model(name: str) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """The model and its blocks (what FSDP2 and activation checkpointing wrap)."""
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, eos_token_id=0,
                         bos_token_id=0)
        m = GPT2LMHeadModel(cfg)
        return m, list(m.transformer.h)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                          tie_word_embeddings=False, attention_dropout=0.0, eos_token_id=0, bos_token_id=0)
        m = LlamaForCausalLM(cfg)
        return m, list(m.model.layers)
    if name == "cnn":
        blocks = [
            torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()),
            torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()),
        ]
        m = torch.nn.Sequential(*blocks, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(8, 10))
        return m, blocks
    raise SystemExit(f"unknown model {name}")


def dataset(model: str) -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(7)
    if model == "cnn":
        images, labels = torch.randn(256, 3, 8, 8, generator=g), torch.randint(0, 10, (256,), generator=g)
        return torch.utils.data.TensorDataset(images, labels)
    return torch.utils.data.TensorDataset(torch.randint(0, 128, (256, 16), generator=g))


def loss_of(model_name: str, model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    if model_name == "cnn":
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    return model(input_ids=batch[0], labels=batch[0]).loss


def parallelize(
    model: torch.nn.Module, blocks: list[torch.nn.Module], par: str, args
) -> tuple[torch.nn.Module, int, int]:
    """Wrap ``model``; returns (model, data-parallel rank, data-parallel size)."""
    if args.ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        ids = {id(b) for b in blocks}
        apply_activation_checkpointing(model, check_fn=lambda m: id(m) in ids)
        blocks = [m for m in model.modules() if type(m).__name__ == "CheckpointWrapper"]
    if par == "single":
        return model, 0, 1
    rank, world = dist.get_rank(), dist.get_world_size()
    if par == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model), rank, world
    if par == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, use_orig_params=True), rank, world
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if par == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
    elif par == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    elif par == "tp2d":
        mesh2 = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh2["tp"])
        mesh = mesh2["dp"]
        rank, world = mesh.get_local_rank(), mesh.size()
    else:
        raise SystemExit(f"unknown parallelism {par}")
    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, rank, world


def tensor_parallel(model: torch.nn.Module, tp_mesh) -> None:
    """Megatron-style plans on each Llama decoder layer: q/k/v and gate/up colwise, o and down rowwise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, plan)


class Cell:
    def __init__(self, args, par: str) -> None:
        self.args = args
        torch.manual_seed(0 if args.phase != "resume" else 1234)  # a resume must not depend on init
        model, blocks = build_model(args.model)
        self.model, self.dp_rank, self.dp_size = parallelize(model, blocks, par, args)
        if args.compile:
            self.model = torch.compile(self.model, backend="eager")
        params = self.model.parameters()
        if args.optim == "sgd":
            self.optim = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        else:
            self.optim = torch.optim.AdamW(params, lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.optim, step_size=2, gamma=0.8)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6) if args.scaler else None
        data = dataset(args.model)
        self.sampler = stashpoint.StatefulSampler(data, seed=0, rank=self.dp_rank, world_size=self.dp_size)
        self.loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=self.sampler, generator=torch.Generator())
        self.state = {"model": self.model, "optim": self.optim, "sched": self.sched, "rng": stashpoint.RNGState(),
                      "sampler": self.sampler, "step": 0}
        if self.scaler is not None:
            self.state["scaler"] = self.scaler
        self.batches = None

    def step(self) -> float:
        if self.batches is None:
            self.batches = iter(self.loader)
        batch = next(self.batches)
        self.model.train()
        loss = loss_of(self.args.model, self.model, batch)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optim)
            self.scaler.update()
        else:
            loss.backward()
            self.optim.step()
        self.optim.zero_grad()
        self.sched.step()
        self.state["step"] += 1
        return loss.item()

    def full_state(self) -> tuple[dict, dict]:
        """The model and optimizer state, gathered and keyed by FQN, by DCP's own helpers."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=dist.is_initialized())
        inner = getattr(self.model, "_orig_mod", self.model)
        msd = get_model_state_dict(inner, options=opts)
        osd = get_optimizer_state_dict(inner, self.optim, options=opts)
        # copies: the helpers return some live tensors (Adam's step), which later steps change in place
        return clone(msd), clone(osd.get("state", {}))


def clone(tree):
    if isinstance(tree, dict):
        return {k: clone(v) for k, v in tree.items()}
    return tree.detach().clone() if isinstance(tree, torch.Tensor) else tree


def differences(a: dict, b: dict, where: str = "") -> list[str]:
    """Every key or tensor that differs between two nested dicts (tensors compared bitwise)."""
    out = []
    for k in sorted(set(a) | set(b), key=str):
        w = f"{where}/{k}"
        if k not in a or k not in b:
            out.append(f"{w}: only in {'first' if k in a else 'second'}")
        elif isinstance(a[k], dict) and isinstance(b[k], dict):
            out.extend(differences(a[k], b[k], w))
        elif isinstance(a[k], torch.Tensor) and isinstance(b[k], torch.Tensor):
            x, y = a[k].detach().cpu(), b[k].detach().cpu()
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                out.append(f"{w}: {x.dtype}{list(x.shape)} != {y.dtype}{list(y.shape)} or values differ")
        elif a[k] != b[k]:
            out.append(f"{w}: {a[k]!r} != {b[k]!r}")
    return out


def strided_boxes_differ(cell: Cell) -> tuple[int, list[str]]:
    """How many parameters are strided, and those whose box (torch's helper) differs from the
    box of torch's public placement, the fall-back of a torch without the helper."""
    from stashpoint._state import dtensor

    strided, differ = 0, []
    for name, p in cell.model.named_parameters():
        placements = tuple(getattr(p, "placements", ()))
        if any(dtensor.is_strided(x) for x in placements):
            strided += 1
            args = (tuple(p.shape), p.device_mesh, placements)
            if dtensor._strided_box(*args) != dtensor._public_box(*args):
                differ.append(name)
            # a strided layout FSDP2 over TP does not make (rows 0,1,4,5 on one rank), or an uneven one, is refused
            from torch.distributed.tensor import Shard
            from torch.distributed.tensor.placement_types import _StridedShard

            for shape, mesh, odd in (
                ((8,), p.device_mesh["dp"], (_StridedShard(0, split_factor=2),)),
                ((10,), p.device_mesh, (_StridedShard(0, split_factor=2), Shard(0))),  # uneven
            ):
                try:
                    dtensor._public_box(shape, mesh, odd)
                    differ.append(f"{odd} of {shape} was placed")
                except stashpoint.UnsupportedStateError:
                    pass
    return strided, differ


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["straight", "first", "resume"])
    ap.add_argument("dir")
    ap.add_argument("model")
    ap.add_argument("par")
    ap.add_argument("--optim", default="adamw")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--ac", action="store_true")
    ap.add_argument("--scaler", action="store_true")
    ap.add_argument("--dcp", action="store_true", help="first: also dcp.save the same state into DIR/dcp")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if args.par != "single":
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    d = Path(args.dir)
    result: dict = {"rank": rank}
    try:
        cell = Cell(args, args.par)
        n = args.steps
        if args.phase == "straight":
            losses = [cell.step() for _ in range(2 * n)]
            result["losses"] = losses[n:]
        elif args.phase == "first":
            for _ in range(n):
                cell.step()
            msd, ostate = cell.full_state()
            if args.dcp:
                dcp_save(cell, d / "dcp")
            try:
                handle = stashpoint.async_save(cell.state, d / "ckpt", timeout=120)
            except stashpoint.CheckpointError as e:
                result["save_error"] = f"{type(e).__name__}: {e}"
                return
            cell.step()  # training goes on while the save persists
            handle.wait()
            from stashpoint._dist import group as _group

            ctxs = list(_group._contexts().values())
            result["planned"] = "described" if any(c.plans_described for c in ctxs) else "general"
            result["strided"], result["boxes_differ"] = strided_boxes_differ(cell)
            if rank == 0:
                torch.save({"model": msd, "optim": ostate}, d / "ref.pt")
                saved = stashpoint.read(d / "ckpt")
                result["read_vs_dcp_helpers"] = differences(saved["model"], msd, "model") + differences(
                    saved["optim"]["state"], ostate, "optim"
                )
        else:
            stashpoint.load(cell.state, CountingStorage(d / "ckpt"), timeout=120)
            result["read_bytes"] = CountingStorage.read_bytes
            p0 = next(iter(cell.optim.param_groups[0]["params"]))
            st = cell.optim.state.get(p0, {})
            result["state_types"] = sorted({type(v).__name__ for v in st.values()})
            result["param_type"] = type(p0).__name__
            msd, ostate = cell.full_state()
            if rank == 0:
                ref = torch.load(d / "ref.pt", weights_only=True)
                result["vs_ref"] = differences(msd, ref["model"], "model") + differences(ostate, ref["optim"], "optim")
            result["losses"] = [cell.step() for _ in range(n)]
    except BaseException:
        import traceback

        result["error"] = traceback.format_exc()[-4000:]
    finally:
        print("RESULT " + json.dumps(result), flush=True)
        sys.stdout.flush()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        os._exit(1 if "error" in result else 0)  # gloo's teardown at interpreter exit can abort (a torch issue)


def dcp_save(cell: Cell, where: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    inner = getattr(cell.model, "_orig_mod", cell.model)
    state = {"model": get_model_state_dict(inner), "optim": get_optimizer_state_dict(inner, cell.optim)}
    # rank 0's copy of what ranks hold under one key, as stashpoint saves module buffers (ranks'
    # BatchNorm statistics differ); DCP's default spreads those writes over the ranks
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    dcp.save(state, checkpoint_id=str(where), planner=planner)


if __name__ == "__main__":
    main()
