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
    memory    planning/estimate_memory.py's prediction for the busiest rank, allocated and reserved
    comm      bytes each rank moves per step, per mesh dimension (the formulas of `comm_per_step`), and the
              layout's floor with what each of its settings adds (`comm_floor`)
    doctor    planning/doctor.py's findings for the target machine: CUDA, LOCAL_WORLD_SIZE GPUs per node
              (default 8) of 80 GiB each
    inputs    the data, tokenizer and weights the job reads that this machine lacks: notes, not errors

Async TP (a CUDA-only compiler pass) is checked against a CUDA + NCCL machine and then left off, and nothing is
compiled: compile wraps blocks lazily.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from config import (
    ActivationCheckpoint,
    JobConfig,
    dry_run_world,
    float8_settings,
    global_batch_size,
    model_label,
    run_model_args,
)
from data.inputs import input_problems
from loss import Loss
from models import family
from parallelisms.async_tp import require_async_tp
from parallelisms.ep import all_to_all_bytes
from parallelisms.float8 import converts, gathers_float8
from parallelisms.fsdp import DTYPES, applies_fsdp, reshards_after_forward
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import build_model
from parallelisms.pp import check_microbatches, rank_stages, stage_layers
from planning import doctor
from planning.exchanges import cp_kv_bytes
from planning.job import Job, Machine
from planning.memory import (
    GiB,
    estimate,
    hidden_matrices,
    job_costs,
    layer_modes,
    mode_costs,
    one_block_model,
    resolve_auto_ac,
    tp_rank_elements,
)
from planning.trace import BlockCosts

PLANNED_GPU_GIB = 80  # the GPUs a dry run plans for: H100s, 80 GiB each
PLANNED = Machine(cuda=True, device_memory_gib=PLANNED_GPU_GIB)


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
        # Mode "auto" chosen for the GPUs planned for, as train.py chooses it on them.
        tp_mesh = mesh["tp"] if dims.tp_enabled else None
        cfg, choice = resolve_auto_ac(cfg, world_size=world_size, machine=PLANNED, tp_mesh=tp_mesh)
        lines += [f"activation_checkpoint.mode = auto: {choice.describe()}", ""] if choice is not None else []
        args = run_model_args(cfg)
        model, pipeline = build_model(  # as train.py builds it, async TP checked and left off (_without_async_tp)
            _without_async_tp(cfg, dims), args, dims=dims, mesh=mesh, loss_fn=Loss(), device=torch.device("cpu")
        )
        parts = pipeline.parts if pipeline else [model]
        local = sum(_local_numel(p) for part in parts for p in part.parameters())
        job = Job.of(cfg, PLANNED, world_size=dims.world_size)
        lines += plan_lines(cfg, dims, args, mesh=mesh, local_params=local, job=job)
    finally:
        dist.destroy_process_group()
    # Optional parts (planning/doctor.py): each adds its lines and says whether it found an error.
    errors |= doctor.add_plan_report(
        lines, cfg, world_size=world_size, gpus_per_node=gpus_per_node, device_memory_gib=PLANNED_GPU_GIB
    )
    if notes := input_problems(cfg):
        lines += ["", "inputs the job reads that this machine lacks (its machines need them, a dry run does not):"]
        lines += [f"  {note}" for note in notes]
    lines.append(f"\ndry run of rank 0 of {world_size} in {time.perf_counter() - start:.1f} s; nothing was allocated")
    print("\n".join(lines), flush=True)
    return 1 if errors else 0


