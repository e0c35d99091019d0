"""Core benchmark on one process — now a front for the suite (``python -m benchmarks``).

The measurements of this script (``torch.save`` + fsync, ``dcp.save``, DCP ``async_save``,
``stashpoint.save`` / ``async_save`` / ``async_save(overlap=True)``, loads after eviction, the
copy floor) moved into ``benchmarks/suite/``, which runs them beside every other method. This
command keeps its old options and runs the suite on the same subset::

    python -m benchmarks.bench_core --size-gb 2.5 --repeats 3 --regime cold
    # = python -m benchmarks --ranks 1 --sizes 2.5 --repeats 3 --regimes cold --methods core --no-steps

The state helpers stay importable from here (``build_state``, ``choose_shape``, ...).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.suite.common import GB, default_scratch_base, evict_cache, git_commit, remove, tree_bytes
from benchmarks.suite.state import (
    Shape,
    build_state,
    choose_shape,
    fingerprint,
    live_tensors,
    same_fingerprint,
    scramble,
)

__all__ = [
    "GB",
    "Shape",
    "build_state",
    "choose_shape",
    "default_scratch_base",
    "evict_cache",
    "fingerprint",
    "git_commit",
    "live_tensors",
    "main",
    "remove",
    "same_fingerprint",
    "scramble",
    "tree_bytes",
]

# bench_core's method names -> the suite's
_METHODS = {
    "torch_save": "torch_save",
    "dcp_save": "dcp_save",
    "dcp_async": "dcp_async_thread",
    "stashpoint_save": "stashpoint_save",
    "stashpoint_async": "stashpoint_async",
    "stashpoint_overlap": "stashpoint_overlap",
}


def suite_args(argv: list[str] | None = None) -> list[str]:
    """The ``python -m benchmarks`` arguments equivalent to bench_core's ``argv``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_core", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--size-gb", type=float, default=2.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--regime", choices=("hot", "cold"), default="cold")
    ap.add_argument("--methods", nargs="+", choices=[*_METHODS, "memcpy_floor"], default=list(_METHODS))
    ap.add_argument("--out", default="benchmarks/out/core", help="output directory (a .json path: its stem)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--op-timeout", type=float, default=None)
    ap.add_argument("--load-cache", choices=("evicted",), default="evicted", help="loads always evict first now")
    ap.add_argument("--markdown", default=None, help="ignored: the suite writes results.md into --out")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out = out.with_suffix("") if out.suffix == ".json" else out
    methods = [_METHODS[m] for m in args.methods if m in _METHODS]
    cmd = ["--ranks", "1", "--sizes", f"{args.size_gb:g}", "--repeats", str(args.repeats)]
    cmd += ["--regimes", args.regime, "--methods", *methods, "--no-steps", "--out", str(out)]
    for opt in ("dir", "timeout", "op_timeout", "seed"):
        if getattr(args, opt) is not None:
            cmd += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
    return cmd


def main(argv: list[str] | None = None) -> int:
    from benchmarks.suite.cli import main as suite_main

    cmd = suite_args(argv)
    print("bench_core runs the suite: python -m benchmarks " + " ".join(cmd), file=sys.stderr)
    return suite_main(cmd)


if __name__ == "__main__":
    sys.exit(main())
