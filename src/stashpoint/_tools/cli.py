"""The ``stashpoint`` command line (also ``python -m stashpoint``)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import click

from stashpoint._tools.clibench import bench_command
from stashpoint._tools.output import PATH_ARG, age, echo, echo_json, esc, fails_cleanly, json_option, short, table
from stashpoint._version import __version__

CLI_S3_RETRY_SECONDS = 10


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="stashpoint")
def main() -> None:
    """stashpoint: checkpointing for PyTorch training that barely stops it."""
    # an interactive command gives up on an unreachable object store after seconds, not the
    # minute and a half a training job rides out (STASHPOINT_S3_RETRY_SECONDS overrides both)
    os.environ.setdefault("STASHPOINT_S3_RETRY_SECONDS", str(CLI_S3_RETRY_SECONDS))


@main.command(short_help="Checkpoint a small training run asynchronously, kill it, resume it exactly.")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default="./stashpoint-demo",
    show_default=True,
    help="Where the checkpoints and logs go. Cleared first if it holds an earlier demo; any other "
    "non-empty directory is refused.",
)
@click.option(
    "--seconds",
    type=click.FloatRange(min=10),
    default=60.0,
    show_default=True,
    help="About how long the whole demo should take; it sets the checkpoint interval (not used with --every "
    "or --quick).",
)
@click.option(
    "--every",
    type=click.IntRange(min=2),
    metavar="K",
    default=None,
    help="Save every K steps (default: chosen from --seconds; 5 with --quick).",
)
@click.option("--quick", is_flag=True, help="A tiny model and a few seconds of training (for tests).")
def demo(directory: Path, seconds: float, every: int | None, quick: bool) -> None:
    """Train a small transformer on the CPU with asynchronous checkpoints, kill it, resume it.

    A training process saves with stashpoint.async_save every K steps and shows how long each
    save blocked training beside how long a plain torch.save + fsync of the same state takes.
    It is then killed with SIGKILL; a new process resumes from the newest committed checkpoint,
    and the losses of the steps both processes ran are compared bit for bit. The exit code is 0
    when they are identical.
    """
    from stashpoint._tools.demo import DemoError, run_demo  # imports torch: only when the command runs

    try:
        code = run_demo(directory, seconds=seconds, every=every, quick=quick, echo=click.echo)
    except (DemoError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        echo("interrupted", err=True)
        sys.exit(130)
    sys.exit(code)


# ---------------------------------------------------------------------------------------------
# Tools: ls, inspect, verify, diff, export, import. The logic is in inspect, diff and convert;
# these commands print. A path that is not what the command needs: one line on stderr, exit code 2.


@main.command("ls", short_help="List a run directory's checkpoints: status, size, age, metrics.")
@click.argument("root", type=PATH_ARG)
@json_option
@fails_cleanly
def ls_command(*, root: str, as_json: bool) -> None:
    """List the step directories of a run directory: committed or partial, size, age, metrics."""
    from stashpoint._core.units import human_bytes
    from stashpoint._tools.inspect import list_steps

    steps = list_steps(root)
    if as_json:
        echo_json([dataclasses.asdict(s) for s in steps])
        return
    if not steps:
        echo(f"no step directories (step-XXXXXXXX) in {root}")
        return
    rows = []
    for s in steps:
        metrics = " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in s.metrics.items())
        rows.append((s.step, s.status, human_bytes(s.size), age(s.age_s), metrics or s.error or ""))
    echo(table(("STEP", "STATUS", "SIZE", "AGE", "METRICS"), rows))


@main.command("inspect", short_help="Show a checkpoint's tensors, values, metadata and files.")
@click.argument("path", type=PATH_ARG)
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True, help="Whose plain values to show.")
@json_option
@fails_cleanly
def inspect_command(*, path: str, rank: int, as_json: bool) -> None:
    """Show a checkpoint: its tensors, plain values, metadata and files.

    Pickled values are shown as "<pickled, not loaded>": nothing is unpickled.
    """
    from stashpoint._core.units import human_bytes
    from stashpoint._tools.inspect import describe

    d = describe(path, rank)
    if as_json:
        echo_json(d)
        return
    echo(esc(f"checkpoint  {d['path']}"))
    echo(  # the file's strings escaped: a newline in them must not forge a line of this report
        f"format      stashpoint v{d['format_version']} (save {d['save_id']}, stashpoint "
        f"{esc(d['library_version'])}, torch {esc(d['torch_version'])})"
    )
    echo(f"created     {esc(d['created'])}")
    if d["ranks_elsewhere"]:
        here = d["world_size"] - len(d["ranks_elsewhere"])
        echo(
            f"this directory holds the files of {here} of its {d['world_size']} ranks (one node's directory of a "
            "node-local run): tensors and chunks below are this node's part"
        )
    if d["recoverable_without_storage"]:
        r = d["recoverable_without_storage"]
        echo(f"recoverable without storage: each of {r['nodes']} nodes' files copied to {r['replicas']} other node(s)")
        if "own_bytes" in r and "replica_bytes" in r:
            echo(
                f"            this node holds {human_bytes(r['own_bytes'])} of its own files and "
                f"{human_bytes(r['replica_bytes'])} of other nodes' (room needed at the peak of a save: "
                "keep_last + 1 steps of the first, two of the second)"
            )
    echo(
        f"world size  {d['world_size']}"
        + (f" ({d['distinct_rank_trees']} distinct per-rank value sets)" if d["distinct_rank_trees"] > 1 else "")
    )
    echo(f"\ntensors: {len(d['tensors'])}, {human_bytes(d['total_bytes'])}")
    rows = [
        (t["key"], t["dtype"], t["shape"], t["sharding"], human_bytes(t["bytes"]) if t["bytes"] else "-")
        for t in d["tensors"]
    ]
    echo(table(("KEY", "DTYPE", "SHAPE", "SHARDING", "BYTES"), rows))
    who = f" (rank {d['rank']})" if d["world_size"] > 1 else ""
    echo(f"\nvalues{who}: {len(d['values'])}")
    for k, v in d["values"].items():
        echo(f"  {esc(k)} = {esc(short(v))}")
    echo(f"\nmetadata: {len(d['metadata'])}")
    for k, v in d["metadata"].items():
        echo(f"  {esc(k)} = {esc(str(v))}")
    echo(f"\nfiles: {len(d['files'])}")
    echo(table(("NAME", "RANK", "SIZE"), [(f["name"], f["rank"], human_bytes(f["size"])) for f in d["files"]]))


@main.command("verify", short_help="Check every byte of a checkpoint; exit 1 on any problem.")
@click.argument("path", type=PATH_ARG)
@click.option("-q", "--quiet", is_flag=True, help="Print the problems and the verdict only, not the progress.")
@click.option(
    "--this-node", is_flag=True, help="PATH is one node's directory of a node_local run: check the ranks held here."
)
@json_option
@fails_cleanly
def verify_command(*, path: str, quiet: bool, this_node: bool, as_json: bool) -> None:
    """Check every byte of a checkpoint against its checksums and its manifest.

    PATH may also be a run directory (a CheckpointManager's root): every committed step is
    checked; partial steps and names the manager did not write are listed as warnings. With
    --this-node, PATH (a step or a run directory) is one node's directory of a node_local run:
    the ranks whose files it holds are checked, the others are named as held by other nodes.

    Exit code 0 if it is intact, 1 if any problem is found (all are printed), 2 if PATH is not
    a checkpoint.
    """
    from stashpoint._core.units import human_bytes
    from stashpoint._tools.checking import verify
    from stashpoint._tools.progress import Reporter

    if quiet or as_json:
        rep = verify(path, this_node=this_node)
    else:
        with Reporter("verifying") as progress:
            rep = verify(path, progress=progress, this_node=this_node)
    if as_json:
        echo_json({**dataclasses.asdict(rep), "ok": rep.ok})
    else:
        for w in rep.warnings:  # one line each: a file's name may hold a newline and forge the next line
            echo(esc(f"warning: {w}"))
        for p in rep.problems:
            echo(esc(f"problem: {p}"))
        if rep.ok:
            steps = "" if rep.steps is None else f"{rep.steps} committed step(s), "
            data = human_bytes(rep.bytes_checked)
            echo(f"OK: {steps}{rep.files} file(s), {rep.tensors} tensor(s), {data} of tensor data verified")
        else:
            echo(f"FAILED: {len(rep.problems)} problem(s) in {rep.path}")
    sys.exit(0 if rep.ok else 1)


@main.command("diff", short_help="Show which tensors and values differ between two checkpoints.")
@click.argument("a", type=PATH_ARG)
@click.argument("b", type=PATH_ARG)
@click.option(
    "--verify",
    "check",
    is_flag=True,
    help="First check every file of both against its checksums (reads all their bytes); exit code 2 if "
    "either is damaged.",
)
@json_option
@fails_cleanly
def diff_command(*, a: str, b: str, check: bool, as_json: bool) -> None:
    """Show which tensors and values differ between checkpoints A and B.

    For tensors of the same shape the maximum absolute difference is shown. Tensors whose
    chunks both manifests record with the same checksums are equal without being read: a
    damaged copy of a checkpoint compares identical to it unless --verify checks the files
    first. Exit code 0 if identical, 1 if they differ, 2 on an error.
    """
    from stashpoint._tools.diff import diff
    from stashpoint._tools.inspect import jsonable

    if check:
        from stashpoint._load.manifest import open_checkpoint
        from stashpoint._tools.checking import verify
        from stashpoint.errors import CorruptCheckpointError

        for path in (a, b):  # both checkpoints (not run directories, say) before either is read whole
            open_checkpoint(path)
        for path in (a, b):
            found = verify(path)
            if not found.ok:
                raise CorruptCheckpointError(
                    f"{path} is damaged ({len(found.problems)} problem(s); `stashpoint verify {path}` lists them): "
                    + found.problems[0]
                )
    rep = diff(a, b)
    if as_json:
        doc = dataclasses.asdict(rep)
        doc["plain"] = [{"key": k, "a": jsonable(x), "b": jsonable(y)} for k, x, y in rep.plain]
        echo_json({**doc, "identical": rep.identical})
    else:
        for k in rep.only_a:
            echo(f"only in A: {esc(k)}")
        for k in rep.only_b:
            echo(f"only in B: {esc(k)}")
        for k, (x, y) in rep.dtype.items():
            echo(f"dtype:     {esc(k)}: {x} -> {y}")
        for k, (sx, sy) in rep.shape.items():
            echo(f"shape:     {esc(k)}: {sx} -> {sy}")
        for k, d in rep.values.items():
            echo(f"data:      {esc(k)}: " + ("bytes differ" if d is None else f"max |a-b| = {d:.6g}"))
        for k, x, y in rep.plain:
            echo(f"value:     {esc(k)}: {esc(short(x, 40))} -> {esc(short(y, 40))}")
        n = len(rep.only_a) + len(rep.only_b) + len(set(rep.dtype) | set(rep.shape) | set(rep.values))
        if rep.identical:
            by_sum = rep.by_checksum if not check else 0
            how = (
                ""
                if not by_sum
                else " (by the checksums recorded; --verify checks the files)"
                if by_sum == rep.compared
                else f" ({by_sum} by the checksums recorded, {rep.compared - by_sum} by their data; --verify checks "
                "the files)"
            )
            echo(f"{rep.compared} tensor(s) compared{how}: identical")
        else:
            by_data = rep.compared - (0 if check else rep.by_checksum)
            echo(f"{n} tensor(s) and {len(rep.plain)} plain value(s) differ ({rep.compared} tensor(s) of the same "
                 f"shape in both compared, {by_data} by their data)")  # fmt: skip
    sys.exit(0 if rep.identical else 1)


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from stashpoint._tools.convert import parse_size

    try:
        return None if value is None else parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@main.command("export", short_help="Consolidate a checkpoint into safetensors (Hugging Face layout).")
@click.argument("path", type=PATH_ARG)
@click.argument("out", type=PATH_ARG)
@click.option("--select", default="", metavar="PREFIX", help='Export only the key paths under PREFIX, e.g. "model".')
@click.option(
    "--max-shard-size",
    callback=_size,
    metavar="SIZE",
    help="Split into Hugging Face-style shards of at most SIZE (e.g. 5GB, 500MiB). Default: none for a "
    ".safetensors OUT, 5GB for a directory.",
)
@click.option(
    "--tied",
    type=click.Choice(["drop", "clone"]),
    default="drop",
    show_default=True,
    help="Tied tensors: leave out the aliases (as transformers' save_pretrained does) or write copies.",
)
@click.option("--overwrite", is_flag=True, help="Replace an earlier export at OUT.")
@fails_cleanly
def export_command(*, path: str, out: str, select: str, max_shard_size: int | None, tied: str, overwrite: bool) -> None:
    """Consolidate a checkpoint (any world size and sharding) into safetensors.

    OUT ending in .safetensors is one file; any other OUT is a directory that gets
    model.safetensors, or model-0000i-of-0000N.safetensors and model.safetensors.index.json
    when it exceeds --max-shard-size. Tensor names are the key paths below --select with "/"
    replaced by ".": with --select model, "model/encoder.layers.0.weight" becomes
    "encoder.layers.0.weight". The tensors of each output file are held in memory while it is
    written.
    """
    from stashpoint._core.units import human_bytes
    from stashpoint._tools.convert import export
    from stashpoint._tools.progress import Reporter

    with Reporter("exporting") as progress:
        res = export(
            path, out, select=select, max_shard_size=max_shard_size, tied=tied, overwrite=overwrite, progress=progress
        )
    for name, target in res.dropped.items():
        echo(f"left out {name}: tied to {target} (pass --tied clone to write a copy)")
    where = res.index or res.files[0]
    echo(f"exported {res.tensors} tensor(s), {human_bytes(res.total_size)}, to {where}")


@main.command("import", short_help="Convert a torch.save file or a DCP checkpoint to stashpoint.")
@click.argument("src", type=PATH_ARG)
@click.argument("path", type=PATH_ARG)
@click.option("--overwrite", is_flag=True, help="Replace a committed checkpoint at PATH.")
@click.option(
    "--strip-prefix",
    multiple=True,
    metavar="PREFIX",
    help="Take PREFIX off every dict key starting with it (repeatable): 'module.' of DDP, '_orig_mod.' of "
    "torch.compile, so that a wrapped module's state dict loads into the module.",
)
@fails_cleanly
def import_command(*, src: Path, path: str, overwrite: bool, strip_prefix: tuple[str, ...]) -> None:
    """Convert a torch.save file or a DCP checkpoint directory into a stashpoint checkpoint.

    A torch.save file is read with torch.load(weights_only=True); a DCP checkpoint's pickled
    .metadata with an unpickler that knows only DCP's records, and its values with
    weights_only=True. Nothing in either can run code; anything else is refused.
    """
    from stashpoint._core.units import human_bytes
    from stashpoint._tools.convert import import_checkpoint

    before = _save_id(path)  # --overwrite: the old checkpoint's manifest stays until the new one commits
    try:
        res = import_checkpoint(src, path, overwrite=overwrite, strip_prefix=strip_prefix)
    except KeyboardInterrupt:
        done = _save_id(path) not in (None, before)
        raise KeyboardInterrupt(
            f"{path} was committed before it stopped" if done else f"nothing was committed at {path}"
        ) from None
    echo(f"imported {res.kind} {src}: {res.tensors} tensor(s), {human_bytes(res.bytes)}, to {res.path}")


def _save_id(path: str) -> str | None:
    """The save id of the checkpoint committed at ``path``, None where none is (or it is unreadable)."""
    from stashpoint._load.manifest import read_summary
    from stashpoint._storage import storage_for
    from stashpoint.errors import CheckpointError

    try:
        return str(read_summary(storage_for(path))["save_id"])
    except (CheckpointError, OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# bench: the side-by-side benchmark suite of a source checkout (benchmarks/ is not in the wheel).


main.add_command(bench_command)
