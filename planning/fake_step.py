"""The fake-tensor step (`python -m planning.estimate_memory ... --fake-step`): torch's own count of a whole training
step under FSDPMemTracker on fake tensors, the estimator's cross-check (docs/planning.md, "How the estimator
counts")."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

from models import with_seq_len
from planning.job import Job
from planning.memory import estimate_rank, layer_modes

GiB = 2**30

# -------------------------------------------------------------- fake-tensor step


# FSDPMemTracker's categories (torch.distributed._tools.fsdp2_mem_tracker._FSDPRefType values) -> ours.
_TRACKED = {
    "Sharded Param": "sharded_params",
    "Unsharded Param": "unsharded_params",
    "Buffer": "buffers",
    "Sharded Grad": "sharded_grads",
    "Unsharded Grad": "unsharded_grads",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "all_gather",
    "Reduce Scatter": "reduce_scatter",
    "OptState": "optimizer_state",
    "Inputs": "inputs",
}


def fake_step_memory(
    model: nn.Module,
    *,
    optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer],
    batch: int,
    seq_len: int,
    loss_fn: Callable[..., torch.Tensor],
    device: torch.device,
    param_dtype: torch.dtype = torch.bfloat16,
    loss_parallel: bool = False,
    microbatches: int = 1,
    accumulated: bool = False,
) -> dict[str, int]:
    """Bytes at the peak of one training step of `model`, by category, as torch's FSDPMemTracker counts
    them on fake tensors: no memory, no compute, no GPU.

    model: a Transformer, or one pipeline stage (parallelisms.pp.stage_module), built on the meta device
        and parallelized (parallelize_model, FSDP included) on a process group whose collectives do nothing
        (torch's "fake" backend). Its meta parameters become fake tensors on `device`, in place: the
        model serves no other purpose afterwards.
    The step is train.py's: zero_grad(set_to_none=True), then the forward with the loss inside
    (`model(inputs, head=partial(loss_fn, model, labels=labels))`) and its backward, of `batch` x
    `seq_len` tokens, under loss_parallel_context(loss_parallel). A stage without the embedding gets
    hidden states (batch, seq_len / tp, dim) in param_dtype; one without the output sends a gradient
    of its output back. `microbatches` forwards run before their backwards: what stage s of S holds
    under 1F1B with min(n_mb, S - s) of them; a stage's backwards then run as the pipeline runs them,
    without gradient sync or resharding. `accumulated`: the gradient shards of an earlier micro-batch
    exist (gradient accumulation).
    Not stepped under the tracker: the optimizer step (fake kernels allocate temporaries fused AdamW does
    not; its state is created before, from zero gradients, and counted) and the pipeline's end-of-step
    reduce-scatter. Returns the categories of _TRACKED and "total", in bytes, at the peak.
    """
    # Imported here: torch's tracking tools are for this check only.
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule

    from parallelisms.tp import loss_parallel_context

    if not isinstance(model, FSDPModule):
        raise ValueError(
            "fake_step_memory: the model is not FSDP-wrapped (a job of one rank is not: parallelisms/fsdp.py "
            "applies_fsdp); FSDPMemTracker needs FSDP's hooks"
        )
    last = model.norm is not None
    meshes = [p.device_mesh for p in model.parameters() if isinstance(p, DTensor)]
    tp = next((m.size(m.mesh_dim_names.index("tp")) for m in meshes if "tp" in (m.mesh_dim_names or ())), 1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=device)
        optimizer = _optimizer_with_state(model, optimizer_factory, accumulated=accumulated)
        labels = torch.randint(0, model.args.vocab_size, (batch, seq_len), device=device)
        x = _stage_input(model, batch=batch, seq_len=seq_len, tp=tp, device=device, dtype=param_dtype)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((x, labels))
        head = functools.partial(loss_fn, model, labels=labels) if last else None
        with tracker, loss_parallel_context(loss_parallel):
            # The same fake tensor for every micro-batch: a pipeline's received inputs cost no more than this.
            _forwards_then_backwards(model, tracker, [x] * microbatches, head=head)
        return _peak_by_category(tracker)


def _optimizer_with_state(
    model: nn.Module, optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer], *, accumulated: bool
) -> torch.optim.Optimizer:
    """The model's optimizer with its state created by a step on zero gradients, which stay as an earlier
    micro-batch's gradients when `accumulated` and are freed (train.py's zero_grad(set_to_none=True)) otherwise."""
    optimizer = optimizer_factory(model)
    for p in (p for group in optimizer.param_groups for p in group["params"]):  # what trains (LoRA: the adapters)
        p.grad = torch.zeros_like(p)
    optimizer.step()
    if not accumulated:
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def _stage_input(
    model: nn.Module, *, batch: int, seq_len: int, tp: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """A micro-batch's input: token ids (batch, seq_len) for the model or its first stage, else the hidden states a
    stage receives, (batch, seq_len / tp, dim) in param_dtype."""
    if model.tok_embeddings is not None:
        return torch.randint(0, model.args.vocab_size, (batch, seq_len), device=device)
    return torch.empty((batch, seq_len // tp, model.args.dim), device=device, dtype=dtype, requires_grad=True)


def _forwards_then_backwards(
    model: nn.Module, tracker: Any, inputs: list[torch.Tensor], *, head: Callable[..., torch.Tensor] | None
) -> None:
    """Every micro-batch's forward, then every backward; a pipeline stage's as torch.distributed.pipelining runs
    them (without gradient sync or resharding), and one without the loss (`head`) gets a gradient of its output."""
    stage = model.tok_embeddings is None or model.norm is None
    outputs = []
    for x in inputs:
        # The tracker refuses a second forward of the root module (it takes it for the next step); its per-module
        # statistics are all it resets, not the peak.
        tracker.reset_mod_stats()
        out = model(x, head=head)
        outputs.append(out.total if head is not None else out)  # the loss's total (loss.py LossTerms), or hidden states
    for out in outputs:
        if stage:
            model.set_requires_gradient_sync(False)
            model.set_reshard_after_backward(False)
        out.backward(None if head is not None else torch.empty_like(out))


def _peak_by_category(tracker: Any) -> dict[str, int]:
    """The bytes of FSDPMemTracker's peak snapshot, by category of _TRACKED, and their "total"."""
    peak: dict[str, int] = {}
    for snapshot in tracker.get_tracker_snapshot("peak").values():
        for kind, nbytes in snapshot.items():
            name = _TRACKED.get(getattr(kind, "value", kind), "total")
            peak[name] = peak.get(name, 0) + nbytes
    return peak


