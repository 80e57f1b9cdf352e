"""Train a model of models/ (Llama 3, Qwen3, OLMo 2). Read top to bottom: main() builds a Run, then train() steps it.

torchrun --nproc_per_node=2 train.py --config configs/debug.toml    # 2 CPU ranks (gloo)
torchrun --nproc_per_node=8 train.py --config configs/llama3_8b.toml
python train.py --config configs/debug.toml --training.steps=20     # one process
python train.py --help                                              # every option
WORLD_SIZE=512 python train.py --config configs/llama3_405b.toml --comm.mode=fake_backend   # dry run
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from fleet import stop

if __name__ == "__main__":
    stop.listen()  # before the imports below (seconds): SIGTERM/SIGINT during start-up is a clean stop too

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import distill
import dpo
from checkpoint import CheckpointManager, ModelInterop, SaveStep, prepare_dump_folder
from checkpoint.torchtitan import schedule_disagreement
from config import (
    Debug,
    JobConfig,
    env_world_size,
    float8_settings,
    global_batch_size,
    help_text,
    load_config_and_keys,
    model_args,
    model_label,
    run_model_args,
    to_toml,
)
from data.corpus import open_corpus
from data.inputs import input_problems
from data.loader import Batch, GlobalBatchLoader
from data.mixture import open_mixture
from data.tokenizers import Tokenizer, build_tokenizer
from distributed import CollectiveTimeout, collective_on_rank0, init_distributed
from errors import ConfigError, RecipeError, is_rank0, report, writable_folder
from evaluation.downstream import EvalStep
from evaluation.validation import ValidateStep
from fleet import pause_points, step_faults
from fleet.monitor import Fleet
from forward import ForwardBackward
from loss import Loss, LossTerms, build_loss_fn
from metrics import LogStep, MetricsLogger, StepResult
from models import family
from models.moe import Balancer
from muon import build_muon
from optimizer import (
    SkipStepOptimizer,
    StopOnNonfinite,
    build_optimizer,
    lr_factor,
    set_hyperparameters,
    set_lr,
)
from parallelisms.float8 import precompute_scales_after_each_step
from parallelisms.parallel_dims import ParallelDims, layout_checks, uses_loss_parallel
from parallelisms.parallelize import build_model, init_model
from planning import doctor
from profiling import ProfileStep, profile_loop

T = TypeVar("T")


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    print_config = "--print-config" in argv
    # Planning (--print-config, a dry run) needs no input files; training needs them, and a layout that
    # fits the ranks torchrun started, all checked in one round.
    world = env_world_size() or 1
    cfg, changed = load_config_and_keys(  # changed: the keys the command line sets, which the banner names
        [a for a in argv if a != "--print-config"],
        input_checks=None if print_config else input_problems,
        extra_checks=None if print_config else layout_checks(world),
    )
    if print_config:
        print(config_summary(cfg))
        return 0
    if cfg.comm.mode == "fake_backend":  # a dry run of rank 0 of $WORLD_SIZE ranks (planning/dry_run.py)
        from planning import dry_run

        return dry_run.run(cfg)

    device, rank, world_size = init_distributed(cfg.comm, dump_folder=cfg.job.dump_folder)
    try:
        run = build(cfg, device=device, rank=rank, world_size=world_size, changed=changed)
        code = train(run, after_step_work(run)) if run is not None else 0
        # Leave together: a rank tearing gloo down while its peer was still in a collective aborted the peer
        # ("terminate called without an active exception", seen once in a full test run under load).
        dist.barrier()
        return code
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ the run


@dataclass
class Run:
    """What a run holds once built: the loop only steps it."""

    cfg: JobConfig
    dims: ParallelDims
    mesh: DeviceMesh
    cpu_group: dist.ProcessGroup | None  # stop requests, the slow-rank report: gloo's (None: the default group is)
    model_args: Any  # the family's ModelArgs
    tokenizer: Tokenizer
    forward_backward: ForwardBackward  # micro-batches through the model or the pipeline (forward.py)
    optimizer: SkipStepOptimizer
    loader: GlobalBatchLoader
    checkpoint: CheckpointManager
    balancer: Balancer | None  # a mixture of experts' load balancing (models/moe.py)
    stop: stop.StopAfterStep
    state: TrainState
    start_step: int  # the step resumed from (0: a fresh run)
    resources: contextlib.ExitStack  # closed when the run ends: the profiler, the logger, the gc schedule


class AfterStep(Protocol):
    """Work after a completed step (log, validate, stop, save, profile...), each in the file of its subject."""

    def __call__(self, step: int, result: StepResult) -> bool:
        """True: the run ends after this step."""
        ...


@dataclass
class AfterStepWork:
    """The work after each step, in order (docs/development.md, "Work after a step"): `timed` up to and including the
    log, part of the step's time; then `untimed` (validation, evals, saves...), whose time the log's clock leaves out
    of the throughput and the ETA."""

    timed: list[AfterStep]
    untimed: list[AfterStep]
    clock: LogStep

    def __call__(self, step: int, result: StepResult) -> bool:
        """True: the run ends after this step (the first part that says so ends it; the rest do not run)."""
        if any(after(step, result) for after in self.timed):
            return True
        begin = time.perf_counter()
        try:
            return any(after(step, result) for after in self.untimed)
        finally:
            self.clock.pause(time.perf_counter() - begin)


def train(run: Run, after_step: AfterStepWork) -> int:
    t = run.cfg.training
    begin = time.perf_counter()
    with run.resources:
        for step in range(run.start_step + 1, t.steps + 1):
            run.state.step = step
            lr = run.cfg.optimizer.lr * lr_factor(step - 1, run.cfg.lr_scheduler, training_steps=t.steps)
            set_lr(run.optimizer, lr)
            run.checkpoint.wait_for_staging()  # an async save's copy of the weights is complete
            result = train_step(
                step,
                run.loader.next_step(),
                run.forward_backward,
                run.optimizer,
                max_norm=t.max_norm,
                stop_request=run.stop.request,
            )
            if result is None:  # a stop request between micro-batches: step `step` is abandoned, not applied
                run.loader.abandon_step()
                run.state.step = step - 1
                run.stop.abandoned(step, start_step=run.start_step)
                break
            if after_step(step, result):
                break
        run.checkpoint.close()
    if is_rank0():
        first, last = run.start_step + 1, run.state.step
        trained = "no step" if last < first else f"step {first}" if last == first else f"steps {first}..{last}"
        print(
            f"end: trained {trained} in {time.perf_counter() - begin:.1f} s | last checkpoint: "
            f"{run.checkpoint.latest()} | metrics: {Path(run.cfg.job.dump_folder) / 'metrics.jsonl'}",
            flush=True,
        )
    return 0


def build(
    cfg: JobConfig, *, device: torch.device, rank: int, world_size: int, changed: Sequence[str] = ()
) -> Run | None:
    """Everything the run holds, in the order it is needed; None when there is nothing to train (a seed
    checkpoint was written, the run is finished, or a stop came during start-up). changed: the keys the command
    line set, which the banner names."""
    set_determinism(cfg.debug)
    # Parallel layout and the pitfalls of this job on this machine (planning/doctor.py, optional), before any compute.
    dims = ParallelDims.from_config(cfg.parallelism, world_size=world_size)
    mesh = dims.build_mesh(device.type)
    if cfg.activation_checkpoint.mode == "auto":  # each block's recompute chosen to fit the GPU (planning/memory.py)
        cfg = resolve_auto_ac(cfg, world_size=world_size, device=device, mesh=mesh if dims.tp_enabled else None)
    doctor.check_startup(cfg, world_size=world_size, device=device, mesh=mesh)
    args = run_model_args(cfg)
    collective_on_rank0(lambda: prepare_run_folder(cfg, args), rank=rank)
    if rank == 0 and cfg.job.print_config:
        print(to_toml(cfg), flush=True)
    tokenizer, loader = build_data(cfg, dp_rank=dims.dp_rank(mesh), dp_degree=dims.dp, vocab_size=args.vocab_size)

    # Model: meta device -> (pipeline stages) -> parallelize -> allocate -> initialize.
    loss_fn = build_run_loss(cfg, dims, mesh=mesh, device=device)
    model, pipeline = build_model(cfg, args, dims=dims, mesh=mesh, loss_fn=loss_fn, device=device)
    if cfg.model.print_after_conversion and rank == 0:
        print(model, flush=True)
    init_model(model, pipeline, device=device)
    # Stop requests and the slow-rank report need a CPU (gloo) group under NCCL. Checkpoints get a gloo group of
    # their own: an async save runs collectives in a background thread, and two threads issuing collectives on one
    # group interleave them and hang.
    cpu_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    checkpoint_group = dist.new_group(backend="gloo")
    if cfg.checkpoint.create_seed_checkpoint:
        save_seed_checkpoint(cfg, model, world_size=world_size)
        return None

    optimizer = build_run_optimizer(cfg, model, pp_degree=dims.pp)
    if (float8 := float8_settings(cfg)) is not None and float8.precompute_float8_dynamic_scale_for_fsdp:
        precompute_scales_after_each_step(optimizer, model)
    state = TrainState(settings=schedule_settings(cfg))
    # A mixture of experts' load balancing (models/moe.py), None otherwise: a rank's step is cut into micro-batches
    # (and the pipeline's), and its sequences at the experts over the TP ranks (sequence parallel).
    pieces = loader.grad_accum * (pipeline.n_microbatches if pipeline is not None else 1) * dims.tp
    balancer = Balancer.of(model, args, pieces_per_step=pieces)
    checkpoint = build_checkpoint(
        cfg, model, optimizer, loader, state, process_group=checkpoint_group, balancer=balancer
    )
    if (start_step := resume_step(cfg, checkpoint)) is None:
        return None
    if rank == 0:
        print_banner(cfg, args, model, dims=dims, loader=loader, start_step=start_step, device=device, changed=changed)
    resume(cfg, checkpoint, state, optimizer, start_step=start_step)
    forward_backward = ForwardBackward.for_run(cfg, model, pipeline, loss_fn, dims=dims, mesh=mesh, device=device)
    if cfg.dpo.enable:  # the reference's log-probabilities of every pair, from the initial weights (dpo.py)
        dpo.prepare_reference(
            cfg, loss_fn, forward_backward, loader, dims=dims, start_step=start_step,
            build_reference=model_builder(cfg, args, dims=dims, mesh=mesh, loss_fn=loss_fn, device=device),
        )  # fmt: skip
    # Signals have been recorded since the first line (fleet/stop.py); the ranks first agree here, after start-up.
    request = stop.StopRequest(cpu_group, stop_file=Path(cfg.job.dump_folder) / "STOP", is_rank0=rank == 0)
    if reason := request.requested():
        request.done(f"{reason}: stopped during start-up, before step {start_step + 1}; nothing new to save")
        return None

    return Run(
        cfg=cfg,
        dims=dims,
        mesh=mesh,
        cpu_group=cpu_group,
        model_args=args,
        tokenizer=tokenizer,
        forward_backward=forward_backward,
        optimizer=optimizer,
        loader=loader,
        checkpoint=checkpoint,
        balancer=balancer,
        stop=stop.StopAfterStep(request, checkpoint),
        state=state,
        start_step=start_step,
        resources=contextlib.ExitStack(),
    )


def after_step_work(run: Run) -> AfterStepWork:
    """The work after each step, in order: stop on too many bad steps, the collectives' time-out after the first
    step, a mixture of experts' load balancing, log; then, left out of the throughput: the step's end (the
    slow-rank report, the hang watchdog disarmed), validate, score lm-eval tasks, stop on request, save, profile,
    collect garbage, the next step's start (the watchdog armed) (docs/development.md, "Work after a step": why a
    list). Each part is built in the file of its subject; what it must close at the end joins run.resources."""
    cfg, steps, fb = run.cfg, run.cfg.training.steps, run.forward_backward
    logger = MetricsLogger.for_run(cfg, start_step=run.start_step)  # rank 0 logs
    run.resources.callback(logger.close)
    log = LogStep(
        cfg,
        logger=logger,
        loader=run.loader,
        start_step=run.start_step,
        flops_per_token=family(cfg.model.name).num_flops_per_token(run.model_args, cfg.training.seq_len),
        device=fb.device,
        lr=lambda: run.optimizer.param_groups[0]["lr"],
        routing=run.balancer,
    )
    timed: list[AfterStep] = [
        StopOnNonfinite(run.optimizer, run.checkpoint),
        CollectiveTimeout(cfg.comm, groups=[None, run.cpu_group]),  # the default group, and gloo's under NCCL
        *([run.balancer] if run.balancer is not None else []),  # before the log, which reads the step's routing
        *([dpo.ReferenceCheck(fb.loss_fn, dpo.how_computed(cfg, run.dims), run.cpu_group)] if cfg.dpo.enable else []),
        log,
    ]
    # A slow rank named, a hang ended (fleet/monitor.py): a step ends after its log; the next starts after all the rest.
    monitor = Fleet(
        cfg.comm,
        cfg.metrics,
        dump_folder=cfg.job.dump_folder,
        total_steps=steps,
        loader=run.loader,
        logger=logger,
        stop_request=run.stop.request,
        group=run.cpu_group,
        on_step_start=step_faults(dist.get_rank()),  # FLEET_FAULT's, for drills (fleet/faults.py); None in a run
    )
    run.resources.callback(monitor.close)
    untimed: list[AfterStep] = [monitor.step_done]
    dp = {"dp_rank": run.loader.dp_rank, "dp_degree": run.dims.dp}
    if cfg.validation.enable:
        untimed.append(ValidateStep.for_run(cfg, forward=fb, tokenizer=run.tokenizer, logger=logger, **dp))
    if cfg.eval.enable:  # lm-eval tasks on the live model, in its layout
        untimed.append(
            EvalStep.for_run(
                cfg, forward=fb, mesh=run.mesh, stop=run.stop.request, start_step=run.start_step, logger=logger, **dp
            )
        )
    profiler = run.resources.enter_context(
        profile_loop(cfg.profiling, dump_folder=cfg.job.dump_folder, rank=dist.get_rank(), start_step=run.start_step)
    )
    collect = GarbageCollection(every=cfg.training.gc_freq)
    run.resources.callback(collect.close)
    untimed += [run.stop, SaveStep(run.checkpoint, total_steps=steps), ProfileStep(profiler), collect]
    return AfterStepWork(timed, [*untimed, monitor.step_starts], clock=log)


def resolve_auto_ac(cfg: JobConfig, *, world_size: int, device: torch.device, mesh: DeviceMesh | None) -> JobConfig:
    """Mode "auto" made "per_block" with the least recompute whose estimated memory fits this GPU (or
    activation_checkpoint.memory_budget_gib); rank 0 prints the choice. The config saved in the run folder is this
    one, so eval.py and a look back see what ran."""
    from planning.job import Machine
    from planning.memory import cuda_memory_gib
    from planning.memory import resolve_auto_ac as choose

    tp_mesh = mesh["tp"] if mesh is not None else None
    machine = Machine(cuda=device.type == "cuda", device_memory_gib=cuda_memory_gib(device))
    cfg, choice = choose(cfg, world_size=world_size, machine=machine, tp_mesh=tp_mesh)
    if is_rank0() and choice is not None:
        print(f"activation_checkpoint.mode = auto: {choice.describe()}", flush=True)
    return cfg


def prepare_run_folder(cfg: JobConfig, args: Any) -> None:
    """The run's folder (rank 0): ours alone, writable, with room for a checkpoint; the config saved in it and beside
    the checkpoints."""
    fam = family(cfg.model.name)
    bytes_per_param = 4 if cfg.checkpoint.create_seed_checkpoint else 12  # fp32 weights (+ AdamW's two moments)
    prepare_dump_folder(cfg.job.dump_folder, cfg.checkpoint, checkpoint_bytes=bytes_per_param * fam.num_params(args))
    if cfg.job.save_config_file:
        saved = Path(cfg.job.dump_folder) / cfg.job.save_config_file
        writable_folder(saved.parent, key="job.save_config_file").joinpath(saved.name).write_text(to_toml(cfg))
    if cfg.checkpoint.enable or cfg.checkpoint.create_seed_checkpoint:  # beside the step folders, for generate.py
        folder = writable_folder(Path(cfg.job.dump_folder) / cfg.checkpoint.folder, key="checkpoint.folder")
        (folder / "config.toml.partial").write_text(to_toml(cfg))
        os.replace(folder / "config.toml.partial", folder / "config.toml")


def build_data(cfg: JobConfig, *, dp_rank: int, dp_degree: int, vocab_size: int) -> tuple[Any, GlobalBatchLoader]:
    """The tokenizer, and the loader of this rank's share of every global batch. A prepared folder is
    memory-mapped; raw files are tokenized into a cache first, the ranks sharing the work; a mixture
    reads several prepared folders, each in the share of its weight."""
    t = cfg.training
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"model.tokenizer_path: the tokenizer has {tokenizer.vocab_size} tokens but {model_label(cfg)} "
            f"embeds only {vocab_size}; use a matching tokenizer or flavor"
        )
    corpus = (
        open_mixture(cfg.data, tokenizer, cfg.model.tokenizer_path)
        if cfg.data.mixture
        else open_corpus(cfg.data, tokenizer, cfg.model.tokenizer_path, pairs=cfg.dpo.enable)
    )
    loader = GlobalBatchLoader(
        corpus,
        window=t.seq_len + 1,
        local_batch_size=t.local_batch_size,
        global_batch_size=global_batch_size(t, dp=dp_degree),
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        shuffle=cfg.data.shuffle,
        seed=cfg.debug.seed,
        strict_resume=not cfg.data.ignore_resume_mismatch,
        pad_samples=cfg.data.pad_samples,
        count_format_tokens=not cfg.dpo.mask_format_tokens,  # preference pairs (dpo.py)
    )
    return tokenizer, loader


def build_run_loss(
    cfg: JobConfig, dims: ParallelDims, *, mesh: DeviceMesh, device: torch.device
) -> Loss | dpo.PreferenceLoss:
    """The next-token loss (loss.py), or on preference pairs the DPO loss (dpo.py), or with a teacher the
    distillation loss, its teacher built and loaded (distill.py); on vocabulary shards under loss parallel."""
    t, vocab_shards = cfg.training, dims.tp if uses_loss_parallel(cfg, dims) else 1
    if cfg.dpo.enable:
        return dpo.build_loss(cfg.dpo, chunk_tokens=t.loss_chunk_tokens, vocab_shards=vocab_shards)
    if cfg.distill.enable:
        return distill.build_loss(
            cfg, dims=dims, mesh=mesh, device=device, chunk_tokens=t.loss_chunk_tokens,
            z_loss_weight=t.z_loss_weight, vocab_shards=vocab_shards,
        )  # fmt: skip
    return build_loss_fn(
        cfg.compile, chunk_tokens=t.loss_chunk_tokens, z_loss_weight=t.z_loss_weight, vocab_shards=vocab_shards
    )


def model_builder(
    cfg: JobConfig, args: Any, *, dims: ParallelDims, mesh: DeviceMesh, loss_fn: Any, device: torch.device
) -> Callable[[], torch.nn.Module]:
    """Another model built as the run's is, parallelized, allocated and initialized (DPO's live reference, dpo.py);
    the random numbers its initialization draws are not the run's."""

    def build() -> torch.nn.Module:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model, _ = build_model(cfg, args, dims=dims, mesh=mesh, loss_fn=loss_fn, device=device)
            init_model(model, None, device=device)
        return model

    return build


