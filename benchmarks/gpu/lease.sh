#!/usr/bin/env bash
# A GPU lease in one command, on a fresh H100/H200, from the repository root, the wheelhouse carried beside the
# tree as .wheels/ (with its install-on-gpu.sh):   bash benchmarks/gpu/lease.sh
# A lease is minutes of a machine with no package registry: install, run the queued A/B rows of the GPU
# acceptance (benchmarks/gpu/acceptance.py), keep the record and the logs where the lease hands files back.
# LEASE_CPU_SMOKE=1: the same path on a CPU at toy sizes (one tiny row), for the test suite.
set -euo pipefail
cd "$(dirname "$0")/../.."

# The queued rows, all at base 128 x 256: the paper path in bf16 and its fp16 twin (both labels end in
# "step, capture"), and the paper path with tuned matmuls. All three compile at once (minutes each, on the
# host); each then times its steps alone.
ROWS='^base \| 128 x 256 .*step, capture$|^base \| 128 x 256 .*tuned matmuls'
TOGETHER=3
BUDGET_S=450  # 9 minutes of a lease: about 60 s of install and start-up, then this

if [ -f .wheels/install-on-gpu.sh ]; then
  bash .wheels/install-on-gpu.sh .wheels
elif python3 -c "import deepspeed" 2>/dev/null; then
  echo "lease: no .wheels/install-on-gpu.sh, and deepspeed already imports: nothing to install"
else
  echo "lease: no .wheels/install-on-gpu.sh, and deepspeed does not import: carry the wheelhouse as .wheels/" >&2
  exit 1
fi

# A remote machine hands back only what is under $OUT: the record and the logs go there when it is set.
if [ -n "${OUT:-}" ]; then
  record="$OUT"
  logs="$OUT/logs"
else
  record=benchmarks/runs
  logs=$(mktemp -d -t lease_logs_XXXXXX)
fi
if [ "${LEASE_CPU_SMOKE:-0}" = 1 ]; then  # no GPU: the eager fp32 tiny row stands in for the queued ones
  where=(--cpu-smoke "$record")
  ROWS='^tiny \| .* \| fp32 \| torch \| off$'
else
  where=(--record "$record")
fi

mkdir -p "$logs"
status=0
python3 -m benchmarks.gpu.acceptance "${where[@]}" --parts pretrain --rows "$ROWS" --together "$TOGETHER" \
  --budget "$BUDGET_S" --logs "$logs" 2>&1 | tee "$logs/lease.log" || status=$?
written=$(sed -n 's/.*; the record: //p' "$logs/lease.log" | tail -n 1)
echo "lease: record ${written:-not written (nothing measured)}; logs in $logs; exit code $status"
exit "$status"
