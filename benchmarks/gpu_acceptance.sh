#!/usr/bin/env bash
# The GPU acceptance in one command (kept for the commands that name this file): see
# benchmarks/gpu_acceptance.py for what it runs and where it writes.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m benchmarks.gpu_acceptance "$@"