def build_run_optimizer(cfg: JobConfig, model: torch.nn.Module, *, pp_degree: int) -> SkipStepOptimizer:
    """optimizer.name: Muon for the family's hidden matrices and AdamW for the rest (muon.py), or AdamW; either behind
    the gate that skips bad steps (optimizer.py)."""
    if cfg.optimizer.name == "Muon":
        return build_muon(cfg.optimizer, model, family(cfg.model.name), training=cfg.training, pp_degree=pp_degree)
    return build_optimizer(cfg.optimizer, model, training=cfg.training, pp_degree=pp_degree)


def build_checkpoint(
    cfg: JobConfig,
    model: torch.nn.Module,
    optimizer: SkipStepOptimizer,
    loader: GlobalBatchLoader,
    state: TrainState,
    *,
    process_group: dist.ProcessGroup,
    balancer: Balancer | None = None,
) -> CheckpointManager:
    """What a checkpoint holds: weights and optimizer, the data position, the step, RNG and settings, the spike
    window and a mixture of experts' last counts; and the points of a save where a drill holds a rank still
    (CHECKPOINT_PAUSE_AT, fleet/faults.py)."""
    stateful: dict[str, Any] = {"dataloader": loader, "train_state": state, "spike_window": optimizer.window}
    if balancer is not None:
        stateful["moe_balance"] = balancer
    return CheckpointManager(
        cfg.checkpoint,
        dump_folder=cfg.job.dump_folder,
        model=model,
        optimizer=optimizer,
        stateful=stateful,
        process_group=process_group,
        interop=ModelInterop.from_config(cfg.model),
        on_point=pause_points(),
    )