def _without_async_tp(cfg: JobConfig, dims: ParallelDims) -> JobConfig:
    """Async TP checked against the CUDA + NCCL machine planned for (parallelisms/async_tp.py's rule: ConfigError
    where it could not run there), then the config to build with it off: its switches are compiler passes for a real
    TP group, which the fake process group is not; what it changes in the blocks is in no printed number."""
    par, compile = cfg.parallelism, cfg.compile
    if not par.enable_async_tensor_parallel:
        return cfg
    require_async_tp(
        compile_enabled=compile.enable and "model" in compile.components,
        tp_degree=dims.tp,
        device_type="cuda",
        backend="nccl",
    )
    return dataclasses.replace(cfg, parallelism=dataclasses.replace(par, enable_async_tensor_parallel=False))


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
    groups = {name: mesh[name] for name in mesh.mesh_dim_names}
    if dims.ep_enabled:  # expert parallel's layout of the dp_shard x cp x tp ranks (ParallelDims.expert_meshes)
        groups["ep"], groups["efsdp"] = dims.expert_meshes(mesh)
    for name, group in groups.items():
        ranks = group.mesh.flatten().tolist()
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
    floor, excesses = comm_floor(cfg, dims, job, grad_accum=grad_accum, tp_mesh=tp_mesh)
    over = [
        f"{cause} {gib:+.2f}" for cause, added in excesses.items() if abs(gib := sum(added.values()) / GiB) >= 0.005
    ]
    lines.append(
        f"  the floor of this layout {sum(floor.values()) / GiB:.2f} GiB (docs/planning.md)"
        + (f"; over it, in GiB: {', '.join(over)}" if over else "")
    )
    return lines


def memory_lines(job: Job, *, pp: bool, tp_mesh: DeviceMesh | None) -> list[str]:
    """planning/estimate_memory.py's prediction for the pp rank that needs the most (the doctor's Job of this run)."""
    e = estimate(job, tp_mesh=tp_mesh)
    where = f" on pp rank {e['pp_rank']}" if pp else ""
    return [
        f"memory per GPU{where} (planning/estimate_memory.py): {e['allocator_peak'] / GiB:.1f} GiB allocated at the peak "
        f"({e['peak_phase']}), {e['reserved'] / GiB:.1f} GiB reserved by the caching allocator, "
        f"{e['total'] / GiB:.1f} GiB with CUDA context + NCCL"
    ]


def comm_per_step(
    cfg: JobConfig, dims: ParallelDims, job: Job, *, grad_accum: int, tp_mesh: DeviceMesh | None = None
) -> dict[str, tuple[float, str]]:
    """Bytes each rank sends per optimizer step over each mesh dimension (`comm_by_kind`'s, summed), and by what."""
    return {
        dim: (sum(kinds.values()), what)
        for dim, (kinds, what) in _comm(cfg, dims, job, grad_accum=grad_accum, tp_mesh=tp_mesh).items()
    }


def comm_by_kind(
    cfg: JobConfig,
    dims: ParallelDims,
    job: Job,
    *,
    grad_accum: int,
    tp_mesh: DeviceMesh | None = None,
    norm_values: int | None = None,
) -> dict[str, float]:
    """Bytes each rank sends per step, by "<mesh dimension> <collective>" (all_gather, reduce_scatter, all_reduce,
    send), as tests.instruments.CollectiveLog names what it measures. `norm_values`: see `_comm`."""
    per_dim = _comm(cfg, dims, job, grad_accum=grad_accum, tp_mesh=tp_mesh, norm_values=norm_values)
    return {f"{dim} {kind}": nbytes for dim, (kinds, _) in per_dim.items() for kind, nbytes in kinds.items() if nbytes}


