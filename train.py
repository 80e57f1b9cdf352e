"""Train Llama 3. Read top to bottom: main() builds everything, then runs the loop.

torchrun --nproc_per_node=2 train.py --config configs/debug.toml    # 2 CPU ranks (gloo)
torchrun --nproc_per_node=8 train.py --config configs/llama3_8b.toml
python train.py --config configs/debug.toml --training.steps=20     # one process
python train.py --help                                              # every option
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import doctor
from checkpoint import CheckpointManager
from config import JobConfig, LRScheduler, Optimizer, help_text, load_config, model_args, to_toml
from data import GlobalBatchLoader, PackedCorpus, build_tokenizer
from errors import ConfigError, is_rank0
from metrics import MetricsLogger, StepMetrics, peak_flops, peak_memory_gib
from models.llama3 import Transformer, num_flops_per_token, num_params
from models.llama3.model import with_seq_len
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize_llama
from parallelisms.tp import loss_parallel_context
from profiling import profile_loop

T = TypeVar("T")


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    print_config = "--print-config" in argv
    cfg = load_config([a for a in argv if a != "--print-config"])
    if print_config:
        print(describe(cfg))
        return 0

    device, rank, world_size = init_distributed()
    try:
        return train(cfg, device=device, rank=rank, world_size=world_size)
    finally:
        dist.destroy_process_group()


def train(cfg: JobConfig, *, device: torch.device, rank: int, world_size: int) -> int:
    t = cfg.training
    set_determinism(seed=t.seed, deterministic=t.deterministic)

    # Parallel layout and the data each rank reads.
    dims = ParallelDims.from_config(cfg.parallelism, world_size=world_size)
    # Pitfalls of this job on this machine, memory fit included (doctor.py, optional): warnings
    # on rank 0; errors stop every rank before anything is allocated.
    doctor.check_startup(cfg, world_size=world_size, device=device)
    mesh = dims.build_mesh(device.type)
    dp_rank = dims.dp_rank(mesh)
    global_batch = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dims.dp
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    # Rank 0 tokenizes and fills the on-disk cache first; the other ranks then read it.
    corpus = rank0_first(lambda: PackedCorpus(cfg.data, tokenizer, window=t.seq_len + 1), rank=rank)
    loader = GlobalBatchLoader(
        corpus, local_batch_size=t.local_batch_size, global_batch_size=global_batch,
        dp_rank=dp_rank, dp_degree=dims.dp,
    )  # fmt: skip

    # Model: meta device -> parallelize -> allocate -> initialize.
    args = with_seq_len(model_args(cfg.model), t.seq_len)  # the RoPE table covers seq_len
    model_name = cfg.model.hf_assets_path or cfg.model.flavor
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"model.tokenizer_path: the tokenizer has {tokenizer.vocab_size} tokens but {model_name} "
            f"embeds only {args.vocab_size}; use a matching tokenizer or flavor"
        )
    with torch.device("meta"):
        model = Transformer(args)
    model = parallelize_llama(
        model, dims=dims, mesh=mesh, training=t, parallelism=cfg.parallelism,
        ac=cfg.activation_checkpoint, compile=cfg.compile,
    )  # fmt: skip
    model.to_empty(device=device)
    with warnings.catch_warnings():
        # On a CPU mesh DTensor's RNG cannot make sharded init match unsharded init; runs
        # that must start from identical weights load a seed checkpoint (initial_load_path).
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        model.init_weights(buffer_device=device)
    model.train()

    # Stop requests need a CPU (gloo) group under NCCL. Checkpoints get a gloo group of their
    # own: an async save runs collectives in a background thread, and two threads issuing
    # collectives on one group interleave them and hang.
    ctrl_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    checkpoint_group = dist.new_group(backend="gloo")
    if cfg.checkpoint.create_seed_checkpoint:
        return save_seed_checkpoint(cfg, model, world_size=world_size)

    optimizer = build_optimizer(cfg.optimizer, model)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, steps=t.steps, cfg=cfg.lr_scheduler)
    )
    train_state = TrainState()
    checkpoint = CheckpointManager(
        cfg.checkpoint, dump_folder=cfg.job.dump_folder, model=model, optimizer=optimizer,
        stateful={"lr_scheduler": lr_scheduler, "dataloader": loader, "train_state": train_state},
        process_group=checkpoint_group,
    )  # fmt: skip
    start_step = checkpoint.load()
    train_state.restore_rng()

    flops_per_token = num_flops_per_token(args, t.seq_len)
    peak = peak_flops(device)
    tokens_per_step = global_batch * t.seq_len
    logger = MetricsLogger(cfg.metrics, dump_folder=cfg.job.dump_folder, total_steps=t.steps, enabled=rank == 0)
    if rank == 0:
        if cfg.job.description:
            print(cfg.job.description, flush=True)
        print(
            f"{model_name}: {num_params(args) / 1e6:,.1f}M parameters | world {world_size} = "
            f"replicate {dims.dp_replicate} x shard {dims.dp_shard} x tp {dims.tp} | global batch {global_batch} "
            f"x {t.seq_len} tokens, grad accumulation {loader.grad_accum} | {corpus.num_tokens:,} tokens in corpus "
            f"| device {device.type} | steps {start_step + 1}..{t.steps}",
            flush=True,
        )
    stop = StopSignal(ctrl_group)
    loss_parallel = dims.tp_enabled and not cfg.parallelism.disable_loss_parallel
    last_log_time, last_log_step = time.perf_counter(), start_step

    # ------------------------------------------------------------------ the loop
    # profiler.step() ends a step for the profiler and memory snapshots ([profiling]; no-ops by default).
    with profile_loop(cfg.profiling, dump_folder=cfg.job.dump_folder, rank=rank, start_step=start_step) as profiler:
        for step in range(start_step + 1, t.steps + 1):
            train_state.step = step
            loss, grad_norm = train_step(
                model, optimizer, loader.next_step(), grad_accum=loader.grad_accum, max_norm=t.max_norm,
                loss_parallel=loss_parallel, device=device,
            )  # fmt: skip
            lr = lr_scheduler.get_last_lr()[0]
            lr_scheduler.step()

            last = step == t.steps
            if step % cfg.metrics.log_freq == 0 or last:
                loss_avg = world_mean(loss)  # the one host sync of a logged step
                now = time.perf_counter()
                step_time = (now - last_log_time) / (step - last_log_step)
                tps = tokens_per_step / world_size / step_time
                logger.log(
                    StepMetrics(
                        step=step, loss=loss_avg, grad_norm=grad_norm.item(), lr=lr, tps=tps,
                        mfu=100 * flops_per_token * tps / peak if peak else None,
                        memory_gib=peak_memory_gib(device), step_time_s=step_time,
                    ),
                    first_step=start_step,
                )  # fmt: skip
                last_log_time, last_log_step = time.perf_counter(), step

            if stop.requested():
                checkpoint.save(step, wait=True)
                if rank == 0:
                    print(f"SIGTERM: saved step {step} and stopped; rerun the same command to resume", flush=True)
                break
            if checkpoint.should_save(step, last=last):
                checkpoint.save(step, wait=last)
            profiler.step()
    if cfg.checkpoint.export_safetensors:
        checkpoint.export_safetensors(train_state.step)
    checkpoint.close()
    logger.close()
    return 0


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    microbatches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    grad_accum: int,
    max_norm: float,
    loss_parallel: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over `grad_accum` micro-batches; returns (loss, grad norm) tensors."""
    optimizer.zero_grad(set_to_none=True)
    total_loss = torch.zeros((), device=device)
    for inputs, labels in microbatches:
        # Under loss parallel the logits stay sharded over the vocabulary (TP ranks) and
        # cross-entropy runs on the shards; the context must cover backward too.
        with loss_parallel_context(loss_parallel):
            logits = model(inputs.to(device))  # (bs, seqlen, vocab)
            # Cross-entropy in fp32 whatever the compute dtype; / grad_accum so that the
            # accumulated gradient is the mean over the whole global batch.
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.to(device).flatten()) / grad_accum
            del logits  # autograd keeps what backward needs; this frees bs x seqlen x vocab early
            loss.backward()
        total_loss += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
    grad_norm = clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return total_loss, grad_norm