def resume_step(cfg: JobConfig, checkpoint: CheckpointManager) -> int | None:
    """The step this run continues from (0: a fresh run), or None when the checkpoint is the last step."""
    steps = cfg.training.steps
    if (step := checkpoint.resume_step()) < steps:
        return step
    if step == steps:  # a finished run started again
        if is_rank0():
            print(f"step {steps} is saved in {checkpoint.folder}: nothing to train (raise training.steps to train on)")
        return None
    raise ConfigError(
        f"training.steps: {steps} is below step {step} of the checkpoint in {checkpoint.folder}; raise "
        "training.steps to train on, or choose another job.dump_folder to start over"
    )


def resume(
    cfg: JobConfig, checkpoint: CheckpointManager, state: TrainState, optimizer: SkipStepOptimizer, *, start_step: int
) -> None:
    """Weights, optimizer, data position, RNG and spike window from the checkpoint (or the initial weights);
    the settings given now win, and a resumed run says which changed."""
    checkpoint.load()
    state.restore_rng()
    if start_step and is_rank0():
        for line in changed_settings(state.resumed_settings, state.settings):
            print(f"resume: {line} (from step {start_step + 1} on)", flush=True)
    if start_step and checkpoint.torchtitan is not None and is_rank0():
        lr = cfg.optimizer.lr * lr_factor(start_step, cfg.lr_scheduler, training_steps=cfg.training.steps)
        if line := schedule_disagreement(checkpoint.torchtitan, lr=lr):
            print(line, flush=True)
    set_hyperparameters(optimizer, cfg.optimizer)  # the checkpoint's param_groups carry the old ones


