"""torchtitan's own trainer and debug model (llama3 "debugmodel"), run on the CPU for
tests/test_torchtitan.py and benchmarks/bench_torchtitan.py.

    python -m torch.distributed.run --nproc_per_node N tests/titan_job.py \\
        --module titan_job --config debug_cpu [torchtitan flags...]

Run it in a directory that holds ``tests/assets/tokenizer`` and ``tests/assets/c4_test`` (see
:func:`write_assets`), as torchtitan's debug config expects. torchtitan 0.3 assumes an
accelerator in a few places; :func:`_cpu` adapts exactly those, and nothing of checkpointing:

- the device type is taken at import time, "cuda" when none is found: made "cpu";
- the memory monitor and ``set_pg_timeouts`` call accelerator functions ``torch.cpu`` lacks;
- ``torch.distributed.set_timeout`` is newer than torch 2.13;
- FSDP2's gradient division becomes ``PREMUL_SUM``, which gloo lacks: a plain sum instead;
- FlexAttention has no backward on the CPU: :func:`debug_cpu` uses SDPA (causal).

With ``TITAN_TIMES=path`` every ``checkpointer.save`` call's duration, each save's time until
durable and every training step's end time are written to ``path.<rank>.json`` at the end (for
the benchmark).
"""

from __future__ import annotations

import json
import os
import random
import time
import types
from pathlib import Path
from typing import Any

import torch


def write_assets(root: Path, docs: int = 300) -> None:
    """A byte-level BPE tokenizer and a small JSON-lines corpus where the debug config looks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "it", "one"]
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 120))) for _ in range(docs)]
    data = root / "tests" / "assets" / "c4_test"
    data.mkdir(parents=True, exist_ok=True)
    (data / "data.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=special))
    out = root / "tests" / "assets" / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": special[0], "eos_token": special[1]}))


def _cpu() -> None:
    import torch._utils
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    torch._utils._get_available_device_type = lambda: "cpu"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fill: dict[str, Any] = {
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: types.SimpleNamespace(total_memory=total),
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
        "memory_stats": lambda *a, **k: {},
    }
    for name, fn in fill.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    torch.cpu.current_device = lambda: 0  # type: ignore[assignment]  # barrier(device_ids=[...]) wants an int
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: c10d._set_pg_timeout(timeout, group)  # type: ignore[attr-defined]

    import torchtitan.distributed.fsdp as tt_fsdp

    divide = tt_fsdp.disable_fsdp_gradient_division

    def plain_sum(model: torch.nn.Module) -> None:
        divide(model)
        for m in model.modules():
            if isinstance(m, tt_fsdp.FSDPModule):
                m.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = plain_sum


def debug_cpu() -> Any:
    """llama3 ``debugmodel`` as torchtitan configures it, with SDPA attention, short sequences
    and no validation, so that it trains on two CPU cores."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    for _fqn, _cfg, parent, attr in config.model_spec.model.traverse(FlexAttention.Config):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    config.training.local_batch_size = 2
    config.training.seq_len = 64
    config.validator.enable = False
    config.activation_checkpoint = None  # recomputation buys nothing at this size
    config.debug.seed = 0
    return config


def _record_times(path: str) -> None:
    import concurrent.futures as cf

    from torchtitan.components.checkpointer import BaseCheckpointManager
    from torchtitan.trainer import Trainer

    saves: list[list[float]] = []  # [step, seconds the call held the loop, 1.0 if the last step]
    durable: list[list[float]] = []  # [step, seconds from the call until the save was durable]
    handles: list[tuple[int, Any]] = []
    steps: list[float] = []
    save, train_step, close = BaseCheckpointManager.save, Trainer.train_step, Trainer.close

    def timed_save(self: Any, curr_step: int, last_step: bool = False) -> bool:
        before = getattr(self, "save_future", None)
        t0 = time.perf_counter()
        did = save(self, curr_step, last_step)
        if not did:
            return did
        saves.append([curr_step, time.perf_counter() - t0, float(last_step)])
        fut = getattr(self, "save_future", None)
        if isinstance(fut, cf.Future) and fut is not before:  # DCP async: written in a thread
            fut.add_done_callback(lambda _f, s=curr_step, t=t0: durable.append([s, time.perf_counter() - t]))
        elif fut is not None and fut is not before and hasattr(fut, "stats"):  # a stashpoint SaveHandle
            handles.append((curr_step, fut))
        else:  # written (and, for DCP, fsynced) before save() returned
            durable.append([curr_step, saves[-1][1]])
        return did

    def timed_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = train_step(self, *args, **kwargs)
        steps.append(time.perf_counter())
        return out

    def closing(self: Any) -> None:
        t0 = time.perf_counter()
        self.checkpointer.maybe_wait_for_saving()
        drain = time.perf_counter() - t0
        close(self)
        for step, handle in handles:
            durable.append([step, handle.wait().total_s])
        rank = int(os.environ.get("RANK", "0"))
        out = {"saves": saves, "durable": sorted(durable), "steps": steps, "drain": drain}
        Path(f"{path}.{rank}.json").write_text(json.dumps(out))

    BaseCheckpointManager.save = timed_save  # type: ignore[method-assign]
    Trainer.train_step = timed_step  # type: ignore[method-assign]
    Trainer.close = closing  # type: ignore[method-assign]


if __name__ == "__main__":
    _cpu()
    if os.environ.get("TITAN_TIMES"):
        _record_times(os.environ["TITAN_TIMES"])
    from torchtitan.train import main

    main()
