#!/usr/bin/env bash
# The main job end to end on built-in data: set up .venv, then pretrain on real text.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec python -m convbert_ds.quickstart "$@"
