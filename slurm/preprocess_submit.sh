#!/bin/bash
# Submit the sharding array job (slurm/preprocess.sbatch, N tasks) and the merge that waits for it.
#
#   bash slurm/preprocess_submit.sh N [SBATCH_OPTION ... --] SHARD_ARGS ...
#   bash slurm/preprocess_submit.sh 16 --partition=cpu -- --input 'corpus/*.jsonl' --tokenizer tok --out shards
#
# SBATCH_OPTIONs (before --) go to both jobs. The merge runs only if every task succeeded
# (afterok) and is cancelled if one fails (--kill-on-invalid-dep); rerunning this command after a
# failure resumes the finished slices. Prints "array=ID merge=ID".
set -euo pipefail

usage() {
  echo "usage: bash slurm/preprocess_submit.sh N [SBATCH_OPTION ... --]" \
    "--input ... --tokenizer ... --out SHARD_DIR [...]" >&2
  exit 2
}

[ $# -ge 2 ] && [[ $1 =~ ^[1-9][0-9]*$ ]] || usage
slices=$1
shift
sbatch_options=()
if [[ " $* " == *" -- "* ]]; then
  while [ "$1" != -- ]; do
    sbatch_options+=("$1")
    shift
  done
  shift
fi
out=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    --out) out=${args[i + 1]:-} ;;
    --out=*) out=${args[i]#--out=} ;;
  esac
done
[ -n "$out" ] || usage

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
array=$(sbatch --parsable --array="0-$((slices - 1))" "${sbatch_options[@]}" "$here/preprocess.sbatch" "$@")
array=${array%%;*}  # --parsable prints "id;cluster" on multi-cluster setups
merge=$(sbatch --parsable --dependency="afterok:$array" --kill-on-invalid-dep=yes "${sbatch_options[@]}" \
  "$here/preprocess_merge.sbatch" "$out")
merge=${merge%%;*}
echo "array=$array merge=$merge"
