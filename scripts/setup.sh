#!/usr/bin/env bash
# Creates .venv (if needed) and installs stashpoint (with its test tools unless EXTRAS="") into it.
# torch==2.13.0 is installed first, explicitly: a bare `torch` requirement in a fresh
# environment can pull a multi-GB CUDA build instead of the CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q "torch==2.13.0"
fi
# EXTRAS: "test" (default) for the test tools; empty for the library alone (the demo).
EXTRAS=${EXTRAS-test}
# the torch installed above, pinned: a resolver that backtracks (a flaky index) must not reach
# for another torch (a fresh clone's run once downloaded an 865 MB CUDA wheel of torch 2.7 here)
TORCH=$(python -c "import torch; print(torch.__version__.split('+')[0])")
python -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}" "torch==$TORCH"