# ------------------------------------------------------------------- builders


def init_distributed() -> tuple[torch.device, int, int]:
    """NCCL on CUDA, gloo on CPU; a one-process group when not launched by torchrun."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device, dist.get_rank(), dist.get_world_size()


def set_determinism(*, seed: int, deterministic: bool) -> None:
    """The same seed on every rank: ranks differ by the data they read, not by their RNG."""
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def build_optimizer(o: Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[o.implementation]
    match o.name:
        case "AdamW":
            return torch.optim.AdamW(
                model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **impl
            )


def lr_factor(step: int, *, steps: int, cfg: LRScheduler) -> float:
    """Multiplier of optimizer.lr after `step` scheduler steps: warmup, constant, decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)  # never exactly 0: the first step learns
    decay_steps = steps - cfg.warmup_steps if cfg.decay_ratio is None else round(steps * cfg.decay_ratio)
    decay_start = steps - decay_steps
    if step < decay_start or decay_steps <= 0:
        return 1.0
    progress = min((step - decay_start) / decay_steps, 1.0)
    match cfg.decay_type:
        case "linear":
            decayed = 1.0 - progress
        case "sqrt":
            decayed = 1.0 - math.sqrt(progress)
        case "cosine":
            decayed = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * decayed


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 gradient norm (and clipping to max_norm > 0) over plain or DTensor grads.

    With sharded (DTensor) gradients the per-shard norms are partial results; `full_tensor()`
    reduces them across ranks, so every rank clips by the same, true global norm.
    """
    parameters = [p for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], foreach=True)
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=True)
    return total_norm


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
    """Step and RNG state, checkpointed so that a resumed run continues the same stream."""

    step: int = 0
    rng: dict[str, torch.Tensor] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {"step": self.step, "rng": rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.rng = int(state["step"]), state["rng"]

    def restore_rng(self) -> None:
        if "cpu" in self.rng:
            torch.set_rng_state(self.rng["cpu"])
        if "cuda" in self.rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(self.rng["cuda"])


class StopSignal:
    """SIGTERM sets a flag; all ranks agree on it each step, so they stop at the same step."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.flag = torch.zeros(1)
        signal.signal(signal.SIGTERM, lambda *_: self.flag.fill_(1))

    def requested(self) -> bool:
        agreed = self.flag.clone()
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        return bool(agreed.item())


