#!/usr/bin/env bash
# Every check that needs a GPU, in one command that fits a short lease (under 9 minutes on an H100, the
# kernel tests compiling about 3 of them):
#   1. the Triton kernel tests and the transformers-parity tests on CUDA,
#   2. benchmarks/sdconv.py (bf16, ConvBERT-base shapes: n=6 heads of 64, K=9),
#   3. benchmarks/train_step.py --preset base --precision bf16 (DeepSpeed engine vs plain loop, MFU).
# Each part has its own time limit, so one that hangs or fails still leaves the others' figures.
#   usage: bash benchmarks/gpu_acceptance.sh [LOG_DIR]     (logs: LOG_DIR/{env,tests,sdconv,train_step}.log)
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:-gpu_acceptance_logs}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
status=0

part() {  # part NAME SECONDS COMMAND...: run one part, its output to the console and LOG_DIR/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@" 2>&1 | tee "$logs/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit code $rc"
  [ "$rc" = 0 ] || status=1
}

part env 30 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "
import torch, triton, transformers
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__,
      \"transformers\", transformers.__version__, \"device\", torch.cuda.get_device_name())"'
part tests 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_kernels_compile.py \
  tests/model/test_sdconv_reference.py tests/model/test_hf_parity.py
part sdconv 90 python3 benchmarks/sdconv.py --dtype bf16
part train_step 150 python3 benchmarks/train_step.py --preset base --precision bf16 --batch 64 --seq 128 --steps 20
exit $status
