"""Throughput, MFU, memory and the metrics log (console, metrics.jsonl, TensorBoard). The counters of
what really ran, which the tests and `make bench` use, are in tests/instruments.py."""

from __future__ import annotations

import functools
import json
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from config import JobConfig, Metrics
from distributed import collective_on_rank0, mean_over_loss_ranks
from errors import ConfigError

if TYPE_CHECKING:
    from data.loader import GlobalBatchLoader
    from loss import LossTerms
    from models.moe import Balancer

# Dense (no sparsity) bf16 tensor-core peak, FLOP/s, by a substring of the device name.
# Order matters: the first match wins ("H100 NVL" before "H100").
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("MI300X", 1307e12),
    ("MI325X", 1307e12),
]


def peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of `device`, or None when unknown (CPU, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA reserved memory, or the peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB


@dataclass
class StepResult:
    """What train.py's `train_step` returns: device tensors, no host sync."""

    loss: LossTerms  # this rank's loss terms, each summed over its micro-batches over their divisors (loss.py)
    grad_norm: torch.Tensor  # the global gradient norm, before clipping


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tps: float  # tokens per second per device
    mfu: float | None  # percent
    memory_gib: float
    step_time_s: float
    # The loss's extra terms, unweighted, by name (training.z_loss_weight > 0: z_loss); `loss` is the cross-entropy.
    terms: dict[str, float] = field(default_factory=dict)
    tokens_per_source: dict[str, int] | None = None  # data.mixture: tokens trained from each source so far
    # A mixture of experts that balances (models/moe.py): the load-balancing loss, unweighted, as [model.moe] counts
    # it, and per MoE layer the max / mean of the tokens per expert over the step's global batch.
    moe_aux_loss: float | None = None
    moe_load: dict[int, float] | None = None
    warmup: bool = False  # the first steps of a process: tps and mfu include start-up (compilation, allocation)


class MetricsLogger:
    """Rank 0 prints a line per logged step and appends it to <dump_folder>/metrics.jsonl, and to
    TensorBoard and Weights & Biases when enabled; validations get a line and a row of their own
    (`validation_loss`).

    A run that starts at `start_step` (resumed, or 0) first drops the rows of later steps that an
    earlier run of this folder logged, so each step appears once, from the run that trained it.
    """

    def __init__(
        self,
        cfg: Metrics,
        *,
        dump_folder: str,
        total_steps: int,
        start_step: int,
        enabled: bool,
        run_config: dict[str, Any] | None = None,
    ):
        self.total_steps, self.start_step = total_steps, start_step
        self.enabled = enabled
        self.start, self.paused = time.perf_counter(), 0.0  # paused: seconds outside training steps (pause)
        self.jsonl = Path(dump_folder) / "metrics.jsonl"
        self.tb = self.wandb = None
        if enabled:
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            if self.jsonl.exists():
                kept = [row for row in self.jsonl.read_text().splitlines() if json.loads(row)["step"] <= start_step]
                tmp = self.jsonl.with_suffix(".tmp")
                tmp.write_text("".join(row + "\n" for row in kept))
                os.replace(tmp, self.jsonl)
            if cfg.enable_tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(dump_folder) / cfg.save_tb_folder))
            if cfg.enable_wandb:
                # The usual WANDB_* variables apply (WANDB_PROJECT, WANDB_MODE=offline, WANDB_API_KEY, ...).
                import wandb

                try:
                    self.wandb = wandb.init(
                        project=os.environ.get("WANDB_PROJECT", "llama3-recipe"), dir=dump_folder, config=run_config
                    )
                except (wandb.Error, OSError) as e:
                    raise ConfigError(
                        f"metrics.enable_wandb: wandb could not start a run ({str(e).strip().splitlines()[0]}); run "
                        "`wandb login` or set WANDB_API_KEY, or log locally with WANDB_MODE=offline"
                    ) from None

    @classmethod
    def for_run(cls, cfg: JobConfig, *, start_step: int) -> MetricsLogger:
        """The run's logger on every rank, enabled on rank 0; a logger that cannot start there (wandb without
        credentials) stops every rank with its error."""
        logger = functools.partial(
            cls, cfg.metrics, dump_folder=cfg.job.dump_folder, total_steps=cfg.training.steps, start_step=start_step,
            run_config=cfg.to_dict(),
        )  # fmt: skip
        return collective_on_rank0(lambda: logger(enabled=True), rank=dist.get_rank()) or logger(enabled=False)

    def log(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        done = (m.step - self.start_step) / max(self.total_steps - self.start_step, 1)
        training = time.perf_counter() - self.start - self.paused  # the rate of training steps alone
        eta = training / done - training if done > 0 else 0.0
        mfu = f"{m.mfu:.1f}%" if m.mfu is not None else "n/a"
        width = len(str(self.total_steps))
        print(
            f"step {m.step:>{width}}/{self.total_steps} ({100 * m.step / self.total_steps:3.0f}%)"
            f" | loss {m.loss:7.4f}"
            + "".join(f" | {name} {value:.4g}" for name, value in m.terms.items())
            + (_moe(m.moe_aux_loss, m.moe_load) if m.moe_load else "")
            + f" | grad_norm {m.grad_norm:7.3f} | lr {m.lr:.2e}"
            f" | tps/rank {m.tps:,.0f}{' (warm-up)' if m.warmup else ''} | mfu {mfu} | mem {m.memory_gib:.2f} GiB"
            f" | step {m.step_time_s * 1000:.0f} ms | eta {_duration(eta)}",
            flush=True,
        )
        scalars = {k: getattr(m, k) for k in ("loss", "grad_norm", "lr", "tps", "mfu", "memory_gib", "step_time_s")}
        scalars |= m.terms
        scalars |= {f"tokens_{name}": tokens for name, tokens in (m.tokens_per_source or {}).items()}
        if m.moe_load:
            scalars["moe_aux_loss"] = m.moe_aux_loss
            scalars |= {f"moe_load_{layer}": load for layer, load in m.moe_load.items()}
        self._write(m.step, scalars)

    def log_ranks(self, step: int, per_rank: dict[str, list[float]], *, line: str | None = None) -> None:
        """Figures of every rank (fleet/monitor.py): a row of lists in metrics.jsonl, `<name>/rank<N>` scalars elsewhere; and
        `line` on the console when given."""
        if not self.enabled:
            return
        if line is not None:
            print(line, flush=True)
        with self.jsonl.open("a") as f:
            f.write(json.dumps({"step": step, **per_rank}) + "\n")
        scalars = {f"{name}/rank{r}": value for name, values in per_rank.items() for r, value in enumerate(values)}
        for key, value in scalars.items() if self.tb is not None else ():
            self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def pause(self, seconds: float) -> None:
        """Leave `seconds` spent outside training steps (a validation, a checkpoint save) out of the ETA's rate."""
        self.paused += seconds

    def log_validation(self, step: int, loss: float, tokens: int, seconds: float) -> None:
        if not self.enabled:
            return
        print(f"validation at step {step}: loss {loss:7.4f} | {tokens:,} tokens | {seconds:.1f} s", flush=True)
        self._write(step, {"validation_loss": loss, "validation_tokens": tokens, "validation_s": seconds})

    def log_eval(self, step: int, scores: dict[str, float], *, documents: int, seconds: float) -> None:
        """lm-eval's scores of the step (evaluation/downstream.py): "eval/<task>/<metric>" keys."""
        if not self.enabled:
            return
        tasks: dict[str, list[str]] = {}
        for key, value in scores.items():
            _, task, metric = key.split("/", 2)
            tasks.setdefault(task, []).append(f"{metric} {value:.4f}")
        said = " | ".join(f"{task} {' '.join(values)}" for task, values in tasks.items())
        print(f"eval at step {step}: {said} | {documents:,} documents | {seconds:.1f} s", flush=True)
        self._write(step, {**scores, "eval_documents": documents, "eval_s": seconds})

    def _write(self, step: int, values: dict[str, float | None]) -> None:
        with self.jsonl.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        known = {key: value for key, value in values.items() if value is not None}  # MFU off a GPU
        for key, value in known.items() if self.tb is not None else ():
            self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(known, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


class LogStep:
    """After each step: every metrics.log_freq steps and after the last, the step's metrics go to the
    logger (rank 0). Reading the loss is the one host sync of a logged step; the others read nothing.

    Throughput is averaged over the steps since the last logged one, the time of the work after the log (validations,
    evals, checkpoint saves: train.py's AfterStepWork measures it) left out (`pause`), of the logger's ETA too; the
    first logged window of a process includes start-up
    (compilation, allocation) and says so."""

    def __init__(
        self,
        cfg: JobConfig,
        *,
        logger: MetricsLogger,
        loader: GlobalBatchLoader,
        start_step: int,
        flops_per_token: float,
        device: torch.device,
        lr: Callable[[], float],
        routing: Balancer | None = None,
    ):
        t = cfg.training
        self.logger, self.loader, self.freq, self.total_steps = logger, loader, cfg.metrics.log_freq, t.steps
        self.routing = routing  # a mixture of experts' balancing, which has the step's routing (models/moe.py)
        self.seq_len = t.seq_len
        self.tokens_per_device = loader.global_batch_size * t.seq_len / dist.get_world_size()
        self.flops_per_token, self.peak, self.device = flops_per_token, peak_flops(device), device
        self.pp_degree = cfg.parallelism.pipeline_parallel_degree
        self.lr = lr
        self.first_step = start_step + 1
        self.since, self.since_step = time.perf_counter(), start_step

    def pause(self, seconds: float) -> None:
        """Leave `seconds` (a validation, a checkpoint save) out of the throughput and the ETA."""
        self.since += seconds
        self.logger.pause(seconds)

    def __call__(self, step: int, result: StepResult) -> bool:
        if not logged(step, freq=self.freq, total_steps=self.total_steps):
            return False
        mean = lambda value: mean_over_loss_ranks(value, pp_degree=self.pp_degree).item()  # noqa: E731
        loss, terms = mean(result.loss.cross_entropy), {name: mean(v) for name, v in result.loss.extras.items()}
        routing = self.routing.summary() if self.routing is not None else None
        now = time.perf_counter()
        step_time = (now - self.since) / (step - self.since_step)
        tps = self.tokens_per_device / step_time
        self.logger.log(
            StepMetrics(
                step=step,
                loss=loss,
                terms=terms,
                grad_norm=result.grad_norm.item(),
                lr=self.lr(),
                tps=tps,
                mfu=100 * self.flops_per_token * tps / self.peak if self.peak else None,
                memory_gib=peak_memory_gib(self.device),
                step_time_s=step_time,
                tokens_per_source=self._tokens_per_source(),
                moe_aux_loss=routing.aux_loss if routing is not None else None,
                moe_load=routing.load if routing is not None else None,
                warmup=self.since_step < self.first_step,
            )
        )
        self.since, self.since_step = time.perf_counter(), step
        return False

    def _tokens_per_source(self) -> dict[str, int] | None:
        """data.mixture: the tokens trained from each source so far."""
        if self.loader.mixture is None:
            return None
        samples = self.loader.samples_per_source()
        return {name: n * self.seq_len for name, n in zip(self.loader.corpus.names, samples, strict=True)}


def logged(step: int, *, freq: int, total_steps: int) -> bool:
    """Whether step `step` is logged: every metrics.log_freq steps and the last."""
    return step % freq == 0 or step == total_steps


def _moe(aux_loss: float | None, load: dict[int, float]) -> str:
    """The console's routing: the load-balancing loss and the most unbalanced layer's max / mean tokens per expert."""
    worst = max(load, key=load.__getitem__)
    return f" | moe aux {aux_loss:.4f} load {load[worst]:.2f} (layer {worst})"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"
