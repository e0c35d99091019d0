"""What the suite measures: one :class:`Method` record per save method, and whether it can run here.

A method that cannot run is never dropped silently: :func:`availability` says why (``not
installed`` with the pip command, ``not applicable`` with the reason, ``not available`` when this
checkout lacks the feature), and the reports show it in place of its figures.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass

NOT_INSTALLED = "not installed"
NOT_APPLICABLE = "not applicable"
NOT_AVAILABLE = "not available"
FAILED = "failed"
OK = "ok"


@dataclass(frozen=True)
class Method:
    """One save method (with the load of its checkpoints), or a reference measurement."""

    name: str  # the --methods name
    label: str  # as shown in tables and plots
    family: str  # torch, dcp, stashpoint, torchsnapshot, torch-checkpointing, accelerate, reference
    kind: str  # "sync", "async" or "reference"
    load: str | None = None  # label of the load measured on this method's checkpoints
    fsyncs: bool = True  # the library makes its files durable itself (else the harness fsyncs them)
    module: str | None = None  # the module it imports (to tell "not installed")
    pip: str | None = None  # what to install when it is missing
    worlds: tuple[int, ...] = (1, 2)
    needs_pg: bool = False  # needs torch.distributed initialized even on one process
    note: str = ""  # one line for the reports: configuration and caveats


_DCP = "torch.distributed.checkpoint"
_MS: tuple[Method, ...] = (
    Method(
        "io_floor",
        "bare direct-I/O write of the same bytes (I/O floor)",
        "reference",
        "reference",
        note="training loop only: no checkpoint, a thread writes this rank's share of the state's bytes with "
        "O_DIRECT from one reused 64 MiB buffer and fsyncs (no copy, checksum or Python work per tensor): what "
        "writing those bytes costs the loop on this machine, whoever writes them",
    ),
    Method(
        "torch_save",
        "torch.save + fsync",
        "torch",
        "sync",
        load="torch.load(mmap=True) + copy_",
        note="one file per process (DDP: rank 0 writes); fsync of the file",
    ),
    Method(
        "dcp_save",
        "dcp.save",
        "dcp",
        "sync",
        load="dcp.load + set_state_dict",
        note="FileSystemWriter defaults; fsyncs its files, not the directory",
    ),
    Method(
        "dcp_async_thread",
        "DCP async_save (thread)",
        "dcp",
        "async",
        note="defaults: thread executor, a fresh unpinned stager per call",
    ),
    Method(
        "dcp_async_process",
        "DCP async_save (process)",
        "dcp",
        "async",
        needs_pg=True,
        note="AsyncCheckpointerType.PROCESS, default stager (the staged copy is sent to the writer process)",
    ),
    Method(
        "dcp_async_stager",
        "DCP async_save (thread, reused stager)",
        "dcp",
        "async",
        note="one DefaultStager(StagingOptions(False, False, False, False)) reused: cached host buffers",
    ),
    Method(
        "dcp_async_async_staging",
        "DCP async_save (thread, async staging)",
        "dcp",
        "async",
        note="reused DefaultStager with use_async_staging=True: staging_completion awaited before each optimizer step",
    ),
    Method(
        "dcp_async_process_shm",
        "DCP async_save (process, shared-memory stager)",
        "dcp",
        "async",
        needs_pg=True,
        note="process executor + reused DefaultStager(use_shared_memory=True)",
    ),
    Method(
        "dcp_async_pinned",
        "DCP async_save (pinned stager)",
        "dcp",
        "async",
        note="DefaultStager(use_pinned_memory=True, use_non_blocking_copy=True): CUDA only",
    ),
    Method(
        "torchsnapshot_take",
        "torchsnapshot Snapshot.take",
        "torchsnapshot",
        "sync",
        load="torchsnapshot Snapshot.restore",
        fsyncs=False,
        module="torchsnapshot",
        pip="torchsnapshot",
        note="never fsyncs: the harness fsyncs its files once it returns",
    ),
    Method(
        "torchsnapshot_async",
        "torchsnapshot Snapshot.async_take",
        "torchsnapshot",
        "async",
        fsyncs=False,
        module="torchsnapshot",
        pip="torchsnapshot",
        note="never fsyncs: the harness fsyncs its files once done",
    ),
    Method(
        "torch_checkpointing",
        "torch-checkpointing CheckpointManager (async)",
        "torch-checkpointing",
        "async",
        load="torch-checkpointing load + set_state_dict",
        fsyncs=False,
        module="torch_checkpointing",
        pip="torch-checkpointing",
        note="writer process, async staging (optimizer steps under manager.lock()); CPU settings: no pinned "
        "memory, buffered writes (its O_DIRECT writer fails with EINVAL on ext4); never fsyncs",
    ),
    Method(
        "accelerate",
        "Accelerate save_state",
        "accelerate",
        "sync",
        load="Accelerate load_state",
        fsyncs=False,
        module="accelerate",
        pip="accelerate",
        worlds=(1,),
        note="Accelerator(cpu=True), model and optimizer prepared; never fsyncs",
    ),
    Method(
        "stashpoint_save",
        "stashpoint.save",
        "stashpoint",
        "sync",
        load="stashpoint.load",
        note="fsyncs files and directory, commits atomically",
    ),
    Method(
        "stashpoint_atomic",
        "stashpoint.save, load(atomic=True)",
        "stashpoint",
        "sync",
        load="stashpoint.load(atomic=True)",
        note="the same save; the load reads and verifies everything before the state changes",
    ),
    Method("stashpoint_async", "stashpoint.async_save (thread writer)", "stashpoint", "async"),
    Method(
        "stashpoint_process",
        "stashpoint.async_save (process writer)",
        "stashpoint",
        "async",
        note='async_save(..., writer="process")',
    ),
    Method(
        "stashpoint_overlap",
        "stashpoint.async_save(overlap=True)",
        "stashpoint",
        "async",
        note="optimizer tensors copied in the background until the next step()",
    ),
)
METHODS: dict[str, Method] = {m.name: m for m in _MS}
SAVE_METHODS = tuple(METHODS)
DEFAULT_METHODS = SAVE_METHODS
# Groups usable in --methods besides single names.
GROUPS: dict[str, tuple[str, ...]] = {
    "all": SAVE_METHODS,
    "dcp": tuple(m.name for m in _MS if m.family == "dcp"),
    "stashpoint": tuple(m.name for m in _MS if m.family == "stashpoint"),
    "peers": tuple(m.name for m in _MS if m.family in ("torchsnapshot", "torch-checkpointing", "accelerate")),
    "core": ("torch_save", "dcp_save", "dcp_async_thread", "stashpoint_save", "stashpoint_async", "stashpoint_overlap"),
}


def expand(names: list[str]) -> list[str]:
    """Method names (in registry order) from names and group names; ValueError names an unknown one."""
    wanted: set[str] = set()
    for n in names:
        if n in GROUPS:
            wanted.update(GROUPS[n])
        elif n in METHODS:
            wanted.add(n)
        else:
            raise ValueError(f"unknown method {n!r}; methods: {', '.join(SAVE_METHODS)}; groups: {', '.join(GROUPS)}")
    return [m for m in SAVE_METHODS if m in wanted]


def has_process_writer() -> bool:
    """Whether this checkout's ``stashpoint.async_save`` takes ``writer=`` (the process writer)."""
    import stashpoint

    return "writer" in inspect.signature(stashpoint.async_save).parameters


