#!/usr/bin/env bash
# The main job end to end on built-in data: set up .venv, then pretrain on real text, convert, and fine-tune
# against random init. It ends with its own wall time, set-up included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python -m convbert_ds.quickstart "$@"
echo "quickstart: $((SECONDS / 60)) min $((SECONDS % 60)) s end to end, set-up included"