def _comm(
    cfg: JobConfig,
    dims: ParallelDims,
    job: Job,
    *,
    grad_accum: int,
    tp_mesh: DeviceMesh | None = None,
    norm_values: int | None = None,
) -> dict[str, tuple[Counter[str], str]]:
    """Bytes each rank sends per optimizer step over each mesh dimension, by ring algorithms: an all-gather or
    reduce-scatter of N bytes (the full tensor) costs each of g ranks (g - 1) / g x N, an all-reduce twice that.

    dp_shard  FSDP (over dp_shard x cp: the line is "cp" when dp_shard is 1, "dp_shard_cp" when both are > 1): each
              micro-batch's forward all-gathers the rank's stage in param_dtype (float8 weights: `_float8_all_gather`),
              backward again (not with fsdp_reshard_after_forward = "never"; under PP the stage stays gathered for the
              step) but the root unit (kept gathered from forward to backward) and the embedding (backward does not
              read it); every gradient is reduce-scattered in reduce_dtype (once a step under PP or with
              fsdp_defer_reduce_scatter).
    cp        context parallel: per block of the rank's stages and micro-batch, an all-gather of the window's keys and
              values forward, a reduce-scatter of their gradients backward, and another all-gather where AC recomputes
              the block (not under op SAC, which keeps the gathered tensors).
    dp_repl.  HSDP: an all-reduce of the gradient shards once per step (parallelisms/fsdp.py sync_gradients_on).
    tp        the family's TP plan's collectives as one traced block runs them (planning.trace.block_costs: forward,
              backward, AC's recomputation) per block and micro-batch, the embedding's and head's (first and last
              stage), and the all-reduce of the gradients of the weights TP leaves whole (the norms'), per micro-batch.
    pp        each micro-batch's activations forward and their gradients backward across each stage boundary.
    norm      the gradient norm's all-reduces: a float32 per parameter tensor of the rank (`norm_values`: so many instead)
              over each dimension that shards parameters, one over the pipeline stages. ep, efsdp: `_ep`.
    muon      optimizer.name = "Muon": its exchange of the hidden matrices' blocks (`_muon`, muon.py).
    """
    t, par, args = cfg.training, cfg.parallelism, job.args
    param_bytes, reduce_bytes = DTYPES[t.mixed_precision_param].itemsize, DTYPES[t.mixed_precision_reduce].itemsize
    ring = lambda g: (g - 1) / g  # noqa: E731
    pp, tp, rep, cp = dims.pp, dims.tp, dims.dp_replicate, dims.cp
    fsdp = dims.dp_shard * cp  # the ranks FSDP shards over; its line is named after their mesh dimension(s)
    fsdp_dim = "dp_shard" if cp == 1 else "cp" if dims.dp_shard == 1 else "dp_shard_cp"
    local_tokens = t.local_batch_size * t.seq_len // cp
    # Rank 0's (virtual) stages and their blocks: without PP, one stage of all blocks.
    layers = stage_layers(args, par) if pp > 1 else [list(range(args.n_layers))]
    ours = rank_stages(0, pp=pp, stages=len(layers)) if pp > 1 else [0]
    blocks, first, last = sum(len(layers[s]) for s in ours), 0 in ours, len(layers) - 1 in ours
    modes = [mode for s in ours for mode in layer_modes(job, layers[s])]  # each block's AC
    costs = job_costs(job, tp_mesh=tp_mesh)  # parameters counted on one TP rank
    held, held_tensors = _dense_held(cfg, dims, costs, args, blocks=blocks, first=first, last=last)
    resharded = reshards_after_forward(par.fsdp_reshard_after_forward, pp_enabled=pp > 1)
    gathers = 2 * grad_accum if resharded else (1 if pp > 1 else grad_accum)
    syncs = 1 if pp > 1 or par.fsdp_defer_reduce_scatter else grad_accum
    norm = 2 * 4 * (norm_values or held_tensors)  # DTensor all-reduces the norm of each parameter tensor
    out: dict[str, tuple[Counter[str], str]] = {}
    if fsdp > 1:
        gathered = gathers * held
        if resharded:  # backward gathers neither the embedding nor (without PP) the root unit, still gathered
            gathered -= grad_accum * (costs.embedding_params + (costs.root_params if pp == 1 else 0))
        out[fsdp_dim] = (
            Counter(
                all_gather=ring(fsdp) * gathered * param_bytes,
                reduce_scatter=ring(fsdp) * syncs * reduce_bytes * held,
                all_reduce=ring(fsdp) * norm,
            ),
            f"FSDP: {gathers} all-gather(s) of the stage in {t.mixed_precision_param}, "
            f"{syncs} reduce-scatter(s) of its gradients in {t.mixed_precision_reduce}",
        )
        if float8 := _float8_all_gather(cfg, dims, args, factor=ring(fsdp) * blocks, gathers=gathers, b_p=param_bytes):
            _add(out, fsdp_dim, float8, "the float8 linears' weights gathered in float8")
    if rep > 1:
        out["dp_replicate"] = (
            Counter(all_reduce=2 * ring(rep) * reduce_bytes * held / fsdp),
            "HSDP: gradient shards all-reduced once per step",
        )
    if tp > 1:
        # The gradients of what TP leaves whole (the norms' weights) are partial sums over the TP ranks: FSDP
        # all-reduces them with each reduce-scatter, else optimizer.clip_grad_norm_ once a step.
        fsdp_applied = applies_fsdp(dims, param_dtype=t.mixed_precision_param, cpu_offload=t.enable_cpu_offload)
        kinds = _tp_kinds(costs, job, modes=modes, last=last, grad_accum=grad_accum, tp_mesh=tp_mesh)
        replicated = blocks * costs.tp_replicated[0] + (costs.tp_replicated[1] if last else 0)
        kinds["all_reduce"] += ring(tp) * ((syncs if fsdp_applied else 1) * 2 * param_bytes * replicated + norm)
        out["tp"] = (
            kinds,
            "the TP plan's all-gathers and reduce-scatters, traced on one block: forward, backward and AC's "
            "recomputation; the unsplit weights' gradients and the gradient norm all-reduced",
        )
    if cp > 1:
        # Forward's all-gathers and full AC's re-gathers (op SAC keeps them); backward's reduce-scatters.
        kv = ring(cp) * cp_kv_bytes(job)["gathered"] * job.microbatches * grad_accum
        kinds = Counter(all_gather=(blocks + modes.count("full")) * kv, reduce_scatter=blocks * kv)
        what = "keys and values all-gathered per block (and gradients reduce-scattered), forward, backward, AC"
        _add(out, "cp", kinds, what)  # to FSDP's line when it shards over the CP ranks alone
    if muon := _muon(cfg, dims, args, blocks=blocks, fsdp_dim=fsdp_dim):
        _add(out, *muon)  # to FSDP's or TP's line when Muon's group is theirs
    for line in _ep(cfg, dims, job, costs, blocks, modes, grad_accum, gathers, syncs):  # expert parallel's lines
        _add(out, *line)
    if pp > 1:  # rank 0's stages: each but the last sends activations, each but the first gradients
        crossings = sum(s != len(layers) - 1 for s in ours) + sum(s != 0 for s in ours)
        boundary = local_tokens / tp * args.dim * param_bytes
        out["pp"] = (
            Counter(send=crossings * boundary * grad_accum, all_reduce=ring(pp) * 2 * 4),  # the stages' norms
            f"sends of every micro-batch's hidden states: {crossings} per "
            "micro-batch (activations forward, their gradients backward)",
        )
    return out


