"""FSDP2 (`fully_shard`): per-block sharding, mixed precision, CPU offload, HSDP; autocast where one rank trains alone."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

if TYPE_CHECKING:
    from config import Training
    from parallelisms.parallel_dims import ParallelDims

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def applies_fsdp(dims: ParallelDims, *, param_dtype: str, cpu_offload: bool) -> bool:
    """Whether parallelize_model shards the model with FSDP (apply_fsdp) rather than leaving its parameters whole.

    FSDP where there is something to shard over (data-parallel ranks, or CP's), for CPU offload (its policy is
    FSDP's), and for a compute dtype other than float32 on a job of several ranks without data parallelism (TP or
    PP alone): FSDP over a mesh of one is what gives their parameters a compute dtype (torchtitan trains those in
    float32). A job of one rank trains its float32 parameters under autocast instead (`autocast_dtype`), as
    torchtitan does: FSDP over one rank would copy every parameter into the compute dtype for forward, again for
    backward, and every gradient out of it, each step, to shard over nobody (benchmarks/vs_torchtitan.py counts it)."""
    mixed = param_dtype != "float32"
    return dims.fsdp_enabled or cpu_offload or (mixed and dims.world_size > 1)


def autocast_dtype(dims: ParallelDims, training: Training) -> torch.dtype | None:
    """The dtype a job's forward runs in under autocast (`autocast`): training.mixed_precision_param where FSDP does
    not apply it (a job of one rank, `applies_fsdp`) and it is not float32; None where FSDP's mixed precision gives
    the parameters their compute dtype, or the job computes in float32."""
    param_dtype = training.mixed_precision_param
    if param_dtype == "float32" or applies_fsdp(dims, param_dtype=param_dtype, cpu_offload=training.enable_cpu_offload):
        return None
    return DTYPES[param_dtype]


def autocast(dtype: torch.dtype | None, device_type: str) -> contextlib.AbstractContextManager:
    """Mixed precision without FSDP (one rank, `autocast_dtype`): the caller runs the model's forward, the loss
    included (it runs inside it, loss.py), in this context, under torch.autocast in `dtype`; a context that does
    nothing for None. Parameters, gradients and AdamW's state stay float32, and backward runs outside the context, as
    autocast wants: each op's backward runs in the dtype its forward ran in.

    Without autocast's cache (cache_enabled=False): with it, every weight's bf16 copy would stay alive until the
    forward ends, the loss included, which is the peak. Without it a weight is cast where it is used (once per
    forward in these models; the output projection once per loss chunk) and its copy lives only while autograd
    keeps it: a block under activation checkpointing casts again in its recomputation and keeps nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def reshards_after_forward(policy: str, *, pp_enabled: bool) -> bool:
    """Whether the embedding and the blocks are freed after forward and gathered again for backward (the
    root unit never is, nor the embedding for backward: apply_fsdp); the dry run counts traffic by it."""
    if policy not in ("default", "always", "never"):
        raise ValueError(f"reshard_after_forward: expected 'default', 'always' or 'never', got {policy!r}")
    return policy == "always" or (policy == "default" and not pp_enabled)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool = False,
    reshard_after_forward: Literal["default", "always", "never"] = "default",
    pp_enabled: bool = False,
    experts: tuple[str, DeviceMesh] | None = None,
) -> None:
    """Shard the embedding and each block as separate units, then the root (norm + output).

    `mesh` is 1-D for FSDP and 2-D ("dp_replicate", "dp_shard") for HSDP: parameters are
    sharded over the inner dimension and replicated over the outer one, so all-gathers and
    reduce-scatters stay inside a node and only gradient shards cross nodes (docs/failures.md #3).

    One unit per block bounds the unsharded memory to about one block at a time, which is all
    the old `transformer_auto_wrap_policy` bought (docs/failures.md #5); bf16 `param_dtype` halves
    the gathered parameters and the all-gather traffic; fp32 `reduce_dtype` keeps gradient
    reductions exact.

    reshard_after_forward (parallelism.fsdp_reshard_after_forward): "default" and "always" free the
    gathered parameters of the embedding and of every block after their forward (torchtitan's
    "always" also frees a norm + output unit, which this recipe keeps in the root, see below);
    "never" keeps all gathered from forward to backward (no second all-gather, ZeRO-2-like memory).
    Under pipeline parallel (pp_enabled, `model` is one stage) "default" means "never": a stage runs
    several micro-batches' forwards before their backwards, and resharding would gather its
    parameters again for each of them (torchtitan's rule).

    experts: (name inside a block, mesh) of expert parallel's experts (parallelisms/ep.py), each block's a unit of its
    own over that mesh (the ranks ep leaves), before the block. Their gradients arrive summed over the ep ranks by
    the all-to-all's backward, so FSDP divides them by `mesh`'s size, the data-parallel ranks the other gradients are
    averaged over, not by their own mesh's. Sharded on dim 0 (experts) where each ep rank's experts split evenly over
    that mesh, else on dim 1 (torchtitan's rule: a padded shard of whole experts would gather more than it holds).
    """
    reshard = reshards_after_forward(reshard_after_forward, pp_enabled=pp_enabled)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinned host memory needs a CUDA driver; on a CPU-only machine the default
    # pin_memory=True fails, so pin only where CUDA exists.
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)

    # With tied embeddings the matrix is used first and last: keep it in the root unit,
    # which stays gathered for the whole forward, instead of a unit of its own.
    if model.output is not None and model.tok_embeddings is not None:  # None: a pipeline stage without it
        fully_shard(model.tok_embeddings, **kw, reshard_after_forward=reshard)
        # An embedding's backward reads the token ids, never the table: its gradient is the output
        # gradient added into the rows of those ids. So backward does not gather the table again (one
        # all-gather of vocab x dim less per step where it was resharded after forward; what that is at
        # 8B: docs/benchmarks.md); its gradient is reduce-scattered as any other.
        model.tok_embeddings.set_unshard_in_backward(False)
    for block in model.layers.values():
        if experts is not None:
            name, experts_mesh = experts
            module = block.get_submodule(name)
            local = next(module.parameters()).to_local().shape[0]  # this ep rank's experts
            dim = 0 if local % experts_mesh.shape[-1] == 0 else 1
            fully_shard(
                module,
                **{**kw, "mesh": experts_mesh},
                reshard_after_forward=reshard,
                shard_placement_fn=lambda _, dim=dim: Shard(dim),
            )
            module.set_gradient_divide_factor(mesh.size())
            if experts_mesh.device_type == "cpu" and experts_mesh.size() > 1:
                # gloo has no PREMUL_SUM: sum, then divide. (Not on one rank: PyTorch 2.13 would divide twice.)
                module.set_force_sum_reduction_for_comms(True)
        fully_shard(block, **kw, reshard_after_forward=reshard)
    # The final norm and the output projection stay in the root unit, which FSDP never reshards
    # between forward and backward: the chunked loss (loss.py) calls the projection once per chunk
    # in forward and again in backward's recomputation, and a unit of their own would be gathered
    # once more per step for it (counted: 8 all-gathers instead of 7, 10 instead of 8 under
    # "always", tests/test_loss.py). The peak, at the loss, holds these parameters either way.
    fully_shard(model, **kw, reshard_after_forward=False)  # FSDP never reshards the root after forward anyway


