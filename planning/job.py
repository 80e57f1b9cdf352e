"""What every planning tool reads of a job: its `JobConfig`, the `ParallelDims` of its ranks and the `Machine` they run
on, together as a `Job` (the estimator's, the doctor's and the dry run's one vocabulary), with what follows from the
three (micro-batches, FSDP's shards, the loss's chunk). The lowest module of planning/: the others import it."""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from config import JobConfig, global_batch_size, grad_accum_steps, model_args
from errors import ConfigError
from loss import chunk_tokens_for
from models import ModelFamily, family
from parallelisms.fsdp import applies_fsdp
from parallelisms.parallel_dims import ParallelDims, layout_problems
from parallelisms.pp import stage_layers

GiB = 2**30
RMSNorm = Literal["fused", "composite"]


@dataclass(frozen=True)
class Machine:
    """What the job runs on, which no config key holds; `Machine.this()` reads it off this machine. The last three
    fields are what the memory estimate assumes of it; None: what a CUDA GPU (or a CPU rank) has."""

    cuda: bool  # CUDA GPUs with NCCL; False: CPU processes (gloo)
    gpus_per_node: int | None = None
    cpu_has_bf16: bool | None = None
    device_memory_gib: float | None = None  # one GPU's, or on CPU the host's RAM, shared by its ranks
    environ: Mapping[str, str] | None = None
    # The caching allocator reserves more than it allocates (docs/planning.md, "How the estimator counts": "Reserved");
    # a CPU rank has none, reserved = allocated.
    caching_allocator: bool | None = None
    overhead_gib: float | None = None  # CUDA context + NCCL, outside the allocator
    rmsnorm: RMSNorm | None = (
        None  # the fused CUDA kernel (torch >= 2.8), or the composite one (CPU eager, older torch)
    )

    @classmethod
    def this(cls, *, cuda: bool | None = None, device_memory_gib: float | None = None) -> Machine:
        have_cuda = torch.cuda.is_available()
        cuda = have_cuda if cuda is None else cuda
        gpus = os.environ.get("LOCAL_WORLD_SIZE", "")
        if device_memory_gib is None and cuda:
            device_memory_gib = torch.cuda.get_device_properties(0).total_memory / GiB if have_cuda else 80.0
        elif device_memory_gib is None:
            device_memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
        return cls(
            cuda=cuda,
            gpus_per_node=int(gpus) if gpus.isdigit() else (torch.cuda.device_count() or None) if have_cuda else None,
            cpu_has_bf16=None if cuda else _probe_cpu_bf16(),
            device_memory_gib=device_memory_gib,
            environ=os.environ,
        )

    @property
    def cuda_memory_gib(self) -> float | None:
        """One GPU's memory; None without CUDA (or where it is not known)."""
        return self.device_memory_gib if self.cuda else None

    @property
    def reserves(self) -> bool:
        """Whether a caching allocator reserves beyond the allocated bytes: CUDA's, unless `caching_allocator` says."""
        return self.cuda if self.caching_allocator is None else self.caching_allocator

    @property
    def overhead(self) -> float:
        """Bytes outside the allocator: CUDA context + NCCL (2 GiB assumed); a CPU process has 0.5 GiB of its own."""
        return (self.overhead_gib if self.overhead_gib is not None else 2.0 if self.cuda else 0.5) * GiB

    @property
    def norm(self) -> RMSNorm:
        """The RMSNorm kernel: CUDA's fused one, the CPU's eager composite one, unless `rmsnorm` says."""
        return self.rmsnorm or ("fused" if self.cuda else "composite")


def _probe_cpu_bf16() -> bool | None:
    """Whether this x86 CPU has native bf16 matmul instructions; None off x86 or without the probes."""
    # torch.cpu's ISA probes are private (no public API as of PyTorch 2.13); used only here.
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if platform.machine().lower() not in ("x86_64", "amd64") or not all(probes):
        return None
    return any(probe() for probe in probes)


GPU = Machine(cuda=True)
CPU = Machine(cuda=False)


