"""Tensor parallel + sequence parallel (Megatron style) and loss parallel.

Each family's plans.py says how one of its blocks is split (`tp_plan`): column-wise projections
into the heads or hidden units, row-wise ones back, norms on sequence shards. This file applies
that plan to every block and splits the skeleton around them: the embedding is row-wise
(vocabulary split) with a sequence-sharded Shard(1) output, the final norm is sequence parallel, and
the output projection is column-wise: with loss parallel it keeps the logits sharded over the
vocabulary (Shard(-1)) and cross-entropy runs on the shards, so the (bs, seqlen, vocab) logits are
never gathered. Between blocks the residual stream is a plain (bs, seqlen/tp, dim) sequence shard.
Async TP (overlapping these collectives with the matmuls) is a compile pass on top of this plan:
parallelisms/async_tp.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from errors import ConfigError


def check_tp(args: Any, *, tp_degree: int, seq_len: int) -> None:
    """What tensor parallel needs of a model's shape (ModelArgs): every problem in one ConfigError."""
    problems = []
    if args.n_heads % tp_degree:
        problems.append(f"parallelism.tensor_parallel_degree: {tp_degree} does not divide n_heads={args.n_heads}")
    if args.kv_heads % tp_degree:
        problems.append(f"parallelism.tensor_parallel_degree: {tp_degree} does not divide n_kv_heads={args.kv_heads}")
    if seq_len % tp_degree:
        problems.append(
            f"training.seq_len: {seq_len} is not divisible by tensor_parallel_degree {tp_degree} (sequence parallel splits it)"
        )
    if tp_degree > 1 and args.tie_word_embeddings:
        problems.append(
            f"parallelism.tensor_parallel_degree: {tp_degree} with a flavor that ties the output projection to the "
            "embedding, which this plan does not shard; use tensor_parallel_degree = 1 or an untied flavor"
        )
    if problems:
        raise ConfigError(*problems)


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    block_plan: Callable[[], dict[str, ParallelStyle]],
    loss_parallel: bool,
    seq_len: int,
    adapt_block_plan: Callable[[nn.Module, dict[str, ParallelStyle]], dict[str, ParallelStyle]] | None = None,
) -> None:
    """Shard `model` (on any device, meta included) over `tp_mesh` in place.

    block_plan: the family's plan of one block (a fresh dict per call: models/<family>/plans.py).
    loss_parallel: leave the logits as a DTensor sharded over the vocabulary; the loss and its
        backward must then run under `loss_parallel_context(True)`.
    seq_len: the training sequence length, which sequence parallel splits over the TP ranks.
    adapt_block_plan: rewrites each block's plan for that block's modules (float8's styles:
        parallelisms/float8.py `adapt_tp_plan`).
    """
    check_tp(model.args, tp_degree=tp_mesh.size(), seq_len=seq_len)

    # Rowwise over the vocabulary: each rank looks up the tokens of its vocabulary slice, and the
    # partial sums are reduce-scattered straight into sequence shards.
    outer: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            # A DTensor is what loss_parallel's cross-entropy dispatches on; without loss
            # parallel the gathered logits are an ordinary tensor again.
            use_local_output=not loss_parallel,
        ),
    }
    # A pipeline stage holds some of these (parallelisms/pp.py); the blocks pass plain sequence shards
    # from stage to stage.
    parallelize_module(
        model, tp_mesh, {name: style for name, style in outer.items() if getattr(model, name) is not None}
    )
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_wait_async_output)
    for block in model.layers.values():
        plan = block_plan()
        parallelize_module(block, tp_mesh, adapt_block_plan(block, plan) if adapt_block_plan else plan)


def apply_tp_inference(
    model: nn.Module, tp_mesh: DeviceMesh, *, block_plan: Callable[[], dict[str, ParallelStyle]]
) -> None:
    """Shard `model` over `tp_mesh` for generation (generate.py): the family's plan without sequence parallel.

    A decode step has one token per row, which no sequence dimension splits, so the residual stream stays a
    plain tensor every rank holds in full: the norms run unsplit (their SequenceParallel and the inputs'
    PrepareModuleInput go), the row-wise projections all-reduce instead of reduce-scattering, and the output
    projection gathers the logits. The column-wise projections split the heads and hidden units as in training.
    """
    check_tp(model.args, tp_degree=tp_mesh.size(), seq_len=tp_mesh.size())
    outer: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, tp_mesh, outer)
    model.tok_embeddings.register_forward_hook(_wait_async_output)
    for block in model.layers.values():
        plan = {}
        for name, style in block_plan().items():
            if isinstance(style, RowwiseParallel):
                plan[name] = RowwiseParallel()  # output Replicate: an all-reduce
            elif isinstance(style, ColwiseParallel):
                plan[name] = style
            # SequenceParallel and PrepareModuleInput: nothing to split or gather without sequence shards
        parallelize_module(block, tp_mesh, plan)


def _wait_async_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Hand the first block a plain tensor instead of the embedding's pending reduce-scatter.

    RowwiseParallel returns an AsyncCollectiveTensor (a wrapper that waits on first use). Since
    pytorch/pytorch PR #179849 (in 2.13) a compiled graph unwraps such an input without its
    autograd edge (reported in PR #191113): on 2.13.0 the backward of a compiled first block then
    fails inside DTensor's redistribute ("'Tensor' object has no attribute '_local_tensor'").
    No release is known to contain the fix proposed in PR #191113; drop this hook once
    test_parallelisms.py's tp2_compile layout passes without it. `clone` waits for the
    collective and stays differentiable; the cost is one copy of one activation.
    """
    # A private class (PyTorch 2.13), used only here.
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Context for the loss AND its backward: cross-entropy on vocabulary-sharded logits.

    Use it around both `loss_fn(logits, labels)` and `loss.backward()`; enabled = TP is on and
    parallelism.disable_loss_parallel is false (the same value given to `apply_tp`).
    """
    return loss_parallel() if enabled else contextlib.nullcontext()