def fake_job_memory(job: Job, *, pp_rank: int = 0, device: str = "cpu") -> dict[str, int]:
    """fake_step_memory for `job`: pp rank `pp_rank`'s stage (the whole model without PP) built on the meta
    device, parallelized by parallelize_model on the job's fake ranks (this process rank 0 of them; it
    starts the fake process group unless one of job's ranks is running, and ends what it started),
    stepped with the micro-batches the stage holds at once (estimate_rank's microbatches_held).

    Single-stage schedules only (1F1B, GPipe): an interleaved rank's stages interleave their
    micro-batches, which one fake step of one module does not reproduce (estimate_rank replays them).
    Not under context parallel (the fake step does not cut windows), and with AdamW only (Muon's exchange, muon.py,
    exchanges every rank's block indices once through real collectives).
    """
    if job.dims.cp > 1:
        raise ValueError("context parallel (cp > 1) is estimated by the formulas only (the breakdown above)")
    if job.muon:  # its exchange plans every rank's blocks once with real collectives
        raise ValueError(
            "optimizer Muon is estimated by the formulas only (the breakdown above); the fake step is AdamW's"
        )
    from config import Compile
    from loss import Loss
    from parallelisms.parallelize import parallelize_model
    from parallelisms.pp import stage_module

    if job.dims.pp > 1 and len(job.stages) != job.dims.pp:
        raise ValueError(
            f"fake_job_memory: {job.cfg.parallelism.pipeline_parallel_schedule} runs {len(job.stages) // job.dims.pp} stages per rank; "
            "only single-stage schedules (1F1B, GPipe) are stepped on fake tensors"
        )
    started = not dist.is_initialized()
    if started:
        # Registers torch's "fake" backend (torch.testing, torch 2.13): collectives that return at once.
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=job.dims.world_size)
    elif dist.get_world_size() != job.dims.world_size:
        raise ValueError(
            f"fake_job_memory: a process group of {dist.get_world_size()} ranks runs, the job has {job.dims.world_size}"
        )
    try:
        # The run's config as the job holds it, without what a fake step cannot run: no converter, nothing compiled,
        # CPU offload only where the machine has CUDA; mode "auto" refused (chosen where the job starts).
        layer_modes(job, [0])
        t = job.cfg.training
        cfg = dataclasses.replace(
            job.cfg,
            model=dataclasses.replace(job.cfg.model, converters=[]),
            training=dataclasses.replace(t, enable_cpu_offload=job.cpu_offload, loss_chunk_tokens=job.chunk_tokens),
            compile=Compile(enable=False),
        )
        dims = job.dims
        mesh = dims.build_mesh(device)
        with torch.device("meta"):
            model = job.fam.model_cls(with_seq_len(job.args, t.seq_len))
        if job.dims.pp > 1:
            stages, g = job.stages, pp_rank
            model = stage_module(model, stages[g], first=g == 0, last=g == len(stages) - 1)
        model = parallelize_model(model, cfg, dims=dims, mesh=mesh, device=torch.device(device))
        return fake_step_memory(
            model,
            optimizer_factory=lambda m: torch.optim.AdamW(
                [p for p in m.parameters() if p.requires_grad], lr=1e-4, fused=True
            ),
            batch=job.microbatch_tokens // t.seq_len,
            seq_len=t.seq_len,
            loss_fn=Loss(job.chunk_tokens),
            device=torch.device(device),
            param_dtype=getattr(torch, t.mixed_precision_param),
            loss_parallel=job.dims.tp > 1,
            microbatches=int(estimate_rank(job, pp_rank, tp_mesh=mesh["tp"])["microbatches_held"]),
            accumulated=job.grad_accum > 1,
        )
    finally:
        if started:
            dist.destroy_process_group()
