#!/usr/bin/env bash
# The whole test suite: set up .venv, then run pytest (extra arguments go to pytest). It ends with the 25
# slowest tests, so the suite's time is measured at every run, not remembered.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec python -m pytest -q --durations=25 "$@"