def print_banner(
    cfg: JobConfig,
    args: Any,
    model: torch.nn.Module,
    *,
    dims: ParallelDims,
    loader: GlobalBatchLoader,
    start_step: int,
    device: torch.device,
    changed: Sequence[str] = (),
) -> None:
    t, data = cfg.training, cfg.data
    if cfg.job.description:
        print(described(cfg.job.description, changed), flush=True)
    corpus = f"mixture of {', '.join(data.mixture)}" if data.mixture else data.path
    fam = family(cfg.model.name)
    active = f" ({fam.active_params(args) / 1e6:,.1f}M active)" if fam.active_params else ""
    if any(not p.requires_grad for p in model.parameters()):  # a frozen base (LoRA): what trains, of this stage's
        active += (
            f" ({sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:,.2f}M train, the rest frozen)"
        )
    print(
        f"{model_label(cfg)}: {fam.num_params(args) / 1e6:,.1f}M parameters{active} | world "
        f"{dims.world_size} = " + (f"pp {dims.pp} x " if dims.pp_enabled else "") + f"{dims.describe()} | global batch "
        f"{loader.global_batch_size} x {t.seq_len} tokens, grad accumulation {loader.grad_accum} | "
        f"{loader.corpus.num_tokens:,} tokens of {corpus}{' (chat)' if data.chat else ''} | device {device.type} | "
        f"steps {start_step + 1}..{t.steps}",
        flush=True,
    )
    dump, ckpt = Path(cfg.job.dump_folder), cfg.checkpoint
    saves = f"{dump / ckpt.folder} every {ckpt.interval} steps and at the end" if ckpt.enable else "off"
    print(f"outputs: {dump} | metrics {dump / 'metrics.jsonl'} | checkpoints {saves}", flush=True)