def _dense_held(
    cfg: JobConfig, dims: ParallelDims, costs: BlockCosts, args: Any, *, blocks: int, first: bool, last: bool
) -> tuple[int, int]:
    """Parameters and parameter tensors of rank 0's stages that FSDP shards over the dense mesh: all of them, but
    expert parallel's experts, which have a mesh and lines of their own (`_ep`)."""
    tensors = _param_tensors(cfg.model.name, args)
    held = blocks * costs.block_params + first * costs.embedding_params + last * costs.root_params
    held_tensors = sum(n * k for n, k in zip((blocks, first, last), tensors, strict=True))
    if dims.ep_enabled:
        held -= blocks * costs.experts_params
        held_tensors -= blocks * _expert_tensors(cfg.model.name, args)
    return held, held_tensors


def _ep(
    cfg: JobConfig,
    dims: ParallelDims,
    job: Job,
    costs: BlockCosts,
    blocks: int,
    modes: list[str],
    grad_accum: int,
    gathers: int,
    syncs: int,
) -> list[tuple[str, Counter[str], str]]:
    """Expert parallel's bytes (parallelisms/ep.py), as (line, bytes by kind, what): each MoE block and forward
    (micro-batch) sends the rows of its tokens routed to other ranks' experts and receives theirs, forward (dispatch
    and combine) and backward, and again in a full-AC block's recomputation (op SAC keeps the exchanged tensors),
    for routing as balanced as can be: tokens x top_k x (ep - 1) / ep rows each way (`all_to_all_bytes`; a skewed
    routing sends more, the metrics' expert load says how skewed). The experts' FSDP: each rank's experts gathered
    and their gradients reduce-scattered over the efsdp ranks (replicas all-reduce them under HSDP), their gradient
    norm all-reduced over the ep x efsdp ranks. Nothing without expert parallel."""
    if not dims.ep_enabled:
        return []
    t, fam, args = cfg.training, family(cfg.model.name), job.args
    param_bytes, reduce_bytes = DTYPES[t.mixed_precision_param].itemsize, DTYPES[t.mixed_precision_reduce].itemsize
    ring = lambda g: (g - 1) / g  # noqa: E731
    ep, efsdp = dims.ep, dims.efsdp
    tokens = t.local_batch_size * t.seq_len // (dims.cp * dims.tp)  # at the MoE: each TP rank its own sequence part
    rows = tokens * fam.experts_per_token(args) * (ep - 1) / ep / job.microbatches  # each way, per forward
    sent = functools.partial(
        all_to_all_bytes, sent_rows=rows, received_rows=rows, dim=args.dim, element_size=param_bytes,
        num_experts=fam.num_experts(args), ep=ep,
    )  # fmt: skip
    forwards = job.microbatches * grad_accum  # of every block of the rank
    a2a = forwards * (blocks * sent() + modes.count("full") * sent(backward=False))
    held = blocks * costs.experts_params / ep  # this rank's experts, before FSDP shards them
    fsdp_applied = applies_fsdp(dims, param_dtype=t.mixed_precision_param, cpu_offload=t.enable_cpu_offload)
    norm = ring(efsdp * ep) * 2 * 4 * blocks * _expert_tensors(cfg.model.name, args)
    ep_line, efsdp_line, tokens_line = _expert_lines(dims)
    lines = [
        (ep_line, Counter(all_to_all=a2a), "expert parallel: tokens to their experts and back, all-to-all"),
        (tokens_line, Counter(all_reduce=norm), "the experts' gradient norm"),
    ]
    if fsdp_applied and efsdp > 1:
        kinds = Counter(
            all_gather=ring(efsdp) * gathers * held * param_bytes,
            reduce_scatter=ring(efsdp) * syncs * reduce_bytes * held,
        )
        lines.append((efsdp_line, kinds, "FSDP of each rank's experts over the ranks expert parallel leaves"))
    if fsdp_applied and dims.hsdp_enabled:
        all_reduce = Counter(all_reduce=2 * ring(dims.dp_replicate) * reduce_bytes * held / efsdp)
        lines.append(("dp_replicate", all_reduce, "the experts' gradient shards"))
    return lines


