#!/usr/bin/env bash
# Sets up .venv and runs the demo: train, checkpoint in the background, crash, resume exactly.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS= bash scripts/setup.sh
. .venv/bin/activate
exec stashpoint demo "$@"
