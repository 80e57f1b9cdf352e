"""Train Llama 3. Read top to bottom: main() builds everything, then runs the loop.

torchrun --nproc_per_node=2 train.py --config configs/debug.toml    # 2 CPU ranks (gloo)
torchrun --nproc_per_node=8 train.py --config configs/llama3_8b.toml
python train.py --config configs/debug.toml --training.steps=20     # one process
python train.py --help                                              # every option
WORLD_SIZE=512 python train.py --config configs/llama3_405b.toml --comm.mode=fake_backend   # dry run
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import stop

if __name__ == "__main__":
    stop.listen()  # before the imports below (seconds): SIGTERM/SIGINT during start-up is a clean stop too

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import doctor
from checkpoint import CheckpointManager, prepare_dump_folder
from config import (
    ActivationCheckpoint,
    Comm,
    Compile,
    Debug,
    Float8Linear,
    JobConfig,
    LRScheduler,
    Model,
    Optimizer,
    Parallelism,
    Training,
    global_batch_size,
    help_text,
    input_problems,
    load_config,
    model_args,
    to_toml,
)
from data.corpus import open_corpus
from data.loader import Batch, GlobalBatchLoader
from data.mixture import open_mixture
from data.tokenizers import build_tokenizer
from errors import ConfigError, is_rank0, warn, writable_folder
from loss import Loss, build_loss_fn
from metrics import MetricsLogger, StepMetrics, peak_flops, peak_memory_gib
from models import ModelFamily, family, with_seq_len
from parallelisms.cp import ContextParallel, context_parallel
from parallelisms.float8 import precompute_scales_after_each_step
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize_model
from parallelisms.pp import Pipeline, pipeline_model
from parallelisms.tp import loss_parallel_context
from profiling import profile_loop
from spikes import SpikeGuard
from validation import Validator

T = TypeVar("T")


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    print_config = "--print-config" in argv
    # Planning (--print-config, a dry run) needs no input files; training needs them, and a layout that
    # fits the ranks torchrun started, all checked in one round.
    world = os.environ.get("WORLD_SIZE", "1")
    cfg = load_config(
        [a for a in argv if a != "--print-config"],
        inputs=not print_config,
        world_size=None if print_config else int(world) if world.isdigit() else None,
    )
    if print_config:
        print(describe(cfg))
        return 0
    if cfg.comm.mode == "fake_backend":  # a dry run of rank 0 of $WORLD_SIZE ranks (dry_run.py)
        import dry_run

        return dry_run.run(cfg)

    device, rank, world_size = init_distributed(cfg.comm, dump_folder=cfg.job.dump_folder)
    try:
        return train(cfg, device=device, rank=rank, world_size=world_size)
    finally:
        dist.destroy_process_group()


def train(cfg: JobConfig, *, device: torch.device, rank: int, world_size: int) -> int:
    t = cfg.training
    set_determinism(cfg.debug)

    # Parallel layout, pitfalls of this job on this machine (doctor.py, optional: memory fit
    # included), and the run's folder: ours alone, writable, with room for a checkpoint. All
    # before any compute; rank 0 checks the folder, its errors stop every rank.
    dims = ParallelDims.from_config(cfg.parallelism, world_size=world_size)
    mesh = dims.build_mesh(device.type)
    doctor.check_startup(cfg, world_size=world_size, device=device, mesh=mesh)
    # The RoPE table covers the longest sequence trained or validated on; the attention mask is the config's.
    fam = family(cfg.model.name)
    longest = max(t.seq_len, cfg.validation.seq_len if cfg.validation.enable else 0)
    published = model_args(cfg.model)  # the flavor's (or config.json's) shape, as checkpoints export it
    args = dataclasses.replace(with_seq_len(published, longest), attn_mask_type=cfg.model.attn_mask_type)
    bytes_per_param = 4 if cfg.checkpoint.create_seed_checkpoint else 12  # fp32 weights (+ AdamW's two moments)

    def prepare_run_folder() -> None:
        prepare_dump_folder(
            cfg.job.dump_folder, cfg.checkpoint, checkpoint_bytes=bytes_per_param * fam.num_params(args)
        )
        if cfg.job.save_config_file:
            saved = Path(cfg.job.dump_folder) / cfg.job.save_config_file
            writable_folder(saved.parent, key="job.save_config_file").joinpath(saved.name).write_text(to_toml(cfg))

    on_rank0(prepare_run_folder, rank=rank)
    if rank == 0 and cfg.job.print_config:
        print(to_toml(cfg), flush=True)

    # The data each rank reads.
    dp_rank = dims.dp_rank(mesh)
    global_batch = global_batch_size(t, dp=dims.dp)
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    # A prepared folder, memory-mapped; raw files are tokenized into a cache first, the ranks sharing the work.
    # A mixture reads several prepared folders, each in the share of its weight.
    corpus = (
        open_mixture(cfg.data.mixture, cfg.data.mixture_weights, tokenizer)
        if cfg.data.mixture
        else open_corpus(cfg.data, tokenizer, cfg.model.tokenizer_path)
    )
    loader = GlobalBatchLoader(
        corpus, window=t.seq_len + 1, local_batch_size=t.local_batch_size, global_batch_size=global_batch,
        dp_rank=dp_rank, dp_degree=dims.dp, shuffle=cfg.data.shuffle, seed=cfg.debug.seed,
        strict_resume=not cfg.data.ignore_resume_mismatch,
    )  # fmt: skip

    # Model: meta device -> (pipeline stages) -> parallelize -> allocate -> initialize.
    model_name = model_label(cfg.model)
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"model.tokenizer_path: the tokenizer has {tokenizer.vocab_size} tokens but {model_name} "
            f"embeds only {args.vocab_size}; use a matching tokenizer or flavor"
        )
    # config.validate accepts one converter: torchao float8 linears, applied first by parallelize_model.
    float8 = cfg.quantize.linear.float8 if "quantize.linear.float8" in cfg.model.converters else None
    loss_fn = build_loss_fn(cfg.compile, chunk_tokens=t.loss_chunk_tokens, z_loss_weight=t.z_loss_weight)
    model, pipeline = build_model(
        fam, args, dims=dims, mesh=mesh, training=t, parallelism=cfg.parallelism, ac=cfg.activation_checkpoint,
        compile=cfg.compile, float8=float8, loss_fn=loss_fn, device=device,
    )  # fmt: skip
    if cfg.model.print_after_conversion and rank == 0:
        print(model, flush=True)
    init_model(model, pipeline, device=device)

    # Stop requests need a CPU (gloo) group under NCCL. Checkpoints get a gloo group of their
    # own: an async save runs collectives in a background thread, and two threads issuing
    # collectives on one group interleave them and hang.
    ctrl_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    checkpoint_group = dist.new_group(backend="gloo")
    if cfg.checkpoint.create_seed_checkpoint:
        return save_seed_checkpoint(cfg, model, world_size=world_size)

    # Optimizer and state; a resumed run continues the same stream with the settings given now.
    optimizer = build_optimizer(cfg.optimizer, model)
    if float8 is not None and float8.precompute_float8_dynamic_scale_for_fsdp:
        precompute_scales_after_each_step(optimizer, model)
    train_state = TrainState(settings=schedule_settings(cfg))
    checkpoint = CheckpointManager(
        cfg.checkpoint, dump_folder=cfg.job.dump_folder, model=model, optimizer=optimizer,
        stateful={"dataloader": loader, "train_state": train_state}, process_group=checkpoint_group, family=fam,
        model_args=published, hf_assets_path=cfg.model.hf_assets_path, tokenizer_path=cfg.model.tokenizer_path,
    )  # fmt: skip
    if (resume := checkpoint.resume_step()) >= t.steps:
        if resume == t.steps:  # a finished run started again
            if rank == 0:
                print(
                    f"step {t.steps} is saved in {checkpoint.folder}: nothing to train (raise training.steps to train on)"
                )
            return 0
        raise ConfigError(
            f"training.steps: {t.steps} is below step {resume} of the checkpoint in {checkpoint.folder}; raise "
            "training.steps to train on, or choose another job.dump_folder to start over"
        )
    start_step = checkpoint.load()
    train_state.restore_rng()
    if start_step and rank == 0:
        for line in changed_settings(train_state.resumed_settings, train_state.settings):
            print(f"resume: {line} (from step {start_step + 1} on)", flush=True)
    set_hyperparameters(optimizer, cfg.optimizer)  # the checkpoint's param_groups carry the old ones
    # Signals have been recorded since the first line (stop.py); the ranks first agree here, after start-up.
    stop_request = stop.StopRequest(ctrl_group, stop_file=Path(cfg.job.dump_folder) / "STOP", is_rank0=rank == 0)
    if reason := stop_request.requested():
        stop_request.done(f"{reason}: stopped during start-up, before step {start_step + 1}; nothing new to save")
        return 0

    loss_parallel = dims.tp_enabled and not cfg.parallelism.disable_loss_parallel
    cp = context_parallel(mesh, cfg.parallelism)  # each rank's part of every window (context parallel), or None
    validator = (
        Validator(
            cfg.validation, data=cfg.data, tokenizer=tokenizer, tokenizer_path=cfg.model.tokenizer_path,
            dp_rank=dp_rank, dp_degree=dims.dp, device=device, loss_fn=loss_fn.cross_entropy_only(),
            loss_parallel=loss_parallel, cp=cp,
        )
        if cfg.validation.enable
        else None
    )  # fmt: skip

    flops_per_token = fam.num_flops_per_token(args, t.seq_len)
    peak = peak_flops(device)
    tokens_per_step = global_batch * t.seq_len
    # Rank 0 logs; a logger that cannot start (wandb without credentials) stops every rank.
    new_logger = functools.partial(
        MetricsLogger, cfg.metrics, dump_folder=cfg.job.dump_folder, total_steps=t.steps, start_step=start_step,
        run_config=cfg.to_dict(),
    )  # fmt: skip
    logger = on_rank0(lambda: new_logger(enabled=True), rank=rank) or new_logger(enabled=False)
    if rank == 0:
        if cfg.job.description:
            print(cfg.job.description, flush=True)
        print(
            f"{model_name}: {fam.num_params(args) / 1e6:,.1f}M parameters | world {world_size} = "
            + (f"pp {dims.pp} x " if dims.pp_enabled else "")
            + f"{dims.describe()} | global batch {global_batch} "
            f"x {t.seq_len} tokens, grad accumulation {loader.grad_accum} | {corpus.num_tokens:,} tokens in corpus "
            f"| device {device.type} | steps {start_step + 1}..{t.steps}",
            flush=True,
        )
    nonfinite = NonFiniteSteps(tolerate=t.skip_nonfinite_steps, spike_sigma=t.skip_spike_sigma)
    spike_guard = (
        SpikeGuard(sigma=t.skip_spike_sigma, window=t.skip_spike_window, device=device, pp=dims.pp)
        if t.skip_spike_sigma > 0
        else None
    )
    gc_every = GarbageCollection(every=t.gc_freq)
    last_log_time, last_log_step = time.perf_counter(), start_step

    # ------------------------------------------------------------------ the loop
    # profiler.step() ends a step for the profiler and memory snapshots ([profiling]; no-ops by default).
    with profile_loop(cfg.profiling, dump_folder=cfg.job.dump_folder, rank=rank, start_step=start_step) as profiler:
        for step in range(start_step + 1, t.steps + 1):
            train_state.step = step
            gc_every.step(step)
            lr = set_lr(optimizer, cfg.optimizer.lr * lr_factor(step - 1, cfg.lr_scheduler, training_steps=t.steps))
            checkpoint.wait_for_staging()  # an async save's copy of the weights is complete
            result = train_step(
                model, optimizer, loader.next_step(), grad_accum=loader.grad_accum, max_norm=t.max_norm,
                loss_fn=loss_fn, loss_parallel=loss_parallel, device=device, pipeline=pipeline,
                stop_request=stop_request, spike_guard=spike_guard, cp=cp,
            )  # fmt: skip
            if result is None:  # a stop request between micro-batches: step `step` is abandoned, not applied
                loader.abandon_step()
                train_state.step = step - 1
                if step - 1 == start_step:
                    saved = "nothing new to save"
                else:
                    if checkpoint.last_saved != step - 1:  # (an interval save may have written it already)
                        checkpoint.save(step - 1, wait=True)
                    saved = f"saved step {step - 1}"
                stop_request.done(
                    f"{stop_request.reason}: abandoned step {step} in flight, {saved} and stopped; rerun the same "
                    "command to resume"
                )
                break
            nonfinite.record(step, result)
            if nonfinite.exceeded():
                checkpoint.close()  # publishes a save that finished: bad updates are skipped, its weights are finite
                raise ConfigError(nonfinite.message(last_checkpoint=checkpoint.latest()))
            checkpoint.poll()  # publishes an async save as soon as it is complete
            if step == start_step + 1:  # every rank is past set-up: collectives that hang now are failures
                set_collective_timeout(cfg.comm.train_timeout_seconds, groups=[None, ctrl_group])

            last = step == t.steps
            if step % cfg.metrics.log_freq == 0 or last:
                loss_avg = world_mean(result.loss, pp=dims.pp)  # the one host sync of a logged step
                z_loss = world_mean(result.z_loss, pp=dims.pp) if result.z_loss is not None else None
                now = time.perf_counter()
                step_time = (now - last_log_time) / (step - last_log_step)
                tps = tokens_per_step / world_size / step_time
                logger.log(
                    StepMetrics(
                        step=step, loss=loss_avg - t.z_loss_weight * (z_loss or 0.0), z_loss=z_loss,
                        grad_norm=result.grad_norm.item(), lr=lr, tps=tps,
                        mfu=100 * flops_per_token * tps / peak if peak else None,
                        memory_gib=peak_memory_gib(device), step_time_s=step_time,
                        tokens_per_source=(
                            {name: n * t.seq_len for name, n in zip(corpus.names, loader.samples_per_source(), strict=True)}
                            if cfg.data.mixture else None
                        ),
                    )
                )  # fmt: skip
                last_log_time, last_log_step = time.perf_counter(), step
            if validator is not None and (step == 1 or step % cfg.validation.freq == 0 or last):
                logger.log_validation(step, *validator.validate(model, pipeline))
                last_log_time += validator.seconds  # tokens/s counts training only

            if reason := stop_request.requested():
                checkpoint.save(step, wait=True)
                stop_request.done(f"{reason}: saved step {step} and stopped; rerun the same command to resume")
                break
            if checkpoint.should_save(step, last=last):
                checkpoint.save(step, last=last)
            profiler.step()
    checkpoint.close()
    gc_every.close()
    logger.close()
    return 0


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    microbatches: Iterable[Batch | tuple[torch.Tensor, torch.Tensor]],
    *,
    grad_accum: int,
    max_norm: float,
    loss_fn: Loss | None = None,
    loss_parallel: bool,
    device: torch.device,
    pipeline: Pipeline | None = None,
    stop_request: stop.StopRequest | None = None,
    spike_guard: SpikeGuard | None = None,
    cp: ContextParallel | None = None,
) -> StepResult | None:
    """One optimizer step over `grad_accum` micro-batches; a step whose gradient norm is not finite (on
    any rank: it is global) leaves weights and optimizer state as they were. Returns device tensors:
    no host sync. With `pipeline` (parallelisms/pp.py) each micro-batch runs through its schedule,
    which holds the loss function, and the loss is on the ranks of the last stage (0 elsewhere).
    With `stop_request`, the ranks ask it between micro-batches: on a stop request the step is abandoned
    (None; weights and optimizer state as they were, gradients dropped). With `spike_guard` (spikes.py)
    a step whose loss or gradient norm is a spike is skipped the same way as a non-finite one. With `cp`
    (parallelisms/cp.py) each rank computes its part of every window's tokens; `segments` stays whole."""
    loss_fn = loss_fn or Loss()  # the whole micro-batch's logits at once, eager
    loss_fn.z_loss.take()  # (what an abandoned step left)
    optimizer.zero_grad(set_to_none=True)
    total_loss = torch.zeros((), device=device)
    for index, batch in enumerate(microbatches):
        if index and stop_request is not None and stop_request.requested():
            optimizer.zero_grad(set_to_none=True)
            return None
        inputs, labels, segments = Batch(*batch)
        if cp is not None:
            inputs, labels = cp.shard(inputs), cp.shard(labels)
        # Under loss parallel the logits stay sharded over the vocabulary (TP ranks) and
        # cross-entropy runs on the shards; the context must cover backward too.
        with loss_parallel_context(loss_parallel):
            segments = segments.to(device) if segments is not None else None
            labels = labels.to(device)
            # / grad_accum: the accumulated gradient is the mean over the whole global batch.
            if pipeline is not None:
                loss = pipeline.step(inputs.to(device), labels, segments, scale=1 / grad_accum)
            else:
                # The loss applies the output projection itself, inside the model's forward (loss.py).
                loss = model(
                    inputs.to(device), segments=segments, head=functools.partial(loss_fn, model, labels=labels)
                )
                loss = loss / grad_accum
                loss.backward()
        total_loss += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
    grad_norm = clip_grad_norm_(model.parameters(), max_norm, pp_group=pipeline.pp_group if pipeline else None)
    # The global norm is the same number on every rank, so every rank skips the same steps with no
    # extra collective; a non-finite loss on any rank means non-finite logits there, hence gradients.
    finite = torch.isfinite(grad_norm).float()
    spike = 1.0 - spike_guard(total_loss, grad_norm) if spike_guard is not None else torch.zeros_like(finite)
    optimizer_step(optimizer, apply=finite * (1.0 - spike))
    z_loss = loss_fn.z_loss.take()
    if loss_fn.z_loss_weight > 0 and z_loss is None:  # pipeline stages before the last score nothing
        z_loss = torch.zeros((), device=device)
    return StepResult(total_loss, grad_norm, finite, spike, z_loss=z_loss)


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's mean loss over its micro-batches (z-loss included)
    grad_norm: torch.Tensor  # the global gradient norm, before clipping
    finite: torch.Tensor  # 1.0 when loss and gradient norm were finite, 0.0 when not: the update was skipped
    spike: torch.Tensor  # 1.0 when the update was skipped as a spike (spikes.py), else 0.0 (the same on every rank)
    z_loss: torch.Tensor | None = None  # training.z_loss_weight > 0: the mean z-loss, unweighted