def _expert_lines(dims: ParallelDims) -> tuple[str, str, str]:
    """The lines of rank 0's ep group, its efsdp group and the two together (ParallelDims.expert_meshes: ep
    consecutive ranks of dp_shard x cp x tp, efsdp every ep-th), each named after the mesh dimension(s) whose ranks
    it is, as FSDP's line is ("tp" where the TP ranks are the ep ranks), else "ep" and "efsdp"."""
    shard, cp, tp, ep = dims.dp_shard, dims.cp, dims.tp, dims.ep
    split = [name for name, size in (("dp_shard", shard), ("cp", cp), ("tp", tp)) if size > 1]
    tokens = split[0] if len(split) == 1 else "dp_shard_cp" if tp == 1 else "dp_shard_cp_tp"
    ep_line = (
        "tp"
        if ep == tp
        else ("cp" if tp == 1 else "cp_tp")
        if ep == cp * tp
        else tokens
        if ep == shard * cp * tp
        else "ep"
    )
    efsdp_line = "dp_shard" if ep == cp * tp else "cp" if ep == tp and shard == 1 else "efsdp"
    return ep_line, efsdp_line, tokens


def _expert_tensors(name: str, args: Any) -> int:
    """Parameter tensors of one block's experts (the family's experts_module); 0 for a dense family."""
    fam = family(name)
    if not fam.experts_module:
        return 0
    return len(list(one_block_model(name, args).layers["0"].get_submodule(fam.experts_module).parameters()))


def _tp_kinds(
    costs: BlockCosts, job: Job, *, modes: list[str], last: bool, grad_accum: int, tp_mesh: DeviceMesh | None
) -> Counter[str]:
    """The traced TP collectives of a step, by kind: rank 0's blocks (of AC `modes`, each traced in its mode), the
    embedding (stage 0, always rank 0's), the head and loss (the last stage's), per micro-batch (of the pipeline:
    1/microbatches of the local batch)."""
    by_mode = mode_costs(job, tuple(dict.fromkeys(modes)), tp_mesh=tp_mesh)
    traced = sum((Counter(by_mode[mode].tp_block) for mode in modes), Counter()) + Counter(costs.tp_embedding)
    traced += Counter(costs.tp_head) if last else Counter()
    return Counter({k: (job.dims.tp - 1) / job.dims.tp * job.microbatches * v * grad_accum for k, v in traced.items()})