def described(description: str, changed: Sequence[str]) -> str:
    """job.description as the TOML wrote it, and what the command line changed since, which its words may not cover
    (configs/debug.toml's "shipped synthetic corpus" on a chat fine-tune's --data.path); where the job's own keys
    (its folder, its description) changed, nothing else."""
    others = [key for key in changed if not key.startswith("job.")]
    if "job.description" in changed or not others:
        return description
    return f"{description} (the config's description; the command line changes {', '.join(others)})"


# ------------------------------------------------------------------ one step


def train_step(
    step: int,
    microbatches: Iterable[Batch],
    forward_backward: ForwardBackward,
    optimizer: SkipStepOptimizer,
    *,
    max_norm: float,
    stop_request: stop.StopRequest | None,
) -> StepResult | None:
    """Training step `step`: one optimizer step over the micro-batches, unless the optimizer finds it bad
    (optimizer.py: non-finite, or a spike). Returns device tensors: no host sync. Each batch carries its loss
    divisor, so that the accumulated gradient is the mean over the global batch's counted labels. With
    `stop_request`, the ranks ask it between micro-batches: on a stop request the step is abandoned (None;
    weights and optimizer state as they were, gradients dropped)."""
    optimizer.zero_grad(set_to_none=True)
    losses: LossTerms | None = None
    for index, (batch, last) in enumerate(with_last(microbatches)):
        if index and stop_request is not None and stop_request.requested():
            optimizer.zero_grad(set_to_none=True)
            return None
        loss = forward_backward(batch, last=last)
        losses = loss if losses is None else losses.plus(loss)
    assert losses is not None, "a step has at least one micro-batch"
    grad_norm = forward_backward.clip_grad_norm(max_norm)
    optimizer.step_unless_bad(step, loss=losses.total, grad_norm=grad_norm)
    return StepResult(losses, grad_norm)


