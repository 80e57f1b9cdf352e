"""How parallelisms treat one Qwen3 MoE block: its tensor-parallel plan and what selective op AC keeps.

Tensor parallel: the attention's plan is Qwen3's (models/qwen3/plans.py). The MoE is not split: sequence parallel
leaves each TP rank its own tokens at the MoE (ffn_norm hands it a plain sequence shard), the router scores them
with its whole weight (`LocalTokens`: its gradient summed over the TP ranks), and expert parallel's all-to-all
takes them to their experts: the TP ranks are expert parallel ranks (parallelism.expert_parallel_degree, torchtitan's
expert_tensor_parallel_degree 1). No collective of TP's own at the MoE. Without expert parallel each TP rank would
hold every expert whole and nothing would sum their gradients over the TP ranks: `config_problems` asks for it.

Selective op AC (parallelisms/ac.py) keeps the outputs of the attention kernels and of the linears named here, wq's
and wv's as in Qwen3. The experts' grouped matmuls are no linears' matmuls: op SAC recomputes them, and the router's
float32 scores, in backward.

Muon (muon.py) orthogonalizes 2-D matrices one at a time; the experts' weights are 3-D, one matrix per expert, which
it does not handle: `config_problems` refuses optimizer.name = "Muon". HIDDEN_MATRICES names the 2-D ones it would
take (the attention's projections).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
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
    """The plan of one block, by module name inside the block: Qwen3's attention, the MoE on each rank's own tokens."""
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
        "ffn_norm": SequenceParallel(use_local_output=True),
        "moe.router": LocalTokens(),
    }


class LocalTokens(ParallelStyle):
    """The router under sequence parallel: each TP rank scores its own tokens with the whole weight. The weight
    becomes a Replicate DTensor over the TP mesh (FSDP and checkpoints see one weight); the forward computes on its
    local tensor (`to_local`), whose gradient, a sum over this rank's tokens only, is declared Partial: summed over
    the TP ranks where it is read, as SequenceParallel's norm weights' are. (parallelisms/ep.py swaps the experts'
    weights for their local shards the same way.)"""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = distribute_tensor(param.data, device_mesh, [Replicate()])
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        forward = module.forward

        def on_local_weights(*args: Any, **kwargs: Any) -> Any:
            params = module._parameters
            held = {name: p for name, p in params.items() if isinstance(p, DTensor)}
            try:
                for name, p in held.items():
                    params[name] = p.to_local(grad_placements=[Partial()])
                return forward(*args, **kwargs)
            finally:
                params.update(held)

        module.forward = on_local_weights
        return module


def config_problems(cfg: Any) -> list[str]:
    """What of a run's JobConfig this family cannot train yet, one line each naming the key and the fix."""
    problems = []
    par = cfg.parallelism
    if (tp := par.tensor_parallel_degree) > 1 and par.expert_parallel_degree == 1:
        problems.append(
            f"parallelism.tensor_parallel_degree: {tp} with model.name = 'qwen3_moe' needs expert parallel: each TP "
            f"rank holds its own tokens at the experts, which expert parallel splits over the ranks (set "
            f"parallelism.expert_parallel_degree to {tp} or a multiple of it that divides the experts)"
        )
    if cfg.optimizer.name == "Muon":
        problems.append(
            "optimizer.name: Muon orthogonalizes 2-D matrices and qwen3_moe's experts are 3-D (experts, out, in); "
            'use "AdamW"'
        )
    return problems