def sync_gradients_on(model: nn.Module, *, last_microbatch: bool, defer_reduce_scatter: bool) -> None:
    """Gradients cross replicas once per step, on its last micro-batch (ForwardBackward calls this before each
    backward of a step of several micro-batches, with the run's parallelism.fsdp_defer_reduce_scatter).

    FSDP2 reduce-scatters and, under HSDP (`data_parallel_replicate_degree` > 1, the replicas usually on other
    nodes), all-reduces every unit's gradient shard after every backward; with gradient accumulation that is one
    all-reduce over the slowest links per micro-batch where one per step is all the step needs. By default each
    micro-batch but the last still reduce-scatters (the gradients stay sharded, memory does not grow) and FSDP sums
    the shards in a buffer of their size (`set_requires_all_reduce(False)`); the last adds its own and all-reduces
    the sum once. With `defer_reduce_scatter` (parallelism.fsdp_defer_reduce_scatter) the micro-batches
    but the last do not reduce-scatter either (`set_requires_gradient_sync(False)`): each unit's gradient stays
    unsharded, summed in reduce_dtype (FSDP2 upcasts it), and the last reduce-scatters and all-reduces the sum once:
    1 / micro-batches the reduce-scatter bytes, for a reduce_dtype copy of the rank's whole parameters held through
    the step (planning/estimate_memory.py's "gradient accumulators"). Either way only the sum changes place: the gradients
    are those of one reduction per micro-batch up to float32 rounding (tests/test_parallelisms.py, parity with one
    process). A model without FSDP (one rank) has nothing to defer. Pipeline stages already sync once per step
    (torch.distributed.pipelining). A step abandoned half-way (a stop request) leaves the sum behind and ends the
    run."""
    if not isinstance(model, FSDPModule):
        return
    if defer_reduce_scatter:
        model.set_requires_gradient_sync(last_microbatch)
    else:
        model.set_requires_all_reduce(last_microbatch)
