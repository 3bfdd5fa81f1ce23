# shellcheck shell=bash
# Shared by slurm/pretrain.sbatch, slurm/pretrain_deepspeed.sbatch and slurm/evaluate.sbatch (sourced, not run).
#
# cbd_start NAME CONFIG [key=value ...]   environment, launch prefix, per-job log directory, rendezvous address
# cbd_activate                            the environment (CONVBERT_DS_ENV) and launch prefix (CBD_PREFIX)
# cbd_check_config WORLD_SIZE             the trainer's own validation, before any rank starts
# cbd_check_nodes PROCS_PER_NODE          every node: processes vs GPUs, checkpoint dir writable + shared
#                                         (or node-local, with checkpoint.mirror set)
# cbd_run COMMAND...                      run the training step; SIGUSR1/SIGTERM reach it as SIGUSR1
# cbd_nodes_lost                          after a failed step: did Slurm take dead nodes out of the job?
#                                         (then the step is started again on the nodes that are left)
# cbd_gpus_on_node                        GPUs on this node (Slurm's allocation, else nvidia-smi)
# cbd_finish                              exit, or requeue the job when the trainer was preempted

EXIT_PREEMPTED=3  # convbert_ds.train: checkpoint saved after SIGUSR1/SIGTERM
EXIT_NOT_SAVED=4  # convbert_ds.train: the run's last save failed
EXIT_PEER_LOST=5  # convbert_ds.train: a collective lost a peer (a process or a node of the run is gone)

cbd_log() { echo "[$(date '+%F %T')] ${CBD_NAME:-convbert_ds}: $*"; }
cbd_die() { echo "[$(date '+%F %T')] ${CBD_NAME:-convbert_ds}: error: $*" >&2; cbd_close_log; exit 2; }

