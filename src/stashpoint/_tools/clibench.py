"""``stashpoint bench``: the side-by-side benchmark suite of a source checkout."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import click

from stashpoint._tools.output import echo

_BENCH_MISSING = (
    "the benchmark suite is not installed with the stashpoint package: it is the benchmarks/ directory of "
    "stashpoint's source repository. Get a source checkout, install it there with `pip install -e '.[bench]'` "
    "(the peers it compares with and matplotlib), and run `stashpoint bench` (or `python -m benchmarks`) from it."
)


def bench_suite_root(candidates: Sequence[Path]) -> Path | None:
    """The first of ``candidates`` that holds the suite (``benchmarks/suite/cli.py``), or None."""
    for root in candidates:
        if (root / "benchmarks" / "suite" / "cli.py").is_file():
            return root.resolve()
    return None


def _bench_candidates() -> list[Path]:
    """The source checkout this package was installed from (editable), then the current directory."""
    return [Path(__file__).resolve().parents[3], Path.cwd()]


@click.command(
    "bench",
    short_help="Run the side-by-side benchmark suite (from a source checkout).",
    add_help_option=False,
    options_metavar="",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.argument("options", nargs=-1, type=click.UNPROCESSED, metavar="[OPTIONS]")
@click.pass_context
def bench_command(ctx: click.Context, options: tuple[str, ...]) -> None:
    """Run the side-by-side benchmark suite: stashpoint against torch.save, DCP (sync and every
    async configuration), torchsnapshot, torch-checkpointing and Accelerate on the same states.

    The OPTIONS go to `python -m benchmarks` as they are:

    \b
      --sizes GB...          state sizes in GB (default 0.5 2 4)
      --ranks N...           1 and/or 2 processes (default 1 2)
      --layouts fsdp|ddp...  how 2 ranks hold the state (default both)
      --methods NAME...      methods or groups all, core, dcp, stashpoint, peers (default all)
      --regimes cold|hot...  page-cache regimes of the saves (default cold hot)
      --repeats N            measured saves and loads per method (default 2)
      --quick                tiny states, one repeat: a smoke test of a few minutes
      --out DIR              results.json, results.md and PNG plots (default benchmarks/out/suite)
      --dir DIR              scratch directory base (default /var/tmp)
      --every K, --checkpoints N, --baseline N, --step-ms MS
                             the training-loop experiment (checkpoint every K steps)
      --no-loads, --no-steps skip the loads or the training loop
      --list                 list the methods and whether each can run here

    The suite lives in the benchmarks/ directory of a source checkout (found next to an editable
    install, or in the current directory); see benchmarks/README.md there. Exit code: the suite's
    (0 unless a stashpoint method or a reference measurement failed).
    """
    import subprocess

    if any(o in ("-h", "--help") for o in options):
        echo(ctx.get_help())
        return
    root = bench_suite_root(_bench_candidates())
    if root is None:
        raise click.ClickException(_BENCH_MISSING)
    # The checkout first on sys.path (not whatever "benchmarks" the current directory holds); relative
    # paths in OPTIONS stay relative to the current directory.
    code = f"import sys; sys.path.insert(0, {str(root)!r}); from benchmarks.suite.cli import main; sys.exit(main())"
    sys.exit(subprocess.call([sys.executable, "-c", code, *options]))
