"""``python -m benchmarks``: the side-by-side suite (see benchmarks/README.md and suite/cli.py)."""

import sys

from benchmarks.suite.cli import main

if __name__ == "__main__":
    sys.exit(main())