def optimizer_step(optimizer: torch.optim.Optimizer, *, apply: torch.Tensor) -> None:
    """`optimizer.step()`, or nothing when `apply` is 0, without asking the host where AdamW is fused.

    Fused AdamW takes GradScaler's `found_inf` (read from the optimizer's `found_inf` attribute,
    PyTorch 2.0-2.13): where it is 1 the kernel leaves weights, moments and step counts as they
    were. The foreach and for-loop kernels have no such input: they pay one host sync per step.
    """
    if optimizer.defaults.get("fused"):
        optimizer.found_inf, optimizer.grad_scale = 1.0 - apply, None
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
    elif apply.item():
        optimizer.step()


# ------------------------------------------------------------------- builders


def init_distributed(cfg: Comm, *, dump_folder: str) -> tuple[torch.device, int, int]:
    """NCCL on CUDA, gloo on CPU; a one-process group when not launched by torchrun."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
        # NCCL's flight recorder: the last trace_buf_size collectives of each rank, dumped when one
        # times out (what every rank was doing when the job hung). Set before the group exists.
        if cfg.trace_buf_size > 0:
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(cfg.trace_buf_size))
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            prefix = Path(dump_folder) / cfg.save_traces_folder / cfg.save_traces_file_prefix
            prefix.parent.mkdir(parents=True, exist_ok=True)
            os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(prefix))
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=cfg.init_timeout_seconds)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device, dist.get_rank(), dist.get_world_size()


def set_collective_timeout(seconds: int, *, groups: list[dist.ProcessGroup | None]) -> None:
    """From now on a collective that waits longer than `seconds` fails the job instead of hanging it."""
    # Private (PyTorch 2.13, as torchtitan uses it): no public API changes a live group's timeout.
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def set_determinism(cfg: Debug) -> None:
    """The same seed on every rank: ranks differ by the data they read, not by their RNG."""
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=cfg.deterministic_warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def build_optimizer(o: Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[o.implementation]
    match o.name:
        case "AdamW":
            return torch.optim.AdamW(
                model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **impl
            )


def build_model(
    family: ModelFamily,
    args: Any,
    *,
    dims: ParallelDims,
    mesh: DeviceMesh,
    training: Training,
    parallelism: Parallelism,
    ac: ActivationCheckpoint,
    compile: Compile,
    float8: Float8Linear | None,
    loss_fn: Loss,
    device: torch.device,
    planning: bool = False,
) -> tuple[torch.nn.Module, Pipeline | None]:
    """The model on the meta device, parallelized: shapes and shardings, no storage yet (`init_model`).
    planning: for a dry run (dry_run.py; parallelize_model's argument).

    With pipeline parallel this rank holds some stages, each parallelized on its own; the module returned
    is then those stages as one (the whole model's parameter names), and the Pipeline runs them."""
    with torch.device("meta"):
        model = family.model_cls(args)
    parallelize = functools.partial(
        parallelize_model, family=family, dims=dims, mesh=mesh, training=training, parallelism=parallelism, ac=ac,
        compile=compile, float8=float8, device=device, planning=planning,
    )  # fmt: skip
    if not dims.pp_enabled:
        return parallelize(model), None
    pipeline = pipeline_model(
        model, mesh=mesh, cfg=parallelism, local_batch_size=training.local_batch_size, loss_fn=loss_fn,
        score_fn=loss_fn.cross_entropy_only(), parallelize=parallelize, device=device,
    )  # fmt: skip
    return pipeline.module, pipeline


def init_model(model: torch.nn.Module, pipeline: Pipeline | None, *, device: torch.device) -> None:
    """Allocate the (meta) parameters on `device` and initialize them, stage by stage under pipeline parallel."""
    for part in pipeline.parts if pipeline else [model]:
        part.to_empty(device=device)
        with warnings.catch_warnings():
            # On a CPU mesh DTensor's RNG cannot make sharded init match unsharded init; runs
            # that must start from identical weights load a seed checkpoint (initial_load_path).
            warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
            part.init_weights(buffer_device=device)
    model.train()


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def set_hyperparameters(optimizer: torch.optim.Optimizer, o: Optimizer) -> None:
    """The config's AdamW settings win over those a checkpoint restored into the param groups."""
    for group in optimizer.param_groups:
        group.update(betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def lr_factor(step: int, cfg: LRScheduler, *, training_steps: int) -> float:
    """Multiplier of optimizer.lr after `step` scheduler steps (the lr of training step step + 1):
    linear warmup, constant, decay; torchtitan's schedule, step for step.

    Warmup: step s (from 0) uses (s + 1) / warmup_steps, so the first step learns and step
    warmup_steps - 1 reaches the peak. Decay over the last decay_ratio of the steps (all of them after
    warmup when unset), ending one step past the last, so the last step's lr is not exactly 0.
    """
    total = cfg.total_steps if cfg.total_steps is not None else training_steps
    warmup = min(cfg.warmup_steps, total)
    decay = total - warmup if cfg.decay_ratio is None else min(round(total * cfg.decay_ratio), total - warmup)
    stable_end = total + 1 - decay  # warmup + stable steps, with one virtual step at the end
    if step < warmup:
        return (step + 1) / warmup
    if step < stable_end:
        return 1.0
    progress = (step + 1 - stable_end) / decay
    match cfg.decay_type:
        case "linear":
            decayed = 1.0 - progress
        case "sqrt":
            decayed = 1.0 - math.sqrt(progress)
        case "cosine":
            decayed = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * decayed


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, *, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Global L2 gradient norm (and clipping to max_norm > 0) over plain or DTensor grads.

    With sharded (DTensor) gradients the per-shard norms are partial results; `full_tensor()`
    reduces them across ranks, so every rank clips by the same, true global norm. Pipeline stages
    hold different parameters: their squared norms add up over `pp_group`.
    """
    parameters = [p for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], foreach=True)
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    if pp_group is not None:
        total_norm = total_norm**2
        dist.all_reduce(total_norm, group=pp_group)
        total_norm = total_norm.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=True)
    return total_norm


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


def save_seed_checkpoint(cfg: JobConfig, model: torch.nn.Module, *, world_size: int) -> int:
    if world_size != 1:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint: run it as one process (python train.py ...), not under torchrun"
        )
    checkpoint = CheckpointManager(
        cfg.checkpoint, dump_folder=cfg.job.dump_folder, model=model, optimizer=None, stateful={}
    )
    checkpoint.save(0, model_only=True, wait=True)
    return 0


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

    def restore_rng(self) -> None:
        if "cpu" in self.rng:
            torch.set_rng_state(self.rng["cpu"])
        if "cuda" in self.rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(self.rng["cuda"])


class GarbageCollection:
    """Python's cyclic garbage collector on every rank at the same steps (every training.gc_freq), and
    never in between: a collection that pauses one rank at a random moment stalls all the others at
    their next collective."""

    def __init__(self, *, every: int):
        self.every = every
        gc.disable()
        gc.collect(1)

    def step(self, step: int) -> None:
        if step > 1 and step % self.every == 0:
            gc.collect(1)  # the young generations: what a step leaves behind, in milliseconds

    def close(self) -> None:
        gc.enable()


class NonFiniteSteps:
    """Counts the steps whose update train_step skipped: non-finite loss or gradient norm (the run stops
    after training.skip_nonfinite_steps of them), and spikes (spikes.py: a warning each).

    Without a host sync per step: each step's flag, loss and norm go to host memory with a
    non-blocking copy, and are read one step later, when that copy has long finished. So a run
    that must stop stops one step after the bad one (whose update was skipped), naming it.
    """

    def __init__(self, *, tolerate: int, spike_sigma: float = 0.0):
        self.tolerate, self.skipped, self.spike_sigma, self.spikes = tolerate, 0, spike_sigma, 0
        self.pending: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None
        self.bad: tuple[int, float, float] | None = None  # (step, loss, grad norm) of the last skipped step

    def record(self, step: int, result: StepResult) -> None:
        values = torch.stack([result.finite, result.spike, result.loss.float(), result.grad_norm.float()])
        if values.is_cuda:
            host = torch.empty(len(values), pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._read()
            self.pending = (step, host, event)
        else:
            self.pending = (step, values, None)
            self._read()

    def _read(self) -> None:
        if self.pending is None:
            return
        step, values, event = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()  # the copy of an earlier step: already done
        finite, spike, loss, grad_norm = values.tolist()
        if spike:
            self.spikes += 1
            warn(
                f"training: step {step} had loss {loss:g} (this rank's) and gradient norm {grad_norm:g}, a spike "
                f"(more than training.skip_spike_sigma = {self.spike_sigma:g} standard deviations above the recent "
                f"steps'); its update was skipped ({self.spikes} so far)"
            )
        if not finite:
            self.skipped += 1
            self.bad = (step, loss, grad_norm)
            if self.skipped <= self.tolerate:
                warn(
                    f"training: step {step} had loss {loss:g} and gradient norm {grad_norm:g}; its update was skipped "
                    f"({self.skipped} of training.skip_nonfinite_steps = {self.tolerate})"
                )

    def exceeded(self) -> bool:
        return self.skipped > self.tolerate

    def message(self, *, last_checkpoint: str) -> str:
        step, loss, grad_norm = self.bad or (0, math.nan, math.nan)
        return (
            f"training.skip_nonfinite_steps: step {step} had loss {loss:g} and gradient norm {grad_norm:g} "
            f"({self.skipped} such steps, {self.tolerate} tolerated); its update was skipped and the run stops. "
            f"Last checkpoint: {last_checkpoint}. Lower optimizer.lr (or check the data) and rerun to resume from it"
        )


def world_mean(value: torch.Tensor, *, pp: int = 1) -> float:
    """Mean over all ranks: the data-parallel mean, as TP ranks of a group hold equal values. Under
    pipeline parallel (pp stages) only the ranks of the last stage hold the loss, the others 0."""
    value = value.detach().float().clone()
    dist.all_reduce(value)  # SUM: gloo has no AVG
    return value.item() * pp / dist.get_world_size()


def on_rank0(fn: Callable[[], T], *, rank: int) -> T | None:
    """Run `fn` on rank 0 only; a ConfigError there stops every rank. Rank 0 gets the result, the others None."""
    problems: list[list[str] | None] = [None]
    result = None
    if rank == 0:
        try:
            result = fn()
        except ConfigError as e:
            problems[0] = e.problems
    dist.broadcast_object_list(problems, src=0)
    if problems[0]:
        raise ConfigError(*problems[0])
    return result


def model_label(m: Model) -> str:
    """How start-up names the model: the flavor, or the Hugging Face folder that gives the shape."""
    return f"{m.name} {Path(m.hf_assets_path).name if m.shape_from_hf_config and m.hf_assets_path else m.flavor}"


def describe(cfg: JobConfig) -> str:
    """The resolved config plus the numbers derived from it (for --print-config)."""
    t, par = cfg.training, cfg.parallelism
    fam, args = family(cfg.model.name), model_args(cfg.model)
    # The world size torchrun would give, else the smallest one the degrees fit.
    world = int(os.environ.get("WORLD_SIZE", 0)) or (
        par.pipeline_parallel_degree
        * par.data_parallel_replicate_degree
        * max(par.data_parallel_shard_degree, 1)
        * par.context_parallel_degree
        * par.tensor_parallel_degree
    )
    dims = ParallelDims.from_config(par, world_size=world)
    global_batch = global_batch_size(t, dp=dims.dp)
    lines = [
        to_toml(cfg),
        "# derived",
        f"# model: {model_label(cfg.model)}",
        f"# parameters: {fam.num_params(args):,} ({fam.num_params(args, exclude_embedding=True):,} without embedding)",
        f"# training FLOPs per token at seq_len {t.seq_len}: {fam.num_flops_per_token(args, t.seq_len):.4g}",
        f"# tokens per step: {global_batch * t.seq_len:,} (global batch {global_batch} x seq_len {t.seq_len}; "
        f"world size {world}: data-parallel degree {dims.dp}, set WORLD_SIZE for another)",
    ]
    lines += [f"# note: {problem} (training needs it, planning does not)" for problem in input_problems(cfg)]
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as e:
        if is_rank0():
            for problem in e.problems:
                print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
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