def _float8_all_gather(
    cfg: JobConfig, dims: ParallelDims, args: Any, *, factor: float, gathers: int, b_p: int
) -> Counter[str]:
    """What FSDP's float8 all-gather (parallelisms/float8.py) changes in a step's bytes, per block (x `factor`: FSDP's
    ring factor times the rank's blocks): its float8 weights gathered at 1 byte an element instead of b_p (on one TP
    rank), and their scales' amaxes all-reduced, one float32 each once a step when precomputed, else at each
    all-gather. Empty without it. (Added to FSDP's Counter, whose sum stays positive.)"""
    f8 = float8_settings(cfg)
    if f8 is None or not gathers_float8(f8, fsdp_sharded=dims.dp_shard > 1):
        return Counter()
    block = one_block_model(cfg.model.name, args).layers["0"]
    linears = [fqn for fqn, m in block.named_modules() if converts(m, f"layers.0.{fqn}", f8)]
    elements = tp_rank_elements(cfg.model.name, args, linears, tp=dims.tp)
    scalings = 1 if f8.precompute_float8_dynamic_scale_for_fsdp else gathers
    return Counter(all_gather=-factor * gathers * elements * (b_p - 1), all_reduce=factor * 8 * scalings * len(linears))


def _param_tensors(name: str, args: Any) -> tuple[int, int, int]:
    """Parameter tensors of one block, of the embedding and of the root unit (final norm and output)."""
    model = one_block_model(name, args)
    count = lambda *modules: sum(len(list(m.parameters())) for m in modules if m is not None)  # noqa: E731
    return count(model.layers["0"]), count(model.tok_embeddings), count(model.norm, model.output)


def _add(out: dict[str, tuple[Counter[str], str]], dim: str, kinds: Counter[str], what: str) -> None:
    """Bytes and their cause added to a dimension's line, or its line."""
    out[dim] = (out[dim][0] + kinds, f"{out[dim][1]}; {what}") if dim in out else (kinds, what)


def _muon(
    cfg: JobConfig, dims: ParallelDims, args: Any, *, blocks: int, fsdp_dim: str
) -> tuple[str, Counter[str], str] | None:
    """Muon's exchange (muon.py) as (dimension, bytes by kind, what), or None without one: over the ranks that shard
    the hidden matrices, FSDP's (unless it does not apply), TP's, or both as one group ("dp_shard_tp")."""
    t, o = cfg.training, cfg.optimizer
    if o.name != "Muon" or o.muon_orthogonalize != "matrix":
        return None
    fsdp = dims.dp_shard * dims.cp
    fsdp_applied = fsdp > 1 and applies_fsdp(
        dims, param_dtype=t.mixed_precision_param, cpu_offload=t.enable_cpu_offload
    )
    names = [fsdp_dim] * fsdp_applied + ["tp"] * (dims.tp > 1)
    if not names:
        return None
    n = (fsdp if fsdp_applied else 1) * dims.tp
    sent = 2 * _muon_sent(blocks * list(hidden_matrices(cfg.model.name, args)), n)  # bfloat16: 2 bytes
    what = f"Muon: each hidden matrix's blocks gathered to its owner of {n} ranks and sent back, in bfloat16"
    return "_".join(names), Counter(all_to_all=sent), what


def _muon_sent(matrices: list[int], n: int) -> float:
    """Elements group rank 0 sends in Muon's exchange: its block of each matrix of a bucket it does not own, then
    the others' blocks of the one it owns (the first of each bucket of n)."""
    buckets = [matrices[k : k + n] for k in range(0, len(matrices), n)]
    return sum(sum(bucket[1:]) / n + (n - 1) / n * bucket[0] for bucket in buckets)


