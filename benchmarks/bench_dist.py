"""Distributed benchmark on 2 gloo ranks — now a front for the suite (``python -m benchmarks``).

Its measurements (DCP ``save`` / ``async_save`` against ``stashpoint.save`` / ``async_save`` on a
replicated (DDP) and an FSDP2-sharded state, loads after eviction) moved into
``benchmarks/suite/``, which runs them beside every other method. This command keeps its old
options and runs the suite on the same subset, in the hot page-cache regime as before::

    python -m benchmarks.bench_dist --size-gb 1.0 --repeats 3
    # = python -m benchmarks --ranks 2 --layouts ddp fsdp --sizes 1.0 --repeats 3 --regimes hot \\
    #       --methods dcp_save dcp_async_thread stashpoint_save stashpoint_async --no-steps
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

METHODS = ("dcp_save", "dcp_async_thread", "stashpoint_save", "stashpoint_async")


def suite_args(argv: list[str] | None = None) -> list[str]:
    """The ``python -m benchmarks`` arguments equivalent to bench_dist's ``argv``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_dist", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", nargs="+", choices=("ddp", "fsdp"), default=["ddp", "fsdp"])
    ap.add_argument("--out", default="benchmarks/out/dist", help="output directory (a .json path: its stem)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--op-timeout", type=float, default=None)
    ap.add_argument("--markdown", default=None, help="ignored: the suite writes results.md into --out")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out = out.with_suffix("") if out.suffix == ".json" else out
    cmd = ["--ranks", "2", "--layouts", *args.variants, "--sizes", f"{args.size_gb:g}", "--repeats", str(args.repeats)]
    cmd += ["--regimes", "hot", "--methods", *METHODS, "--no-steps", "--out", str(out)]
    for opt in ("dir", "timeout", "op_timeout", "seed"):
        if getattr(args, opt) is not None:
            cmd += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
    return cmd


def main(argv: list[str] | None = None) -> int:
    from benchmarks.suite.cli import main as suite_main

    cmd = suite_args(argv)
    print("bench_dist runs the suite: python -m benchmarks " + " ".join(cmd), file=sys.stderr)
    return suite_main(cmd)


if __name__ == "__main__":
    sys.exit(main())
