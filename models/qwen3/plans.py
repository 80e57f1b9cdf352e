"""How parallelisms treat one Qwen3 block: its tensor-parallel plan and what selective op AC keeps.

Tensor parallel + sequence parallel (Megatron style), tp ranks sharing a micro-batch, seqlen/tp a
sequence shard (the skeleton around the blocks, embedding, final norm and output, is split by
parallelisms/tp.py). Llama's plan (models/llama3/plans.py) plus the QK-norms:

    x (bs, seqlen/tp, dim)  Shard(1)         residual stream, sequence parallel
    attention_norm          Shard(1)         SequenceParallel: the norm runs on its shard
    attention input         Replicate        PrepareModuleInput: all-gather over the sequence
    wq / wk / wv            Colwise          each rank holds n_heads/tp (n_kv_heads/tp) heads; the
                                             output is a plain local tensor
    q_norm / k_norm         Shard(2)         SequenceParallel(sequence_dim=2): the projection's
                                             output viewed (bs, seqlen, heads/tp, head_dim) is
                                             declared sharded over its heads dim (2); the norm
                                             runs over head_dim, which every rank holds whole
    wo                      Rowwise          reduce-scatter back to Shard(1)
    ffn_norm, feed_forward  same pattern     w1, w3 colwise (hidden/tp), w2 rowwise

Why the QK-norms need a style at all, when each rank could just apply its (head_dim,) weight to its
own heads: their weights must be DTensors replicated over the TP mesh like every other parameter
of a TP model. Left plain, each rank's copy would get the gradient of its own heads only and
drift apart from the others, and FSDP x TP and gradient clipping (one norm over all parameters)
would mix plain tensors with DTensors. SequenceParallel replicates the weight, and its gradient
(a Partial sum over the rank's heads) is all-reduced over the TP mesh in backward. The sequence
dimension is not what is split here; the style is used for what it does: shard the input on one
dim and replicate the weight. use_local_output hands RoPE and attention plain local tensors again.

Selective op AC (parallelisms/ac.py) recomputes a checkpointed block in backward except the
outputs of the ops it keeps for every family (parallelisms.ac._SAVE_OPS: the attention kernels,
the collectives but async TP's all-gathers, float8's amax) and of the matmuls of the linears named
here. As for Llama, wq, wv, w1 and w2 keep theirs; wk, wo and w3 are recomputed (and with wk, the
cheap k_norm after it).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
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


def tp_plan() -> dict[str, ParallelStyle]:
    """The plan of one TransformerBlock, by module name inside the block."""
    return {
        "attention_norm": SequenceParallel(),
        # `cos_sin` and the attention mask (None layouts) are plain tensors (or None) every rank
        # holds in full: left alone. Attention sees the whole sequence, so does the mask.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        # (bs, seqlen, heads/tp, head_dim): the local heads are dim 2's shard.
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
