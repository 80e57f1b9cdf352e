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
# Environment:
#   NNODES          nodes in the job (default: SLURM_NNODES, else 2)
#   NPROC_PER_NODE  ranks per node (default: gpu = one per visible GPU)
#   HEAD_ADDR       rendezvous host (default: SLURM's first node)
#   RDZV_PORT       rendezvous port on HEAD_ADDR (default 29500)
#   RDZV_ID         the job's rendezvous id, the same on every node (default: SLURM job id + script name)
#   PYTHON          interpreter (default: .venv/bin/python when `make setup` made it, else python3)
#   TORCHRUN_ARGS   extra torchrun flags, e.g. "--local-ranks-filter=0" to print rank 0 only
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

# shellcheck disable=SC2206  # TORCHRUN_ARGS is split into words on purpose
cmd=(
    "$PYTHON" -m torch.distributed.run
    --nnodes="$NNODES"
    --nproc_per_node="$NPROC_PER_NODE"
    --rdzv_backend=c10d
    --rdzv_endpoint="$HEAD_ADDR:$RDZV_PORT"
    --rdzv_id="$RDZV_ID"
    --max_restarts=0
    ${TORCHRUN_ARGS:-}
    "$SCRIPT" "$@"
)
if [[ ${DRY_RUN:-0} == 1 ]]; then
    echo "${cmd[*]}"
    exit 0
fi
echo "[$(hostname)] ${cmd[*]}" >&2
exec "${cmd[@]}"
