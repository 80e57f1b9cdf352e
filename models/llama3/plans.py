"""How parallelisms treat one Llama block: its tensor-parallel plan and what selective op AC keeps.

Tensor parallel + sequence parallel (Megatron style), tp ranks sharing a micro-batch, seqlen/tp a
sequence shard (the skeleton around the blocks, embedding, final norm and output, is split by
parallelisms/tp.py):

    x (bs, seqlen/tp, dim)  Shard(1)         residual stream, sequence parallel
    attention_norm          Shard(1)         SequenceParallel: the norm runs on its shard
    attention input         Replicate        PrepareModuleInput: all-gather over the sequence
    wq / wk / wv            Colwise          each rank holds n_heads/tp (n_kv_heads/tp) heads
    wo                      Rowwise          reduce-scatter back to Shard(1)
    ffn_norm, feed_forward  same pattern     w1, w3 colwise (hidden/tp), w2 rowwise

Selective op AC (parallelisms/ac.py) recomputes a checkpointed block in backward except the
outputs of the ops it keeps for every family (parallelisms.ac._SAVE_OPS: the attention kernels,
the collectives but async TP's all-gathers, float8's amax) and of the matmuls of the linears named
here. wq, wv, w1 and w2 keep theirs; wk, wo and w3 are recomputed, about 37% of an 8B block's
matmul FLOPs for about half of the matmul outputs' memory (the choice torchtitan makes by keeping
every other matmul of this block).
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
