"""How parallelisms treat one OLMo 2 block: its tensor-parallel plan and what selective op AC keeps.

Tensor parallel + sequence parallel (Megatron style), tp ranks sharing a micro-batch, seqlen/tp a
sequence shard (the skeleton around the blocks, embedding, final norm and output, is split by
parallelisms/tp.py):

    x (bs, seqlen/tp, dim)  Shard(1)         residual stream, sequence parallel, a plain local tensor
    attention input         Replicate        PrepareModuleInput: all-gather over the sequence
    wq / wk / wv            Colwise          each rank holds n_heads/tp (n_kv_heads/tp) heads' outputs
    q_norm / k_norm         Shard(-1)        SplitNormParallel below: the norm over the whole projection
                                             on its column shard, weight split like the projection
    wo                      Rowwise          reduce-scatter back to Shard(1)
    post_attention_norm     Shard(1)         SequenceParallel(use_local_output=True)
    feed_forward            same pattern     w1, w3 colwise (hidden/tp), w2 rowwise
    post_ffn_norm           Shard(1)         SequenceParallel(use_local_output=True)

Post-norms. Llama's and Qwen3's norms come first in a branch and hand the branch a DTensor (what
PrepareModuleInput then gathers). OLMo 2's come last: their output is added to the residual, which is a
plain local sequence shard, and a DTensor plus a plain tensor is an error. use_local_output=True hands
back the local shard of the (sequence-parallel, elementwise) norm, which is exactly the rows of the
residual this rank holds.

QK-norm over a TP-split dimension. The norm's mean of squares spans all heads, which the column-wise
projection has split over the ranks. Gathering the projection (what transformers' own OLMo 2 TP plan
does, "colwise_gather_output") moves (bs, seqlen, heads * head_dim) per rank and makes every rank
normalize every head. The cheap form moves (bs, seqlen, 1): each rank sums the squares of its shard,
the sums are all-reduced over the TP group, and each rank normalizes its own shard with its own
slice of the weight (split along dim 0 like the projection's output rows). SplitNormParallel hands
the norm its input as a DTensor Shard(-1): the sum over the split dimension is then a Partial, which
ProjectionNorm (models/olmo2/model.py) all-reduces explicitly, and only it, before the rsqrt; in
backward the gradient of that statistic is all-reduced the same way, again (bs, seqlen, 1). Left to
DTensor's implicit redistribution, the backward would reduce-scatter the full-width gradient instead
(tests/test_olmo2.py counts both). The weight's gradient stays on its shard: no reduction over TP.

Selective op AC (parallelisms/ac.py) recomputes a checkpointed block in backward except the
outputs of the ops it keeps for every family (parallelisms.ac._SAVE_OPS: the attention kernels,
the collectives but async TP's all-gathers, float8's amax; the QK-norms' all-reduce above is one
of them) and of the matmuls of the linears named here. As for Llama, wq, wv, w1 and w2 keep
theirs; wk, wo and w3 are recomputed.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

SAC_SAVED_LINEARS = ("attention.wq", "attention.wv", "feed_forward.w1", "feed_forward.w2")
# The block's weight matrices Muon orthogonalizes (muon.py); its norms take AdamW.
HIDDEN_MATRICES = tuple(f"attention.w{x}" for x in "qkvo") + tuple(f"feed_forward.w{i}" for i in (1, 2, 3))


class SplitNormParallel(ColwiseParallel):
    """A norm over the output of the column-wise projection before it, split as that projection is.

    Input: the projection's local column shard (a plain tensor), declared Shard(-1). Weight: Shard(0),
    the same columns. Output: the local shard again, for the view into heads. A ColwiseParallel by
    type so that generation's plan (parallelisms/tp.py apply_tp_inference), which keeps the column-wise
    styles and drops the sequence-parallel ones, keeps this one too: its input is split the same way there.
    """

    def __init__(self) -> None:
        super().__init__(input_layouts=Shard(-1), output_layouts=Shard(-1), use_local_output=True)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=_shard_weight_rows,
            input_fn=_as_column_shard,
            output_fn=_to_local,
        )


def _shard_weight_rows(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(param_name, sharded)


def _as_column_shard(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    x = inputs[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Shard(-1)], run_check=False)
    return (x, *inputs[1:])


def _to_local(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> Any:
    return output.to_local()


def tp_plan() -> dict[str, ParallelStyle]:
    """The plan of one TransformerBlock, by module name inside the block."""
    return {
        # `cos_sin` and the attention mask (None layouts) are plain tensors (or None) every rank
        # holds in full: left alone. Attention sees the whole sequence, so does the mask.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.q_norm": SplitNormParallel(),
        "attention.k_norm": SplitNormParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_norm": SequenceParallel(use_local_output=True),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
        "post_ffn_norm": SequenceParallel(use_local_output=True),
    }
