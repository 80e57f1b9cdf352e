#!/usr/bin/env bash
# One torchrun per node; the nodes find each other through a c10d rendezvous on the head node.
#
# Run the same command on every node (HEAD_ADDR: node 0's hostname or IP, reachable from all):
#   NNODES=2 NPROC_PER_NODE=8 HEAD_ADDR=node0 scripts/run_multinode.sh scripts/net_preflight.py
#   NNODES=2 NPROC_PER_NODE=8 HEAD_ADDR=node0 scripts/run_multinode.sh train.py --config configs/llama3_8b.toml \
#       --parallelism.data_parallel_replicate_degree=2 --parallelism.data_parallel_shard_degree=8
# Under SLURM, scripts/slurm/train_multinode.sbatch sets these from the job and calls this through srun.
#
# torchrun numbers the ranks of one node consecutively, and ParallelDims puts dp_shard (x tp)
# innermost, so with data_parallel_shard_degree x tensor_parallel_degree = GPUs per node the
# all-gathers and reduce-scatters stay inside a node and only HSDP's gradient all-reduce
# crosses nodes (docs/failures.md #3). NCCL network settings: see the sbatch script.
#
# Stopping: a SIGINT (Ctrl-C), SIGTERM or SIGUSR1 to this script asks train.py to stop: the script
# creates <dump_folder>/STOP, every rank finishes its step, the step is saved, and the whole launch
# exits 0; rerun the same command to resume. torchrun runs in a session of its own, so a terminal's
# Ctrl-C reaches only this script; a second signal stops the ranks at once (nothing saved). The
# dump folder must be on a filesystem every node sees (rank 0 may run on any node, and DCP
# checkpoints are written by all ranks into one folder); so must the data and its cache.
#
# Environment:
#   NNODES          nodes in the job (default: SLURM_NNODES, else 2)
#   NPROC_PER_NODE  ranks per node (default: gpu = one per visible GPU)
#   HEAD_ADDR       rendezvous host (default: SLURM's first node)
#   RDZV_PORT       rendezvous port on HEAD_ADDR (default 29500)
#   RDZV_ID         the job's rendezvous id, the same on every node (default: SLURM job id + script name)
#   PYTHON          interpreter (default: .venv/bin/python when `make setup` made it, else python3)
#   TORCHRUN_ARGS   extra torchrun flags, e.g. "--local-ranks-filter=0" to print rank 0 only
#   SHUTDOWN_TIMEOUT  seconds torchrun gives the ranks between its SIGTERM and SIGKILL when it is
#                   signalled itself (default 300: a step plus a save; torchrun's own default is 30)
#   DRY_RUN=1       print the torchrun command instead of running it
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 SCRIPT [ARGS...]   (see the comments at the top of this file)" >&2
    exit 2
fi
SCRIPT=$1
shift

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

if [[ -z ${HEAD_ADDR:-} && -n ${SLURM_JOB_NODELIST:-} ]]; then
    HEAD_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
: "${HEAD_ADDR:?set HEAD_ADDR to the hostname or IP of the first node}"
NNODES=${NNODES:-${SLURM_NNODES:-2}}
NPROC_PER_NODE=${NPROC_PER_NODE:-gpu}
RDZV_PORT=${RDZV_PORT:-29500}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-manual}-$(basename "$SCRIPT" .py)}
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# Each rank drives one GPU; more threads per rank only oversubscribe the CPU.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# --shutdown-timeout exists in torchrun since PyTorch 2.9; older ones get the 30 s default.
shutdown=()
if "$PYTHON" -m torch.distributed.run --help 2>/dev/null | grep -q -- --shutdown-timeout; then
    shutdown=(--shutdown-timeout="${SHUTDOWN_TIMEOUT:-300}")
fi
# shellcheck disable=SC2206  # TORCHRUN_ARGS is split into words on purpose
cmd=(
    "$PYTHON" -m torch.distributed.run
    --nnodes="$NNODES"
    --nproc_per_node="$NPROC_PER_NODE"
    --rdzv_backend=c10d
    --rdzv_endpoint="$HEAD_ADDR:$RDZV_PORT"
    --rdzv_id="$RDZV_ID"
    --max_restarts=0
    "${shutdown[@]}"
    ${TORCHRUN_ARGS:-}
    "$SCRIPT" "$@"
)
if [[ ${DRY_RUN:-0} == 1 ]]; then
    echo "${cmd[*]}"
    exit 0
fi
echo "[$(hostname)] ${cmd[*]}" >&2
if [[ $(basename "$SCRIPT") != train.py ]]; then
    exec "${cmd[@]}"
fi

# train.py: a signal to this script becomes <dump_folder>/STOP (a clean stop, exit 0).
DUMP_FOLDER=$("$PYTHON" -c 'import sys; from config import load_config; print(load_config(sys.argv[1:]).job.dump_folder)' "$@")
STOP_FILE="$DUMP_FOLDER/STOP"
stops=0
interrupted=0
request_stop() {
    interrupted=1
    stops=$((stops + 1))
    if [[ $stops == 1 ]]; then
        mkdir -p "$DUMP_FOLDER" && touch "$STOP_FILE"
        echo "[$(hostname)] stop requested: created $STOP_FILE; the ranks save their step and exit" >&2
    else
        echo "[$(hostname)] second stop request: stopping the ranks at once" >&2
        kill -TERM -- "-$child" 2>/dev/null || true
    fi
}
setsid --wait "${cmd[@]}" &  # a session (and process group) of its own, led by $child
child=$!
trap request_stop INT TERM USR1
# `wait` returns early (128 + signal) when a trapped signal arrives: then wait again for torchrun.
status=0
while true; do
    interrupted=0 code=0
    wait "$child" || code=$?
    [[ $code == 127 ]] || status=$code # 127: already reaped by the last wait (a signal raced its end)
    if [[ $interrupted == 0 || $code == 127 ]]; then break; fi
done
exit "$status"