def availability(m: Method, world: int, layout: str, *, no_steps: bool = False) -> tuple[str, str] | None:
    """None if ``m`` can run on ``world`` ranks with ``layout``; else (status, reason)."""
    if m.kind == "reference" and no_steps:
        return NOT_APPLICABLE, "measured in the training loop only (--no-steps was given)"
    if world not in m.worlds:  # before the install check: installing it would not make it apply
        return NOT_APPLICABLE, f"measured on {' or '.join(map(str, m.worlds))} process(es) only"
    if m.module is not None and importlib.util.find_spec(m.module) is None:
        return NOT_INSTALLED, f"not installed (pip install {m.pip}, or pip install -e '.[bench]')"
    if m.name == "dcp_async_pinned":
        import torch

        if not torch.cuda.is_available():
            return NOT_APPLICABLE, (
                "needs CUDA: without it DCP's StateDictStager ignores use_pinned_memory (with a warning) and "
                "use_non_blocking_copy=True raises, so on this CPU machine it equals the unpinned stager rows"
            )
    if m.name == "stashpoint_process" and not has_process_writer():
        return NOT_AVAILABLE, (
            "not available in this run: stashpoint.async_save has no writer= parameter in this checkout "
            "(the persistent writer process is not merged yet)"
        )
    return None
