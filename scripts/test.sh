#!/usr/bin/env bash
# The whole test suite: set up .venv, then run pytest on every core (pytest-xdist: one worker per core, at
# most 8, each taking a whole test file, so a file's fixtures are made once; the files with the most slow
# tests go first, see tests/conftest.py). Extra arguments go to pytest (-n 0: one process). It ends with
# the 25 slowest tests, so the suite's time is measured at every run, not remembered.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec python -m pytest -q -n auto --maxprocesses 8 --dist loadfile --no-loadscope-reorder --durations=25 "$@"