# What makes a step send more than its floor, in the order `comm_floor` undoes it: each trades bytes for memory (or for
# simplicity), and what undoing it removes is its excess, explained by its line here.
EXCESSES = {
    "micro-batches": "each micro-batch gathers the parameters again (FSDP frees them after every backward) and "
    "reduce-scatters its gradients, the TP-whole weights' all-reduced with them (one reduce-scatter a step with "
    "parallelism.fsdp_defer_reduce_scatter, for unsharded gradients held through the step)",
    "reshard after forward": "backward gathers each unit again but the root unit and the embedding "
    "(parallelism.fsdp_reshard_after_forward: parameters freed from forward to backward)",
    "activation checkpointing": "the recomputed forward's collectives run again (full AC; op SAC keeps CP's gathered "
    "keys and values)",
    "no loss parallel": "the logits gathered over the TP ranks before the loss (parallelism.disable_loss_parallel) "
    "instead of per-token statistics all-reduced on vocabulary shards",
    "gradient norm per tensor": "the gradient norm all-reduces one float32 norm per parameter tensor "
    "(torch.nn.utils.get_total_norm on DTensors) rather than one sum of squares",
}


@dataclasses.dataclass(frozen=True)
class _Step:
    """What `_comm` reads of a step, beyond the mesh: its config, Job, micro-batches and gradient-norm values."""

    cfg: JobConfig
    job: Job
    grad_accum: int
    norm_values: int | None = None


def comm_floor(
    cfg: JobConfig, dims: ParallelDims, job: Job, *, grad_accum: int, tp_mesh: DeviceMesh | None = None
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The least a step of this layout sends, by `comm_by_kind`'s keys, and what each cause of EXCESSES adds to it.

    The floor is the step of the same layout and tokens as one micro-batch, without activation checkpointing, its
    parameters gathered once (kept from forward to backward), the loss on vocabulary shards under TP and one value
    all-reduced for the gradient norm: every parameter gathered and every gradient reduced once, every activation
    that crosses a TP, CP or pipeline boundary sent once forward and once backward (the formulas per kind:
    docs/planning.md, "The communication floor"). The causes are undone one after the other in EXCESSES'
    order; the floor plus every excess is the step's `comm_by_kind`."""
    step = _Step(cfg, job, grad_accum)
    now = _by_kind(step, dims, tp_mesh)
    excesses: dict[str, dict[str, float]] = {}
    for cause in EXCESSES:
        step = _undone(cause, step)
        floor = _by_kind(step, dims, tp_mesh)
        added = {key: now.get(key, 0.0) - floor.get(key, 0.0) for key in now | floor}
        if added := {key: nbytes for key, nbytes in added.items() if abs(nbytes) >= 0.5}:
            excesses[cause] = added
        now = floor
    return now, excesses


def _by_kind(step: _Step, dims: ParallelDims, tp_mesh: DeviceMesh | None) -> dict[str, float]:
    return comm_by_kind(
        step.cfg, dims, step.job, grad_accum=step.grad_accum, tp_mesh=tp_mesh, norm_values=step.norm_values
    )


def _undone(cause: str, step: _Step) -> _Step:
    """`step` with `cause` (a key of EXCESSES) undone."""
    cfg = copy.copy(step.cfg)
    match cause:
        case "micro-batches":
            rows = cfg.training.local_batch_size * step.grad_accum
            cfg.training = dataclasses.replace(cfg.training, local_batch_size=rows)
            return _Step(cfg, dataclasses.replace(step.job, cfg=cfg), 1)
        case "reshard after forward":
            cfg.parallelism = dataclasses.replace(cfg.parallelism, fsdp_reshard_after_forward="never")
            return dataclasses.replace(step, cfg=cfg, job=dataclasses.replace(step.job, cfg=cfg))
        case "activation checkpointing":
            cfg.activation_checkpoint = ActivationCheckpoint(mode="none")
            return dataclasses.replace(step, cfg=cfg, job=dataclasses.replace(step.job, cfg=cfg))
        case "no loss parallel":
            cfg.parallelism = dataclasses.replace(cfg.parallelism, disable_loss_parallel=False)
            return dataclasses.replace(step, cfg=cfg, job=dataclasses.replace(step.job, cfg=cfg))
        case "gradient norm per tensor":
            return dataclasses.replace(step, norm_values=1)
    raise ValueError(f"cause: expected one of {', '.join(EXCESSES)}, got {cause!r}")