cbd_start() {
  CBD_NAME=$1
  shift
  if [ -z "${SLURM_JOB_ID:-}" ]; then
    echo "$CBD_NAME: submit this script with sbatch (see its header)" >&2
    exit 2
  fi
  if [ $# -lt 1 ] || [[ $1 == -* ]] || [[ $1 == *=* ]]; then
    echo "usage: sbatch [sbatch options] slurm/$CBD_NAME.sbatch CONFIG.yaml [key=value ...]" >&2
    exit 2
  fi
  CBD_CONFIG=$1
  shift
  CBD_OVERRIDES=("$@")
  cd "$SLURM_SUBMIT_DIR" || exit 2

  # One directory per job (kept across requeues, which keep the job id): this script's output
  # and every rank's, the hostfile, and what each attempt ran.
  CBD_LOG_DIR="${CONVBERT_DS_LOG_ROOT:-runs/slurm}/${SLURM_JOB_NAME:-job}-$SLURM_JOB_ID"
  mkdir -p "$CBD_LOG_DIR" || { echo "$CBD_NAME: cannot create log directory $CBD_LOG_DIR" >&2; exit 2; }
  exec 3>&1 4>&2
  # tee ignores the signals that end a job, so that it logs the trainers' last words.
  exec > >(trap '' INT TERM USR1 && exec tee -a "$CBD_LOG_DIR/job.log") 2>&1
  CBD_TEE_PID=$!
  cbd_log "job $SLURM_JOB_ID attempt $((${SLURM_RESTART_COUNT:-0} + 1)) on ${SLURM_JOB_NUM_NODES:-1} node(s)" \
    "($SLURM_JOB_NODELIST); logs in $CBD_LOG_DIR"

  CBD_SIGNAL=""
  trap 'cbd_on_signal USR1' USR1
  trap 'cbd_on_signal TERM' TERM

  cbd_activate

  # Ranks come from SLURM_* (or from the deepspeed launcher): stale torch variables from the
  # submitting shell would win over them.
  unset RANK LOCAL_RANK WORLD_SIZE
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  # As convbert_ds/engine/distributed.py: jobs sharing a node differ, and the port stays below the kernel's
  # ephemeral range (32768 and up), where an open connection could already hold it.
  MASTER_PORT=$((20000 + SLURM_JOB_ID % 12000))
  export MASTER_ADDR MASTER_PORT PYTHONUNBUFFERED=1
}

# The job's Python: CONVBERT_DS_ENV sourced, CONVBERT_DS_LAUNCH_PREFIX read into CBD_PREFIX and tried.
cbd_activate() {
  local env_file=${CONVBERT_DS_ENV:-.venv/bin/activate}
  if [ "$env_file" != none ]; then
    [ -f "$env_file" ] || cbd_die "CONVBERT_DS_ENV=$env_file: no such file (set CONVBERT_DS_ENV to the script" \
      "that activates your Python environment, or to 'none' to use the environment sbatch passed on)"
    set +u  # activation scripts are not written for nounset
    # shellcheck disable=SC1090
    source "$env_file"
    set -u
  fi
  # Every process this job starts runs through the launch prefix, e.g. "apptainer exec --nv image.sif"
  # (words split on spaces; an argument with spaces needs a wrapper script).
  read -r -a CBD_PREFIX <<<"${CONVBERT_DS_LAUNCH_PREFIX:-}"
  if [ ${#CBD_PREFIX[@]} -gt 0 ]; then
    cbd_log "launch prefix: ${CBD_PREFIX[*]}"
    "${CBD_PREFIX[@]}" python -c '' 2>/dev/null || cbd_die "no python through CONVBERT_DS_LAUNCH_PREFIX=" \
      "'${CONVBERT_DS_LAUNCH_PREFIX}' (it must run the command that follows it, e.g. apptainer exec IMAGE)"
  else
    command -v python >/dev/null || cbd_die "no python on PATH after activating the environment"
  fi
}

cbd_close_log() {
  if [ -n "${CBD_TEE_PID:-}" ]; then
    exec 1>&3 2>&4
    wait "$CBD_TEE_PID" 2>/dev/null || true
    CBD_TEE_PID=""
  fi
}

cbd_on_signal() {
  CBD_SIGNAL=$1
  CBD_INTERRUPTED=1
  cbd_log "received SIG$1; asking the trainers to checkpoint and stop"
  if [ -n "${CBD_STEP_PID:-}" ]; then
    # srun passes the signal on to every task of the step; the trainers treat SIGUSR1 and
    # SIGTERM alike (finish the step, save, exit 3), and USR1 is what launchers ignore.
    kill -USR1 "$CBD_STEP_PID" 2>/dev/null || true
    if [ -z "${CBD_RESENDER_PID:-}" ]; then
      # A task srun has not started yet misses the signal: say it again until the step ends.
      # (Its sleep must die with it: the job ends only when all of its processes have.)
      (
        trap 'kill "$nap" 2>/dev/null; exit 0' TERM
        while :; do
          sleep 20 &
          nap=$!
          wait "$nap"
          kill -USR1 "$CBD_STEP_PID" 2>/dev/null || exit 0
        done
      ) &
      CBD_RESENDER_PID=$!
    fi
  fi
}

# CBD_TASKS_PER_NODE: the tasks Slurm runs on each node (the same on every node, e.g. "8(x16)").
cbd_tasks_per_node() {
  local spec=${SLURM_TASKS_PER_NODE:?} item count items
  CBD_TASKS_PER_NODE=""
  IFS=, read -ra items <<<"$spec"
  for item in "${items[@]}"; do
    count=${item%%(*}
    [ -z "$CBD_TASKS_PER_NODE" ] && CBD_TASKS_PER_NODE=$count
    [ "$count" = "$CBD_TASKS_PER_NODE" ] || cbd_die "nodes run different numbers of tasks" \
      "(SLURM_TASKS_PER_NODE=$spec); use --ntasks-per-node"
  done
}

# Validate CONFIG + overrides exactly as the trainer will, for WORLD_SIZE processes, and learn
# checkpoint.dir from it.
cbd_check_config() {
  local world=$1 out
  out=$("${CBD_PREFIX[@]}" python -m convbert_ds.train --config "$CBD_CONFIG" "${CBD_OVERRIDES[@]}" --check-config --world-size "$world") ||
    cbd_die "$CBD_CONFIG with ${CBD_OVERRIDES[*]:-no overrides} is not valid (above); nothing was started"
  CBD_CKPT_DIR=$(sed -n 's/^checkpoint_dir=//p' <<<"$out" | tail -n 1)
  CBD_CKPT_MIRROR=$(sed -n 's/^checkpoint_mirror=//p' <<<"$out" | tail -n 1)
  cbd_log "config $CBD_CONFIG valid for $world processes; checkpoints in $CBD_CKPT_DIR${CBD_CKPT_MIRROR:+ and $CBD_CKPT_MIRROR}"
}

# GPUs on this node: Slurm's allocation, else what nvidia-smi lists, else 0.
cbd_gpus_on_node() {
  if [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then
    echo "$SLURM_GPUS_ON_NODE"
  elif command -v nvidia-smi >/dev/null; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

# Runs on every node (one task each): GPUs vs processes, and a file in the checkpoint directory.
cbd_node_check() {
  local procs=$1 dir=$2 node=${SLURMD_NODENAME:-$(hostname -s)} gpus
  gpus=$(cbd_gpus_on_node)
  if [ "$gpus" -gt 0 ] && [ "$procs" -gt "$gpus" ]; then
    echo "error: node $node has $gpus GPU(s) for $procs processes; ask for one task per GPU" \
      "(--ntasks-per-node=$gpus) or more GPUs (--gpus-per-node=$procs)" >&2
    return 1
  fi
  if [ "$gpus" -gt "$procs" ]; then
    echo "warning: node $node has $gpus GPUs but runs $procs processes; $((gpus - procs)) GPU(s) stay idle" >&2
  fi
  if ! { mkdir -p "$dir" && touch "$dir/$node"; } 2>/dev/null; then
    echo "error: node $node cannot write to the checkpoint directory $(dirname "$dir")" >&2
    return 1
  fi
}

cbd_check_nodes() {
  local procs=$1 nodes=${SLURM_JOB_NUM_NODES:-1} probe missing host waited=0
  local patience=${CONVBERT_DS_SHARED_DISK_WAIT:-30}
  # With a mirror, node-local disks are allowed: a file missing after 5 s means node-local, not lag.
  [ -z "${CBD_CKPT_MIRROR:-}" ] || [ "$patience" -le 5 ] || patience=5
  probe="$CBD_CKPT_DIR/.node-check-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"
  srun --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1 --kill-on-bad-exit=1 \
    "${CBD_PREFIX[@]}" bash -c 'source "$1" && cbd_node_check "$2" "$3"' _ "$CBD_LIB" "$procs" "$probe" \
    || cbd_die "a node failed its checks (above)"
  # Node 0 must see every node's file, or ranks would write checkpoints nobody else can read.
  while :; do
    missing=""
    for host in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
      [ -e "$probe/$host" ] || missing="$missing $host"
    done
    [ -z "$missing" ] || [ "$waited" -ge "$patience" ] && break
    sleep 1  # network filesystems may show other nodes' files a little late
    waited=$((waited + 1))
  done
  rm -rf "$probe"
  if [ -n "$missing" ] && [ -n "${CBD_CKPT_MIRROR:-}" ]; then
    # Node-local disks: each node uploads its own part of a checkpoint to the mirror (the trainer says so).
    # The trainer takes this verdict at its first look instead of waiting again for late files.
    export CONVBERT_DS_NODE_LOCAL_DIR=$CBD_CKPT_DIR
    cbd_log "nodes ok: $nodes node(s) x $procs process(es); $CBD_CKPT_DIR writable on each node, node-local" \
      "(not shared with$missing): checkpoints are whole in $CBD_CKPT_MIRROR"
    return
  fi
  [ -z "$missing" ] || cbd_die "checkpoint directory $CBD_CKPT_DIR is not shared: files written there on" \
    "node(s)$missing are not visible on $(hostname -s); put checkpoint.dir on a filesystem all nodes mount," \
    "or set checkpoint.mirror=s3://BUCKET/PREFIX so that every node uploads its own part of each checkpoint"
  cbd_log "nodes ok: $nodes node(s) x $procs process(es); $CBD_CKPT_DIR writable and shared"
}

# Run the training step in the background so that this shell can take the signals Slurm sends
# it (--signal=B:USR1@...) and pass them on; CBD_STATUS gets the step's exit status.
cbd_run() {
  if [ -n "$CBD_SIGNAL" ]; then
    cbd_log "SIG$CBD_SIGNAL arrived before training started; nothing to checkpoint"
    CBD_STATUS=$EXIT_PREEMPTED
    return
  fi
  { printf '# %s attempt %s\n' "$(date '+%F %T')" "$((${SLURM_RESTART_COUNT:-0} + 1))"
    printf '%q ' "$@"
    echo; } >>"$CBD_LOG_DIR/commands.txt"
  "$@" &
  CBD_STEP_PID=$!
  CBD_STATUS=""
  local rc
  while :; do
    CBD_INTERRUPTED=0
    rc=0
    wait "$CBD_STEP_PID" || rc=$?
    # 127: a signal arrived just after the step ended and the status was already collected.
    if [ "$rc" = 127 ] && [ -n "$CBD_STATUS" ]; then break; fi
    CBD_STATUS=$rc
    [ "$CBD_INTERRUPTED" = 1 ] || break  # else wait was cut short by a trapped signal
  done
  CBD_STEP_PID=""
  if [ -n "${CBD_RESENDER_PID:-}" ]; then
    kill "$CBD_RESENDER_PID" 2>/dev/null || true
    CBD_RESENDER_PID=""
  fi
}

# After a training step that failed: whether Slurm took nodes out of this job because they stopped
# answering (with --no-kill a dead node is excised from the allocation after SlurmdTimeout and the job
# goes on). Slurm pings a node every SlurmdTimeout/3, shows it "not responding" after a missed ping and
# takes it out SlurmdTimeout after its last answer. Trainers that lost a peer exit with EXIT_PEER_LOST:
# then a node may have died, and the script looks for a silent one for a whole SlurmdTimeout (srun may
# have ended the step, --wait=60, before Slurm's first missed ping: its default SlurmdTimeout is 300);
# after any other failure, for 5 s. It then waits while a node of the job is silent, up to
# CONVBERT_DS_NODE_LOSS_WAIT seconds (default twice SlurmdTimeout, at least 120). Returns 0 when nodes
# were lost and at least one is left, with CBD_LOST (the lost nodes) set and SLURM_JOB_NODELIST and
# friends updated for the next srun.
cbd_nodes_lost() {
  local waited=0 look=5 slurmd_timeout patience before now now_hosts node state silent told=""
  case "$CBD_STATUS" in 0 | "$EXIT_PREEMPTED" | "$EXIT_NOT_SAVED" | 2) return 1 ;; esac
  [ -z "$CBD_SIGNAL" ] || return 1
  slurmd_timeout=$(scontrol show config | sed -n 's/^SlurmdTimeout *= *\([0-9][0-9]*\).*/\1/p')
  slurmd_timeout=${slurmd_timeout:-300}
  patience=${CONVBERT_DS_NODE_LOSS_WAIT:-$((2 * slurmd_timeout > 120 ? 2 * slurmd_timeout : 120))}
  if [ "$CBD_STATUS" = "$EXIT_PEER_LOST" ]; then
    look=$slurmd_timeout
    cbd_log "a trainer lost a peer (exit status $EXIT_PEER_LOST): looking for a node of the job that stopped" \
      "answering (up to SlurmdTimeout, $slurmd_timeout s)"
  fi
  before=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
  while :; do
    # One scontrol and one sinfo a second, whatever the job's size: slurmctld answers every other job too.
    now=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *NodeList=\([^ ]*\).*/\1/p' | head -n 1)
    now_hosts=$(scontrol show hostnames "$now")
    silent=""
    while read -r node state; do  # "n2 allocated*": the * is Slurm's "not responding"
      case "$state" in *'*'*) [[ " $silent " == *" $node "* ]] || silent="$silent $node" ;; esac
    done < <([ -z "$now" ] || sinfo -h -N -n "$now" -o '%N %T')
    CBD_LOST=""
    for node in $before; do
      grep -qx "$node" <<< "$now_hosts" || CBD_LOST="$CBD_LOST $node"
    done
    if [ -n "$silent" ] && [ "$waited" -lt "$patience" ]; then
      [ -n "$told" ] || cbd_log "node(s)$silent not answering; waiting up to $patience s" \
        "(CONVBERT_DS_NODE_LOSS_WAIT) for Slurm to take them out of the job"
      told=1
    elif [ -n "$silent" ] || [ -n "$CBD_LOST" ] || [ "$waited" -ge "$look" ]; then
      break
    fi
    sleep 1
    waited=$((waited + 1))
  done
  [ -n "$CBD_LOST" ] && [ -n "$now" ] || return 1
  local count
  count=$(scontrol show hostnames "$now" | wc -l)
  export SLURM_JOB_NODELIST=$now SLURM_NODELIST=$now SLURM_JOB_NUM_NODES=$count SLURM_NNODES=$count
  export SLURM_TASKS_PER_NODE="$CBD_TASKS_PER_NODE(x$count)" SLURM_NTASKS=$((count * CBD_TASKS_PER_NODE))
  export SLURM_NPROCS=$SLURM_NTASKS SLURM_JOB_CPUS_PER_NODE="${SLURM_JOB_CPUS_PER_NODE%%(*}(x$count)"
  return 0
}

cbd_finish() {
  local restarts=${SLURM_RESTART_COUNT:-0} max=${CONVBERT_DS_MAX_REQUEUES:-20}
  if [ "$CBD_STATUS" = 0 ]; then
    cbd_log "training finished"
  elif [ "$CBD_STATUS" != "$EXIT_PREEMPTED" ]; then
    cbd_log "training failed with exit status $CBD_STATUS; not requeueing"
  elif [ "$CBD_SIGNAL" = TERM ]; then
    # SIGTERM is scancel or the hard time limit: the job is ending, requeueing would undo a cancel.
    cbd_log "preempted by SIGTERM; not requeueing (submit the same command again to resume)"
  elif [ "$restarts" -ge "$max" ]; then
    cbd_log "preempted; not requeueing: the job was already requeued $restarts time(s)" \
      "(CONVBERT_DS_MAX_REQUEUES=$max); submit the same command again to resume"
  else
    cbd_log "preempted; requeueing job $SLURM_JOB_ID (requeue $((restarts + 1)) of at most $max)," \
      "the next attempt resumes from $CBD_CKPT_DIR/latest"
    cbd_close_log
    if scontrol requeue "$SLURM_JOB_ID"; then
      exit 0  # Slurm ends this attempt and starts the script again
    fi
    echo "$CBD_NAME: scontrol requeue failed; submit the same command again to resume" >&2
  fi
  cbd_close_log
  exit "$CBD_STATUS"
}
