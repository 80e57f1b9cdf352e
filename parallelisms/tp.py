"""Tensor parallel + sequence parallel (Megatron style), loss parallel and async TP.

Layouts along one transformer block (tp ranks share a micro-batch; `seqlen/tp` = sequence shard):

    x (bs, seqlen/tp, dim)  Shard(1)         residual stream, sequence parallel
    attention_norm          Shard(1)         SequenceParallel: the norm runs on its shard
    attention input         Replicate        PrepareModuleInput: all-gather over the sequence
    wq / wk / wv            Colwise          each rank holds n_heads/tp (n_kv_heads/tp) heads
    wo                      Rowwise          reduce-scatter back to Shard(1)
    ffn_norm, feed_forward  same pattern     w1, w3 colwise (hidden/tp), w2 rowwise

Around the blocks: the embedding is rowwise (vocabulary split) with a Shard(1) output, the final
norm is sequence parallel, and the output projection is colwise: with loss parallel it keeps the
logits sharded over the vocabulary (Shard(-1)) and cross-entropy runs on the shards, so the
(bs, seqlen, vocab) logits are never gathered.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from config import ConfigError
from models.llama3 import Transformer


def apply_tp(
    model: Transformer,
    tp_mesh: DeviceMesh,
    *,
    loss_parallel: bool,
    enable_async_tp: bool,
    compile_enabled: bool = False,
) -> None:
    """Shard `model` (on any device, meta included) over `tp_mesh` in place.

    loss_parallel: leave the logits as a DTensor sharded over the vocabulary; the loss and its
        backward must then run under `loss_parallel_context(True)`.
    enable_async_tp: also switch on async TP (see `maybe_enable_async_tp`), which needs
        `compile_enabled`; checked before the model is touched.
    """
    if enable_async_tp:
        maybe_enable_async_tp(tp_mesh, compile_enabled=compile_enabled)
    if model.output is None:
        raise ConfigError(
            "parallelism.tensor_parallel_degree: this flavor ties the output projection to the embedding, "
            "which the TP plan does not shard; use tensor_parallel_degree = 1 or an untied flavor (e.g. llama3_8b)"
        )

    parallelize_module(
        model,
        tp_mesh,
        {
            # Rowwise over the vocabulary: each rank looks up the tokens of its vocabulary slice,
            # and the partial sums are reduce-scattered straight into sequence shards.
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                # A DTensor is what loss_parallel's cross-entropy dispatches on; without loss
                # parallel the gathered logits are an ordinary tensor again.
                use_local_output=not loss_parallel,
            ),
        },
    )
    model.tok_embeddings.register_forward_hook(_wait_async_output)
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                # `cos_sin` (None layout) is a plain tensor every rank holds in full: left alone.
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None),
                    desired_input_layouts=(Replicate(), None),
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
            },
        )


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
    # The only use of this private class in the repo.
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def maybe_enable_async_tp(tp_mesh: DeviceMesh, *, compile_enabled: bool) -> None:
    """Switch on async TP for `tp_mesh`, or raise a one-line ConfigError saying what is missing.

    Async TP is not a different sharding plan: it is an inductor pass (micro-pipeline TP) that
    splits each all-gather + matmul (and matmul + reduce-scatter) into chunks that overlap,
    using CUDA symmetric memory for the peer-to-peer copies. Hence the requirements.
    """
    problems = []
    if not compile_enabled:
        problems.append("compile.enable is false")
    backend = dist.get_backend(tp_mesh.get_group())
    if tp_mesh.device_type != "cuda" or not torch.cuda.is_available() or "nccl" not in backend:
        problems.append(f"the TP group runs on {tp_mesh.device_type} with {backend}")
    if tp_mesh.size() < 2:
        problems.append(f"tensor_parallel_degree is {tp_mesh.size()}")
    if problems:
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel: async TP needs compile.enable = true, CUDA with NCCL and "
            f"tensor_parallel_degree > 1, but {', '.join(problems)}; set it to false"
        )
    _enable_micro_pipeline_tp(tp_mesh)


def _enable_micro_pipeline_tp(tp_mesh: DeviceMesh) -> None:
    # Both switches are private PyTorch APIs (as of 2.13 there is no public one); torchtitan
    # uses the same two. Keep them in this one place.
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    # Read at compile time by inductor. Before PyTorch 2.8 private configs such as this one were
    # not part of the FX graph cache key (pytorch/pytorch PR #153672), so a plain-TP run could be
    # served an async-TP graph; `parallelisms.compile.inductor_cache_dir` keys the cache on it.
    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Context for the loss AND its backward: cross-entropy on vocabulary-sharded logits.

    Use it around both `loss_fn(logits, labels)` and `loss.backward()`; enabled = TP is on and
    parallelism.disable_loss_parallel is false (the same value given to `apply_tp`).
    """
    return loss_parallel() if enabled else contextlib.nullcontext()
