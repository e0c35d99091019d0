"""The ``stashpoint`` command line (also ``python -m stashpoint``)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ._version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="stashpoint")
def main() -> None:
    """stashpoint: checkpointing for PyTorch training that barely stops it."""


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
    from ._demo import DemoError, run_demo  # imports torch: only when the command runs

    try:
        code = run_demo(directory, seconds=seconds, every=every, quick=quick, echo=click.echo)
    except (DemoError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    sys.exit(code)
