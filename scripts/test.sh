#!/usr/bin/env bash
# Sets up .venv and runs the checks and the default test tier (under 15 minutes on 2 cores).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow` for the long tiers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check src tests benchmarks
mypy
lint-imports  # the package's layers (pyproject.toml, docs/ARCHITECTURE.md)
# Two pytest workers by default (pytest-xdist): most tests wait on processes they start, so two
# workers on two cores take about two thirds of the time of one. STASHPOINT_TEST_WORKERS=0: serial.
python -m pytest -n "${STASHPOINT_TEST_WORKERS:-2}" --dist loadgroup --durations=15 "$@"  # the slowest, to keep the tier short
