"""How parallelisms treat one Qwen3 MoE block: its tensor-parallel plan and what selective op AC keeps.

Tensor parallel: not for training yet. The attention's plan is Qwen3's (models/qwen3/plans.py), but an MoE block
has no tensor-parallel layout of its own until expert parallelism lands (issue 65): `config_problems` refuses
parallelism.tensor_parallel_degree > 1, and `tp_plan` holds the attention's entries only, for the day the experts
get theirs.

Selective op AC (parallelisms/ac.py) keeps the outputs of the attention kernels and of the linears named here, wq's
and wv's as in Qwen3. The experts' grouped matmuls are no linears' matmuls: op SAC recomputes them, and the router's
float32 scores, in backward.

Muon (muon.py) orthogonalizes 2-D matrices one at a time; the experts' weights are 3-D, one matrix per expert, which
it does not handle: `config_problems` refuses optimizer.name = "Muon". HIDDEN_MATRICES names the 2-D ones it would
take (the attention's projections).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

SAC_SAVED_LINEARS = ("attention.wq", "attention.wv")
# The block's 2-D weight matrices (Muon is refused for this family: the experts' weights are 3-D).
HIDDEN_MATRICES = tuple(f"attention.w{x}" for x in "qkvo")


def tp_plan() -> dict[str, ParallelStyle]:
    """The plan of one block's attention, by module name inside the block (Qwen3's); the MoE has none yet."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


def config_problems(cfg: Any) -> list[str]:
    """What of a run's JobConfig this family cannot train yet, one line each naming the key and the fix."""
    problems = []
    if (tp := cfg.parallelism.tensor_parallel_degree) > 1:
        problems.append(
            f"parallelism.tensor_parallel_degree: {tp} with model.name = 'qwen3_moe', whose MoE blocks have no "
            "tensor-parallel plan yet (expert parallel comes with issue 65); set it to 1 and shard with FSDP"
        )
    if cfg.optimizer.name == "Muon":
        problems.append(
            "optimizer.name: Muon orthogonalizes 2-D matrices and qwen3_moe's experts are 3-D (experts, out, in); "
            'use "AdamW"'
        )
    return problems
