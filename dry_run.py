"""A dry run: rank 0's view of a WORLD_SIZE-rank job, on this machine, without GPUs or weights.

    WORLD_SIZE=512 python train.py --config configs/llama3_405b.toml --comm.mode=fake_backend
    WORLD_SIZE=64 LOCAL_WORLD_SIZE=8 python train.py --config configs/llama3_70b.toml --comm.mode=fake_backend

`[comm] mode = "fake_backend"` (torchtitan's key) makes train.py call `run` instead of training. The
process group is a fake one (torch's FakeProcessGroup: every collective returns at once, nothing is
sent) with WORLD_SIZE ranks, of which this process is rank 0; the model lives on the meta device
(shapes, no storage). Everything else is the real start-up: the config's and the doctor's rules,
the mesh, the pipeline stages, and parallelize_model's TP, AC, compile wrappers and FSDP on rank
0's stages. Printed:

    layout    the degrees, micro-batches, stages and the blocks of each
    groups    the ranks rank 0 shares each mesh dimension with, and how many such groups exist
    params    parameters rank 0 holds (its local shards, counted on the parallelized model)
    memory    estimate_memory.py's prediction for the busiest rank, allocated and reserved
    comm      bytes each rank moves per step, per mesh dimension (the formulas of `comm_per_step`)
    doctor    doctor.py's findings for the target machine: CUDA, LOCAL_WORLD_SIZE GPUs per node
              (default 8) of 80 GiB each
    inputs    the data, tokenizer and weights the job reads that this machine lacks: notes, not errors

Async TP (a CUDA-only compiler pass) is checked against a CUDA + NCCL machine and then left off
(parallelize_model's planning), and nothing is compiled: compile wraps blocks lazily.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import doctor
from config import (
    JobConfig,
    dry_run_world,
    global_batch_size,
    input_problems,
    model_label,
    run_model_args,
)
from estimate_memory import GiB, Job, checkpointed_blocks, cp_kv_bytes, estimate, job_costs, job_of
from loss import Loss
from models import family
from parallelisms.fsdp import DTYPES, reshards_after_forward
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import build_run_model
from parallelisms.pp import check_microbatches, rank_stages, stage_layers


def run(cfg: JobConfig) -> int:
    """Print the plan of rank 0 of $WORLD_SIZE ranks; exit status 1 when a check finds an error (the job would fail)."""
    start = time.perf_counter()
    world_size, gpus_per_node, problems = dry_run_world()  # load_config refused bad variables
    assert not problems, problems
    par = cfg.parallelism
    dims = ParallelDims.from_config(par, world_size=world_size)
    lines: list[str] = []
    errors = False
    # The fake process group: rank 0 of world_size. (A private module of torch's tests, PyTorch 2.13; torchtitan
    # uses the same one for its fake_backend mode.)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = dims.build_mesh("cpu")
        args = run_model_args(cfg)
        model, pipeline = build_run_model(  # as train.py builds it
            cfg, args, dims=dims, mesh=mesh, loss_fn=Loss(), device=torch.device("cpu"), planning=True
        )
        parts = pipeline.parts if pipeline else [model]
        local = sum(_local_numel(p) for part in parts for p in part.parameters())
        lines += plan_lines(cfg, dims, args, mesh=mesh, local_params=local, job=job_of(cfg, dims, cuda=True))
    finally:
        dist.destroy_process_group()
    # Optional parts (doctor.py): each adds its lines and says whether it found an error. The GPUs planned for
    # are H100s, 80 GiB each.
    errors |= doctor.add_plan_report(
        lines, cfg, world_size=world_size, gpus_per_node=gpus_per_node, device_memory_gib=80
    )
    if notes := input_problems(cfg):
        lines += ["", "inputs the job reads that this machine lacks (its machines need them, a dry run does not):"]
        lines += [f"  {note}" for note in notes]
    lines.append(f"\ndry run of rank 0 of {world_size} in {time.perf_counter() - start:.1f} s; nothing was allocated")
    print("\n".join(lines), flush=True)
    return 1 if errors else 0


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def plan_lines(
    cfg: JobConfig, dims: ParallelDims, args: Any, *, mesh: DeviceMesh, local_params: int, job: Job
) -> list[str]:
    """The plan's lines before the doctor's: layout, groups, params, memory and comm (the module docstring)."""
    t, par = cfg.training, cfg.parallelism
    global_batch = global_batch_size(t, dp=dims.dp)
    grad_accum = global_batch // (t.local_batch_size * dims.dp)
    total = family(cfg.model.name).num_params(args)
    lines = [
        f"{model_label(cfg)}: {total / 1e9:.2f}B parameters on {dims.world_size} ranks = pp {dims.pp} x "
        f"{dims.describe()} | global batch {global_batch} x "
        f"{t.seq_len} tokens, local batch {t.local_batch_size}, grad accumulation {grad_accum}",
    ]
    if dims.pp_enabled:
        layers = stage_layers(args, par)
        n_mb = check_microbatches(
            pp=dims.pp,
            schedule=par.pipeline_parallel_schedule,
            microbatch_size=par.pipeline_parallel_microbatch_size,
            local_batch_size=t.local_batch_size,
        )
        ours = rank_stages(0, pp=dims.pp, stages=len(layers))
        lines.append(
            f"pipeline: {par.pipeline_parallel_schedule}, {len(layers)} stages ({len(layers) // dims.pp} per rank), "
            f"{n_mb} micro-batches of {par.pipeline_parallel_microbatch_size} per step; blocks per stage: "
            + " ".join(str(len(s)) for s in layers)
            + f"; rank 0 runs stage(s) {', '.join(map(str, ours))} (embedding + blocks "
            + ", ".join(f"{s[0]}-{s[-1]}" if s else "none" for s in (layers[i] for i in ours))
            + ")"
        )
    lines += ["", "groups of rank 0 (ranks; how many such groups):"]
    for name in mesh.mesh_dim_names:
        ranks = mesh[name].mesh.flatten().tolist()
        shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
        lines.append(f"  {name:<13} {len(ranks):>4} ranks [{shown}]; {dims.world_size // len(ranks)} groups")
    even = total / dims.world_size * dims.dp_replicate
    lines += [
        "",
        f"parameters on rank 0: {local_params:,} ({local_params / total:.3%} of {total:,}; an even split over the "
        f"{dims.world_size // dims.dp_replicate} ranks of one replica would be {even:,.0f})",
    ]
    tp_mesh = mesh["tp"] if dims.tp_enabled else None
    lines += ["", *memory_lines(job, pp=dims.pp_enabled, tp_mesh=tp_mesh)]
    lines += ["", "communication per step and rank (ring algorithms: bytes each rank sends):"]
    for name, (nbytes, what) in comm_per_step(cfg, dims, job, grad_accum=grad_accum, tp_mesh=tp_mesh).items():
        lines.append(f"  {name:<13} {nbytes / GiB:9.2f} GiB   {what}")
    return lines


def memory_lines(job: Job, *, pp: bool, tp_mesh: DeviceMesh | None) -> list[str]:
    """estimate_memory.py's prediction for the pp rank that needs the most (the doctor's Job of this run)."""
    e = estimate(job, tp_mesh=tp_mesh)
    where = f" on pp rank {e['pp_rank']}" if pp else ""
    return [
        f"memory per GPU{where} (estimate_memory.py): {e['allocator_peak'] / GiB:.1f} GiB allocated at the peak "
        f"({e['peak_phase']}), {e['reserved'] / GiB:.1f} GiB reserved by the caching allocator, "
        f"{e['total'] / GiB:.1f} GiB with CUDA context + NCCL"
    ]


def comm_per_step(
    cfg: JobConfig, dims: ParallelDims, job: Job, *, grad_accum: int, tp_mesh: DeviceMesh | None = None
) -> dict[str, tuple[float, str]]:
    """Bytes each rank sends per optimizer step over each mesh dimension, by ring algorithms: an all-gather or
    reduce-scatter of N bytes (the full tensor) costs each of g ranks (g - 1) / g x N, an all-reduce twice that.

    dp_shard  FSDP (over dp_shard x cp: the line is "cp" when dp_shard is 1, "dp_shard_cp" when both are > 1): each
              micro-batch's forward all-gathers the rank's stage in param_dtype, backward gathers
              it again (not with parallelism.fsdp_reshard_after_forward = "never"; under PP the stage stays
              gathered for the whole step) but for the root unit, final norm and output, which FSDP2 keeps
              gathered from its forward to its backward, and the embedding, whose backward does not read it,
              and reduce-scatters every gradient in reduce_dtype (once per step under PP or with
              parallelism.fsdp_defer_reduce_scatter).
    cp        context parallel: per block of the rank's stages and micro-batch, an all-gather of the window's
              keys and values forward, a reduce-scatter of their gradients backward, and another all-gather
              where AC recomputes the block (not under op SAC, which keeps the gathered tensors).
    dp_repl.  HSDP: an all-reduce of the gradient shards once per step, whatever the micro-batches (train.py defers it
              to the last, parallelisms/fsdp.py sync_gradients_on; pipeline stages sync once anyway).
    tp        the collectives of the family's TP plan as one traced block runs them (estimate_memory.block_costs:
              forward, backward, and what AC recomputes), per block of the rank's stages and micro-batch, plus
              the embedding's (stage 0) and those of the final norm, output projection and loss (the last stage),
              and the all-reduce of the gradients of the weights TP leaves whole (the norms'), per micro-batch.
    pp        each micro-batch's activations forward and their gradients backward across each stage boundary.
    """
    t, par = cfg.training, cfg.parallelism
    args = job.args
    param_bytes, reduce_bytes = DTYPES[t.mixed_precision_param].itemsize, DTYPES[t.mixed_precision_reduce].itemsize
    ring = lambda g: (g - 1) / g  # noqa: E731
    pp, tp, rep, cp = dims.pp, dims.tp, dims.dp_replicate, dims.cp
    fsdp = dims.dp_shard * cp  # the ranks FSDP shards over; its line is named after their mesh dimension(s)
    fsdp_dim = "dp_shard" if cp == 1 else "cp" if dims.dp_shard == 1 else "dp_shard_cp"
    stage_params = family(cfg.model.name).num_params(args) / pp  # an average stage
    local_tokens = t.local_batch_size * t.seq_len // cp
    # Rank 0's (virtual) stages and their blocks: without PP, one stage of all blocks.
    layers = stage_layers(args, par) if pp > 1 else [list(range(args.n_layers))]
    ours = rank_stages(0, pp=pp, stages=len(layers)) if pp > 1 else [0]
    blocks = sum(len(layers[s]) for s in ours)
    costs = job_costs(job, tp_mesh=tp_mesh)
    resharded = reshards_after_forward(par.fsdp_reshard_after_forward, pp_enabled=pp > 1)
    gathers = 2 * grad_accum if resharded else (1 if pp > 1 else grad_accum)
    syncs = 1 if pp > 1 or par.fsdp_defer_reduce_scatter else grad_accum
    out: dict[str, tuple[float, str]] = {}
    if fsdp > 1:
        gathered = gathers * stage_params / tp
        if resharded:  # backward gathers neither the embedding nor (without PP) the root unit, still gathered
            gathered -= grad_accum * (costs.embedding_params + (costs.root_params if pp == 1 else 0))
        nbytes = ring(fsdp) * (gathered * param_bytes + syncs * reduce_bytes * stage_params / tp)
        out[fsdp_dim] = (
            nbytes,
            f"FSDP: {gathers} all-gather(s) of the stage in {t.mixed_precision_param}, "
            f"{syncs} reduce-scatter(s) of its gradients in {t.mixed_precision_reduce}",
        )
    if rep > 1:
        out["dp_replicate"] = (
            2 * ring(rep) * reduce_bytes * stage_params / tp / fsdp,
            "HSDP: gradient shards all-reduced once per step",
        )
    if tp > 1:
        # Rank 0's blocks, the embedding (stage 0, always rank 0's), the head and loss (the last stage's).
        last = len(layers) - 1 in ours
        outside = sum(costs.tp_embedding) + (sum(costs.tp_head) if last else 0)
        # The gradients of what TP leaves whole (the norms' weights), all-reduced by each backward: 2x a ring's bytes.
        replicated = blocks * costs.tp_replicated[0] + (costs.tp_replicated[1] if last else 0)
        # A micro-batch of the pipeline is 1/microbatches of the local batch; the costs are per micro-batch.
        per_local_batch = job.microbatches * (sum(costs.tp_block) * blocks + outside + 2 * param_bytes * replicated)
        out["tp"] = (
            ring(tp) * per_local_batch * grad_accum,
            "the TP plan's all-gathers and reduce-scatters, "
            "traced on one block: forward, backward and AC's recomputation; the unsplit weights' gradients all-reduced",
        )
    if cp > 1:
        recomputed = 0 if job.ac == "selective-op" else sum(checkpointed_blocks(len(layers[s]), job.ac) for s in ours)
        passes = 2 * blocks + recomputed  # forward's all-gathers, backward's reduce-scatters, AC's re-gathers
        kv = ring(cp) * passes * cp_kv_bytes(job)["gathered"] * job.microbatches * grad_accum
        what = "keys and values all-gathered per block (and gradients reduce-scattered), forward, backward, AC"
        shared = out.get("cp")  # FSDP's line when it shards over the CP ranks alone
        out["cp"] = (shared[0] + kv, f"{shared[1]}; {what}") if shared else (kv, what)
    if pp > 1:  # rank 0's stages: each but the last sends activations, each but the first gradients
        crossings = sum(s != len(layers) - 1 for s in ours) + sum(s != 0 for s in ours)
        boundary = local_tokens / tp * args.dim * param_bytes
        out["pp"] = (
            crossings * boundary * grad_accum,
            f"sends of every micro-batch's hidden states: {crossings} per "
            "micro-batch (activations forward, their gradients backward)",
        )
    return out