def with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Each item, and whether it is the last."""
    iterator = iter(items)
    for item in iterator:
        for after in iterator:
            yield item, False
            item = after
        yield item, True


# ------------------------------------------------------------------- builders


def set_determinism(cfg: Debug) -> None:
    """The same seed on every rank: ranks differ by the data they read, not by their RNG."""
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=cfg.deterministic_warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def save_seed_checkpoint(cfg: JobConfig, model: torch.nn.Module, *, world_size: int) -> None:
    if world_size != 1:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint: run it as one process (python train.py ...), not under torchrun"
        )
    checkpoint = CheckpointManager(
        cfg.checkpoint, dump_folder=cfg.job.dump_folder, model=model, optimizer=None, stateful={}
    )
    checkpoint.save(0, model_only=True, wait=True)


# ---------------------------------------------------------------- small parts


@dataclass
class TrainState:
    """Step, RNG state and the settings the run was given, checkpointed so that a resumed run
    continues the same stream (and can say which settings it now follows instead)."""

    step: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    resumed_settings: dict[str, Any] = field(default_factory=dict)  # those of the checkpoint loaded
    rng: dict[str, torch.Tensor] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {"step": self.step, "settings": dict(self.settings), "rng": rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.resumed_settings, self.rng = int(state["step"]), state["settings"], state["rng"]

    def load_torchtitan(self, state: Any) -> None:
        """torchtitan's checkpoint (checkpoint/torchtitan.py): its step and optimizer settings; no RNG state."""
        self.step, self.resumed_settings, self.rng = state.step, state.settings, {}

    def restore_rng(self) -> None:
        if "cpu" in self.rng:
            torch.set_rng_state(self.rng["cpu"])
        if "cuda" in self.rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(self.rng["cuda"])