def world_mean(value: torch.Tensor) -> float:
    """Mean over all ranks: the data-parallel mean, as TP ranks of a group hold equal values."""
    value = value.detach().float().clone()
    dist.all_reduce(value)  # SUM: gloo has no AVG
    return value.item() / dist.get_world_size()


def rank0_first(build: Callable[[], T], *, rank: int) -> T:
    """Run `build` on rank 0, then on the others; a ConfigError on rank 0 stops every rank."""
    problems: list[list[str] | None] = [None]
    result = None
    if rank == 0:
        try:
            result = build()
        except ConfigError as e:
            problems[0] = e.problems
    dist.broadcast_object_list(problems, src=0)
    if problems[0]:
        raise ConfigError(*problems[0])
    return result if rank == 0 else build()


def describe(cfg: JobConfig) -> str:
    """The resolved config plus the numbers derived from it (for --print-config)."""
    t, par = cfg.training, cfg.parallelism
    args = model_args(cfg.model)
    # The world size torchrun would give, else the smallest one the degrees fit.
    world = (
        int(os.environ.get("WORLD_SIZE", 0))
        or par.data_parallel_replicate_degree * max(par.data_parallel_shard_degree, 1) * par.tensor_parallel_degree
    )
    dims = ParallelDims.from_config(par, world_size=world)
    global_batch = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dims.dp
    lines = [
        to_toml(cfg),
        "# derived",
        f"# parameters: {num_params(args):,} ({num_params(args, exclude_embedding=True):,} without embedding)",
        f"# training FLOPs per token at seq_len {t.seq_len}: {num_flops_per_token(args, t.seq_len):.4g}",
        f"# tokens per step: {global_batch * t.seq_len:,} (global batch {global_batch} x seq_len {t.seq_len}; "
        f"world size {world}: data-parallel degree {dims.dp}, set WORLD_SIZE for another)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as e:
        if is_rank0():
            for problem in e.problems:
                print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