@dataclass(frozen=True)
class Job:
    """A run's config on its ranks and machine, as the planning tools read it (`Job.of`). Beside the three, what no
    config key or machine holds: a model shape, and the questions the estimate is asked (how unbalanced a routing,
    a loop that keeps its logits)."""

    cfg: JobConfig
    dims: ParallelDims
    machine: Machine
    args: Any  # the model's shape: the flavor's or a Hugging Face config.json's (model_args), or one no flavor has
    # Under expert parallel, the rows each MoE block's experts on this rank receive, as a multiple of balanced
    # routing's (its ep group's tokens x top_k / ep): 1 balanced; up to ep where routing sends all of the group's rows
    # to this rank's experts. No capacity factor drops any (parallelisms/ep.py): the experts' buffers grow with it.
    ep_load: float = 1.0
    # train.py, like torchtitan, deletes the logits before loss.backward(); a loop that keeps
    # them alive holds T x V/tp more elements in param_dtype through the loss backward.
    logits_kept_in_backward: bool = False

    @classmethod
    def of(cls, cfg: JobConfig, machine: Machine, *, world_size: int, args: Any = None) -> Job:
        """`cfg` on `world_size` ranks of `machine`. ConfigError for a shape the layout cannot split, which the run
        itself refuses with its own message."""
        if problems := layout_problems(cfg, world_size=world_size):
            raise ConfigError(*problems)
        dims = ParallelDims.from_config(cfg.parallelism, world_size=world_size)
        return cls(cfg, dims, machine, model_args(cfg.model) if args is None else args)

    @property
    def lora(self) -> Any:
        """The run's [lora] section where it trains adapters (lora.py), else None (also in a fork that removed LoRA:
        docs/development.md "Removing a part"; planning names no key of it otherwise)."""
        lora = getattr(self.cfg, "lora", None)
        return lora if lora is not None and lora.enable else None

    @property
    def fam(self) -> ModelFamily:
        return family(self.cfg.model.name)

    @property
    def shard(self) -> int:
        """The ranks FSDP shards parameters over: dp_shard x cp."""
        return self.dims.dp_shard * self.dims.cp

    @property
    def efsdp(self) -> int:
        """Under expert parallel, the ranks FSDP shards each rank's experts over (ParallelDims.efsdp); without it the
        experts are sharded as the rest of their block, over `shard`."""
        return self.dims.efsdp if self.dims.ep > 1 else self.shard

    @property
    def local_seq_len(self) -> int:
        """The tokens of each window this rank computes: seq_len / cp."""
        return self.cfg.training.seq_len // self.dims.cp

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step: training.global_batch_size / (local_batch_size x dp). From the second on,
        the gradient shards of the earlier ones are alive through forward and backward."""
        t, dp = self.cfg.training, self.dims.dp
        return grad_accum_steps(global_batch_size(t, dp=dp), local_batch=t.local_batch_size, dp=dp)

    @property
    def stages(self) -> list[list[int]]:
        """The blocks of every (virtual) pipeline stage; one stage of all blocks without PP."""
        return stage_layers(self.args, self.cfg.parallelism) if self.dims.pp > 1 else [list(range(self.args.n_layers))]

    @property
    def microbatches(self) -> int:
        """Micro-batches of the pipeline per local batch (1 without PP; grad_accum counts the loader's)."""
        if self.dims.pp == 1:
            return 1
        return self.cfg.training.local_batch_size // self.cfg.parallelism.pipeline_parallel_microbatch_size

    @property
    def microbatch_tokens(self) -> int:
        """T: the tokens one forward of a stage (or of the model, without PP) processes on this rank."""
        par, t = self.cfg.parallelism, self.cfg.training
        return (par.pipeline_parallel_microbatch_size if self.dims.pp > 1 else t.local_batch_size) * self.local_seq_len

    @property
    def cpu_offload(self) -> bool:
        """training.enable_cpu_offload, on CUDA (a CPU rank's state is on the host already)."""
        return self.cfg.training.enable_cpu_offload and self.machine.cuda

    @property
    def fsdp(self) -> bool:
        """Whether the run shards with FSDP; a job of one rank does not, and trains a bf16 param_dtype under autocast
        (parallelisms/fsdp.py applies_fsdp)."""
        param_dtype = self.cfg.training.mixed_precision_param
        return applies_fsdp(self.dims, param_dtype=param_dtype, cpu_offload=self.cpu_offload)

    @property
    def defers_reduce_scatter(self) -> bool:
        """parallelism.fsdp_defer_reduce_scatter where it changes something: FSDP, several micro-batches, no PP.
        Then every unit's gradient stays unsharded in reduce_dtype from the first micro-batch's backward to the step's
        last (parallelisms/fsdp.py)."""
        return (
            self.cfg.parallelism.fsdp_defer_reduce_scatter and self.fsdp and self.grad_accum > 1 and self.dims.pp == 1
        )

    @property
    def accumulates_unsharded(self) -> bool:
        """Whether gradients are summed unsharded in reduce_dtype across micro-batches: pipeline stages always,
        FSDP when it defers its reduce-scatters."""
        return self.dims.pp > 1 or self.defers_reduce_scatter

    @property
    def autocast(self) -> bool:
        return not self.fsdp and self.cfg.training.mixed_precision_param != "float32"

    @property
    def loss_parallel(self) -> bool:
        """Not parallelism.disable_loss_parallel: under TP the loss runs on vocabulary shards."""
        return not self.cfg.parallelism.disable_loss_parallel

    @property
    def chunk_tokens(self) -> int:
        """The loss's chunk for this job's micro-batches (loss.chunk_tokens_for of training.loss_chunk_tokens: -1,
        chunks where the logits are large; 0, torchtitan's loss, all at once)."""
        shards = self.dims.tp if self.loss_parallel else 1
        return chunk_tokens_for(
            self.cfg.training.loss_chunk_tokens, tokens=self.microbatch_tokens, vocab=self.args.vocab_size // shards
        )

    @property
    def muon(self) -> bool:
        """optimizer.name = "Muon" (muon.py): one momentum for the hidden matrices, its exchange at the step."""
        return self.cfg.optimizer.name == "Muon"