def schedule_settings(cfg: JobConfig) -> dict[str, float | int | str]:
    """What this run was told to do, saved in checkpoints so that a resume can say what changed."""
    o, s = cfg.optimizer, cfg.lr_scheduler
    return {
        "optimizer.lr": o.lr, "optimizer.beta1": o.beta1, "optimizer.beta2": o.beta2, "optimizer.eps": o.eps,
        "optimizer.weight_decay": o.weight_decay, "lr_scheduler.warmup_steps": s.warmup_steps,
        "lr_scheduler.total_steps": str(s.total_steps),
        "lr_scheduler.decay_ratio": str(s.decay_ratio), "lr_scheduler.decay_type": s.decay_type,
        "lr_scheduler.min_lr_factor": s.min_lr_factor, "training.steps": cfg.training.steps,
    }  # fmt: skip


def changed_settings(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    return [f"{key} {before[key]} -> {value}" for key, value in now.items() if key in before and before[key] != value]


class GarbageCollection:
    """Python's cyclic garbage collector on every rank at the same steps (every training.gc_freq), and
    never in between: a collection that pauses one rank at a random moment stalls all the others at
    their next collective."""

    def __init__(self, *, every: int):
        self.every = every
        gc.disable()
        gc.collect(1)

    def before_step(self, step: int) -> None:
        """Collect before step `step` where it is due (torchtitan collects at the start of a step)."""
        if step > 1 and step % self.every == 0:
            gc.collect(1)  # the young generations: what a step leaves behind, in milliseconds

    def __call__(self, step: int, result: object) -> bool:
        self.before_step(step + 1)  # the last work after step `step` is the first before the next
        return False

    def close(self) -> None:
        gc.enable()


def config_summary(cfg: JobConfig) -> str:
    """The resolved config plus the numbers derived from it (--print-config)."""
    t, par = cfg.training, cfg.parallelism
    fam, args = family(cfg.model.name), model_args(cfg.model)
    world = env_world_size() or 0
    # Without WORLD_SIZE: the smallest world the degrees fit (data-parallel degree 1), said as such.
    assumed = world == 0
    world = world or (
        par.pipeline_parallel_degree
        * par.data_parallel_replicate_degree
        * max(par.data_parallel_shard_degree, 1)
        * par.context_parallel_degree
        * par.tensor_parallel_degree
    )
    dims = ParallelDims.from_config(par, world_size=world)
    global_batch = global_batch_size(t, dp=dims.dp)
    which = (
        f"assuming world size {world}, the smallest the parallel degrees fit (WORLD_SIZE is unset: set it to the "
        "job's, e.g. WORLD_SIZE=64, for that job's numbers)"
        if assumed
        else f"world size {world} (WORLD_SIZE)"
    )
    lines = [
        # job.print_config is what a run does at start-up; printed bare here, `false` would read as a contradiction
        to_toml(cfg, notes={"job.print_config": "at a run's start-up (--print-config prints it whatever this says)"}),
        "# derived",
        f"# model: {model_label(cfg)}",
        f"# parameters: {fam.num_params(args):,} ({fam.num_params(args, exclude_embedding=True):,} without embedding)"
        + (f"; {fam.active_params(args):,} active per token" if fam.active_params else ""),
        f"# training FLOPs per token at seq_len {t.seq_len}: {fam.num_flops_per_token(args, t.seq_len):.4g}",
        f"# tokens per step: {global_batch * t.seq_len:,} (global batch {global_batch} x seq_len {t.seq_len}; "
        f"data-parallel degree {dims.dp}, {which})",
    ]
    if cfg.activation_checkpoint.mode == "auto":  # chosen for this machine's GPUs (or CPU ranks) and this world
        from planning.job import Machine
        from planning.memory import cuda_memory_gib, resolve_auto_ac

        cuda = torch.cuda.is_available()
        memory = cuda_memory_gib(torch.device("cuda", 0)) if cuda else None
        _, choice = resolve_auto_ac(cfg, world_size=world, machine=Machine(cuda=cuda, device_memory_gib=memory))
        assert choice is not None
        lines.append(f"# activation_checkpoint.mode = auto: {choice.describe()}")
    lines += [f"# note: {problem} (training needs it, planning does not)" for problem in input_problems(cfg)]
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except RecipeError as e:
        sys.exit(report(e))
    except RuntimeError as e:  # NCCL's DistBackendError is one too
        if "timed out" not in str(e).lower():
            raise
        detail = str(e).strip().splitlines()[-1][-200:]
        print(
            f"error: rank {os.environ.get('RANK', 0)}: a collective timed out ({detail}); another rank stopped "
            "answering: see its output (the limits: comm.init_timeout_seconds, comm.train_timeout_seconds)",
            file=sys.stderr,
        )
        sys.exit(1)
