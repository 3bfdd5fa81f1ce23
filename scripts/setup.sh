#!/usr/bin/env bash
# Creates .venv (once) and installs the pinned requirements into it.
# Idempotent: a second run only checks that everything is installed.
# CUDA users: create .venv yourself, install a CUDA torch 2.13 into it first,
# then run this script with CONVBERT_DS_CUDA=1 (skips the CPU constraint).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
export PATH="$PWD/.venv/bin:$PATH"
stamp=.venv/.installed-$(cat requirements.txt constraints.txt pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  python -m pip install --quiet --upgrade pip
  constraint=(-c constraints.txt)
  [ "${CONVBERT_DS_CUDA:-0}" = 1 ] && constraint=()
  # torch first, alone, so nothing else can choose a different build of it.
  [ "${CONVBERT_DS_CUDA:-0}" = 1 ] || python -m pip install --quiet "${constraint[@]}" torch
  # DeepSpeed compiles its ops just in time; building them at install needs CUDA.
  DS_BUILD_OPS=0 python -m pip install --quiet "${constraint[@]}" -r requirements.txt
  python -m pip install --quiet --no-deps -e .
  rm -f .venv/.installed-*
  touch "$stamp"
fi
