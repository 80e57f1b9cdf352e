"""Predict per-GPU memory of a training setup before asking for GPUs (docs/failures.md #5).

    python estimate_memory.py --flavor llama3_8b --ngpu 8 --local-batch-size 2 --ac selective-op
    python estimate_memory.py --flavor llama3_70b --ngpu 64 --tp 8 --local-batch-size 8 --ac full
    python estimate_memory.py --flavor llama3_405b --ngpu 512 --tp 8 --pp 8 --local-batch-size 8 --ac full
    python estimate_memory.py --references   # against torchtitan's published peaks

Components, per GPU (formulas below, where each term is one tensor):

  sharded state     fp32 params and AdamW exp_avg + exp_avg_sq: 4 + 8 bytes per parameter /
                    (dp_shard x tp) (norm weights are not TP-sharded), for the whole run. bf16
                    param_dtype does not shrink them; --cpu-offload moves them to host memory.
  gradient shards   fp32, 4 bytes per parameter likewise, but not always there: train.py's
                    zero_grad(set_to_none=True) frees them before the first micro-batch, and FSDP
                    creates each block's shard when it reduce-scatters that block's gradient in
                    backward. So at the loss backward of a step of one micro-batch there are none; they
                    grow block by block while backward frees activations (the "block phase" below).
                    With gradient accumulation (--grad-accum > 1) the later micro-batches hold all of
                    them from start to end.
  gathered params   FSDP units all-gathered in param_dtype: the root unit (norm + output), gathered
                    for the whole step, and in backward two blocks (the one in backward and the
                    prefetched one). bf16 halves them.
  activations       per block as documented under "Activations" below (no AC: norms, q/k/v/out
                    and logsumexp of SDPA, four T x F tensors of the SwiGLU; full AC: the block
                    input; selective op: the block input + every other matmul output + SDPA's
                    outputs; selective k: full AC on every k-th block), plus the final norm and token
                    ids. The same formulas agree with the bytes benchmarks/memory.py measures on the
                    debug model to within 2% (benchmarks/test_memory.py).
  logits + loss     T x V/tp logits. Forward: bf16 logits + fp32 copy + fp32 log-softmax (saved)
                    = 2+4+4 bytes per logit. Start of backward (higher): the saved log-softmax +
                    the fp32 gradients of nll and of log-softmax = 12 bytes (tp = 1, fused
                    cross-entropy); under loss parallel (tp > 1) torch's DTensor backward keeps up
                    to 4 fp32 temporaries (zeros_like(x), exp(x), their sum, the product): 16 bytes.
                    train.py (like torchtitan) frees the logits before backward; --keep-logits adds
                    2 bytes per logit for a loop that holds them. The chunked loss
                    (--loss-chunk-tokens C, training.loss_chunk_tokens, loss.py) saves no logits:
                    backward recomputes C tokens at a time, a + 4 + 4 + (8 or 12) bytes per
                    logit of C x V/tp, plus the fp32 gradient of the final norm's output (4*T*D)
                    and the output projection's gradient, which the chunks accumulate (a*V*D/tp).
  root gradient     the unsharded gradient of the root unit (output projection + final norm) in
                    param_dtype, a*(V*D/tp + D): FSDP reduce-scatters it only when the whole backward
                    is over (the root's inputs are token ids, so its post-backward hook is the final
                    callback), so it is alive through every block's backward.
  block backward    the recomputation of one checkpointed block (what it did not keep), its
                    activation gradients (~2 T x D + 2 T x F) and its unsharded gradient in
                    param_dtype + the reduce_dtype copy FSDP reduce-scatters.
  peak (allocated)  state + the worst of the backward's phases, each a sum of what is alive then:
                      loss       root unit + all activations + logits/loss buffers (+ the chunked
                                 loss's output gradient), no gradient shards at grad_accum 1;
                      block i    root unit + two blocks + root gradient + the gradient shards of
                                 the blocks after i + the activations of blocks 0..i + block i's
                                 backward; evaluated for every block, which is exact within this
                                 model (it is linear between the first block, all activations and
                                 no shards, and the last, all shards and one block's activations,
                                 except where selective-k alternates block sizes);
                      embedding  root + embedding units, all shards, the embedding's dense
                                 gradient and its reduce_dtype copy (no activations left).
                    ~ torch.cuda.max_memory_allocated.
  reserved          torch.cuda.max_memory_reserved, what the caching allocator holds (see "Reserved").
  overhead          CUDA context, cuBLAS workspaces, NCCL buffers: a fixed --overhead-gib (default
                    2 GiB; ~0.5-1 for the context, ~1 for NCCL on 8 GPUs), outside PyTorch's allocator.
  total             reserved + overhead: what doctor.py compares with the device's memory.

Reserved. The caching allocator keeps freed blocks in a pool per CUDA stream, and a block cached by
one stream serves no other. FSDP2 (torch 2.13, _fsdp_collectives.py) allocates each unit's gradient
shards in the reduce-scatter stream and its flat all-gather output in the all-gather copy-in stream,
and the rest (unsharded parameters, activations, temporaries) in the compute stream. Hence:

    reserved = sharded params + AdamW state                  allocated once, never freed
             + gradient shards                               reduce-scatter stream: zero_grad frees
                                                             them, only the next step's
                                                             reduce-scatters reuse them, so they
                                                             count also at a peak that comes first
             + a x max(largest unit, 2 blocks)               all-gather stream: the flat outputs
                                                             in flight
             + (1 + FRAGMENTATION) x compute-stream peak     allocated peak - state - shards at it

FRAGMENTATION (rounding, split blocks too small for the next request, and whatever transient the
model misses) is calibrated on torchtitan's two reserved peaks that differ only in the sharded state
(REFERENCES: eager FSDP, 8B, batch 2 x 8192, op SAC): 82.4 GiB on 8 GPUs, 67.0 on 128. Both peaks
are at the loss backward, where the compute stream holds 56.2 GiB in either job; the rest of the rule
is 15.9 and 1.9 GiB. The 15.4 GiB the published peaks differ by is what the stream pools predict
(14.0: 16 bytes per parameter / 8 - / 128), not what the allocated peaks do (10.5: no gradients at
the loss backward). Each reference alone asks for 18.4% and 15.9%; their mean, 17%, puts both
within 1% (81.6 and 67.6 GiB). Without the caching allocator (--allocator cpu: CPU ranks)
reserved = allocated.

Pipeline parallel (--pp, parallelisms/pp.py). The stages come from parallelisms.pp.stage_layers
(the run's own split); pp rank r runs stages r, r + pp, ... Each rank is estimated and the worst
reported (--pp-rank picks one). What changes on a rank:
  * parameters: its stages' blocks, the embedding on stage 0, norm + output on the last, each
    sharded over dp_shard x tp; the others' are not there.
  * FSDP does not reshard after forward (parallelisms/fsdp.py), and torch's pipeline stages run every
    backward without gradient sync and without resharding, then reduce-scatter once after the step's
    last (pipelining/stage.py: set_requires_gradient_sync(False), perform_reduce_grad): the
    rank's stages stay gathered in param_dtype (a bytes per parameter of the rank, / tp) from their
    first forward to the end of the step, and their gradients accumulate unsharded in reduce_dtype
    (FSDP's unsharded_accumulated_grad: r bytes) from each stage's first backward on; the
    reduce-scatter to fp32 shards happens once, at the end of the step.
  * activations: per micro-batch (pp_microbatch_size sequences), for each micro-batch a stage has run
    forward on and not yet backward, plus the stage's output (a*T*D/tp, kept for its backward) on all
    but the last stage. The rank's forward and backward order is the schedule's:
      GPipe          every micro-batch's forward, then every backward: n_mb held;
      1F1B           stage s of S runs min(n_mb, S - s) forwards, then backward/forward pairs, so it
                     holds min(n_mb, S - s) during each backward (torch's Schedule1F1B);
      Interleaved1F1B, InterleavedZeroBubble: the order torch plans for the rank
                     (_calculate_single_rank_operations, torch 2.13), replayed; a micro-batch holds
                     one stage's activations. Zero bubble splits backward into input (I) and weight
                     (W) gradients: between the two a micro-batch is counted with the inputs its
                     weight gradients need (per block a*T*(2D + (Dq + F)/tp)), an estimate that
                     ignores what autograd frees earlier.
  * the loss phase only on the rank with the last stage; the embedding phase only on stage 0.
  * pp send/recv buffers: one micro-batch's hidden states each way, 2*a*T*D/tp.
The estimate replays the rank's order and takes the worst phase of every backward it runs.

Not modelled: torch.compile (fuses norms/activations and lowers the transient terms), float8,
context parallel, fsdp_reshard_after_forward = "never", the optimizer step's temporaries (fused
AdamW has none; the step comes after the activations are freed, and reuses their cached blocks).

Fake-tensor step (fake_step_memory, fake_job_memory, --fake-step). torch's own count instead of
these formulas: the job's model (or pp rank's stage) built on the meta device, parallelized by
parallelize_llama on a fake process group of the job's ranks, materialized as fake tensors (no
memory, no compute) and stepped as train.py steps it under torch's FSDPMemTracker, which files every
tensor under a category (sharded/unsharded parameters and gradients, activations, backward
temporaries, optimizer state, collective buffers) and keeps the breakdown at the peak. Without TP it
counts to the byte what the same tracker counts on real tensors over gloo (debug model, 2 ranks:
85.04 MiB op SAC, 65.54 MiB full AC with chunked loss), and the formula's allocated peak is within
3% of it (1.9% below, 2.4% above; 8B on 64 ranks, seq 8192, op SAC, chunks of 2048: 23.7 GiB by
the formula, 22.7 fake, the chunked loss's backward is where they differ). Under TP it over-counts
(torch 2.13): the debug model on TP 2 peaks at 73.4 MiB on fake tensors, at 67.2 on real ones (the
formula: 67.0); the extra is one fp32 logits-sized tensor in the loss-parallel forward, probably a
collective's output that fake tensors allocate where the real all-reduce works in place. 405B's pp
rank 0 (TP 8, PP 8) steps to 71.2 GiB fake against 50.8 by the formula, the difference in backward
temporaries, not explained. So under TP read it as an upper bound. Time on this machine's 2 cores:
~2 s for the debug model, ~12 s for 8B on 64 ranks, ~30 s for 405B's pp rank 0 on 512 ranks with 8
micro-batches in flight (the time grows with the micro-batches and the blocks).

Activations. The formulas are checked against what `benchmarks/memory.py` measures on the debug
model (benchmarks/test_memory.py): on CPU the saved bytes agree to within 2%, because every term
below is one tensor that autograd, a checkpoint or selective AC's cache really keeps (the difference is FSDP's bf16 copy of the RoPE table that each
block receives, 16 KiB there, and scalars). The rest (gathered units in flight, backward working set,
allocator and CUDA/NCCL overhead) is a model, stated term by term, not a measurement.

Notation (per rank): T = local_batch_size x seq_len tokens (pp_microbatch_size x seq_len under PP);
D = dim; Dq = n_heads x head_dim (= D); Dkv = n_kv_heads x head_dim; F = ffn_hidden_dim; H = n_heads;
V = vocab; L = n_layers; a = bytes per element of the compute dtype (FSDP param_dtype: 2 for bf16,
4 for fp32); r = bytes of reduce_dtype; t = TP degree (sequence parallel on: norms see T/t tokens,
attention/MLP see H/t heads, F/t).

Saved for backward by one block without AC (eager, SDPA flash or the CPU flash kernel):

    each RMSNorm (x2)   fused kernel: its input a*T*D/t + rstd 4*T/t
                        composite (CPU eager, torch <= 2.7 on CUDA): fp32 input 4*T*D/t
                        (the upcast copy; x itself when a = 4), x*rstd in fp32 4*T*D/t, rstd 4*T/t
                        + its output as the next matmul's input: a*T*D (gathered to all T under SP)
    attention           q, k, v, out of SDPA: 4*a*T*Dq/t (k and v after repeat_interleave to H
                        heads: GQA saves no activation memory here), logsumexp 4*T*H/t
    SwiGLU MLP          w1 out, silu(w1 out), w3 out, their product (w2's input): 4*a*T*F/t

    e.g. debugmodel (D=256, F=768, H=16), fp32, composite norms: 88.3 bytes per token x D.

With AC (parallelisms/ac.py), per checkpointed block, what stays between forward and backward:

    full                the block input a*T*D/t (held by the non-reentrant checkpoint)
    selective op        the block input + the outputs selective AC caches: every other matmul
                        (wq a*T*Dq, wv a*T*Dkv, w1 a*T*F, w2 a*T*D; wk, wo, w3 are recomputed),
                        SDPA's output a*T*Dq and logsumexp 4*T*H; under TP each of those /t except
                        w2's partial-sum output (full size), plus the cached reduce-scatter outputs
                        of wo and w2 (a*T*D/t each)
    selective k         full AC on every k-th block (blocks k-1, 2k-1, ... of the model or stage), none
                        on the others

Outside the blocks: token ids and labels (int64, 16*T), the final norm (as above), and the
fp32 log-softmax of the loss, 4*T*V/t (loss parallel keeps the vocabulary sharded).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from config import Parallelism, Training, selective_ac_every
from errors import ConfigError
from models.llama3 import FLAVORS, ModelArgs, num_params
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pp import SCHEDULES, check_microbatches, rank_stages, stage_layers
from parallelisms.tp import check_tp

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
AC_MODES = ("none", "full", "selective-op", "selective-2")
RMSNorm = Literal["fused", "composite"]
# Compute-stream bytes the caching allocator reserves beyond the allocated peak, as a share of it:
# calibrated on torchtitan's 8B peaks (module docstring, "Reserved").
FRAGMENTATION = 0.17


# ----------------------------------------------------------------- activations


def _norm_bytes(args: ModelArgs, *, tokens: int, act_bytes: int, tp: int, rmsnorm: RMSNorm) -> int:
    """One RMSNorm: what it saves plus its output saved by the matmul(s) it feeds."""
    T, D, a = tokens, args.dim, act_bytes
    own = a * T * D + 4 * T if rmsnorm == "fused" else 8 * T * D + 4 * T
    return own // tp + a * T * D


def block_bytes_no_ac(args: ModelArgs, *, tokens: int, act_bytes: int, tp: int = 1, rmsnorm: RMSNorm = "fused") -> int:
    """Bytes one block saves for backward without activation checkpointing."""
    T, a, Dq, F, H = tokens, act_bytes, args.n_heads * args.head_dim, args.ffn_hidden_dim, args.n_heads
    norms = 2 * _norm_bytes(args, tokens=T, act_bytes=a, tp=tp, rmsnorm=rmsnorm)
    attention = (4 * a * T * Dq + 4 * T * H) // tp
    mlp = 4 * a * T * F // tp
    return norms + attention + mlp


def block_bytes_checkpointed(args: ModelArgs, *, tokens: int, act_bytes: int, tp: int = 1, op_sac: bool) -> int:
    """Bytes a checkpointed block keeps until its backward: its input, plus selective AC's cache."""
    T, a, D = tokens, act_bytes, args.dim
    kept = a * T * D // tp  # the block input, held by the checkpoint for the recomputation
    if op_sac:
        Dq, Dkv, F, H = args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim, args.n_heads
        kept += a * T * (Dq + Dkv + F + Dq) // tp + 4 * T * H // tp  # wq, wv, w1, SDPA out; logsumexp
        kept += a * T * D  # w2's output: complete (t = 1) or a full-size partial sum (t > 1)
        if tp > 1:
            kept += 2 * a * T * D // tp  # the reduce-scatters after wo and w2 (in the save list)
    return kept


def checkpoint_every(ac: str) -> int:
    """apply_ac's rule for `ac`: block i (its position in the model or pipeline stage) is checkpointed when
    every > 0 and (i + 1) % every == 0; 0 = none, 1 = every block (full, selective-op), k = selective-<k>."""
    match ac:
        case "none":
            return 0
        case "full" | "selective-op":
            return 1
        case _ if ac.startswith("selective-") and selective_ac_every(ac.removeprefix("selective-")) is not None:
            return int(ac.removeprefix("selective-"))
    raise ValueError(f"ac: expected one of none, full, selective-op, selective-<k>, got {ac!r}")


def checkpointed_blocks(n_layers: int, ac: str) -> int:
    """How many of n_layers blocks apply_ac checkpoints for `ac` (none, full, selective-op, selective-<k>)."""
    every = checkpoint_every(ac)
    return sum(every > 0 and (i + 1) % every == 0 for i in range(n_layers))


def activation_bytes(
    args: ModelArgs,
    *,
    batch: int,
    seq_len: int,
    act_bytes: int,
    ac: str = "none",
    tp: int = 1,
    rmsnorm: RMSNorm = "fused",
) -> dict[str, int]:
    """Bytes saved for backward at the end of forward (what benchmarks/memory.py measures), by part."""
    T = batch * seq_len
    n_ckpt = checkpointed_blocks(args.n_layers, ac)
    per_none = block_bytes_no_ac(args, tokens=T, act_bytes=act_bytes, tp=tp, rmsnorm=rmsnorm)
    per_ckpt = block_bytes_checkpointed(args, tokens=T, act_bytes=act_bytes, tp=tp, op_sac=ac == "selective-op")
    blocks = (args.n_layers - n_ckpt) * per_none + n_ckpt * per_ckpt
    outside = 16 * T + _norm_bytes(args, tokens=T, act_bytes=act_bytes, tp=tp, rmsnorm=rmsnorm)
    log_softmax = 4 * T * args.vocab_size // tp
    return {
        "per_block_no_ac": per_none,
        "per_block_checkpointed": per_ckpt if n_ckpt else 0,
        "blocks": blocks,
        "outside_blocks": outside,
        "log_softmax": log_softmax,
        "total": blocks + outside + log_softmax,
    }


# --------------------------------------------------------------- whole GPU


@dataclass(frozen=True)
class Job:
    """One training setup: what estimate() needs to know (the CLI's flags, or doctor.py's config)."""

    flavor: str = "llama3_8b"
    ngpu: int = 8  # ranks of the job (GPUs, or CPU processes)
    tp: int = 1
    replicate: int = 1
    seq_len: int = 8192
    local_batch_size: int = 1
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    ac: str = "selective-op"
    cpu_offload: bool = False
    rmsnorm: RMSNorm = "fused"
    # train.py, like torchtitan, deletes the logits before loss.backward(); a loop that keeps
    # them alive holds T x V/tp more elements in param_dtype through the loss backward.
    logits_kept_in_backward: bool = False
    # training.loss_chunk_tokens; 0 (torchtitan's loss, the references') = all logits at once.
    loss_chunk_tokens: int = 0
    overhead_gib: float = 2.0
    model: ModelArgs | None = None  # a shape that is not a flavor (a Hugging Face config.json); flavor names it
    # Micro-batches per optimizer step: training.global_batch_size / (local_batch_size x dp). From the
    # second on, the gradient shards of the earlier ones are alive through forward and backward.
    grad_accum: int = 1
    # [parallelism] pipeline_parallel_degree, _schedule, _microbatch_size, _layers_per_stage,
    # _first_stage_less_layers, _last_stage_less_layers (torchtitan v0.2.2's meanings, parallelisms/pp.py).
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatch_size: int = 1
    pp_layers_per_stage: int | None = None
    pp_first_stage_less_layers: int = 1
    pp_last_stage_less_layers: int = 1
    # "cuda": the caching allocator reserves more than it allocates (module docstring, "Reserved");
    # "cpu": CPU ranks have none, reserved = allocated.
    allocator: Literal["cuda", "cpu"] = "cuda"

    def __post_init__(self) -> None:
        """The recipe's own rules (ParallelDims, the TP plan, the pipeline split and micro-batches) raise one
        ConfigError with all their problems; the estimator's own inputs ValueError."""
        rules = [lambda: ParallelDims.from_config(self.parallelism, world_size=self.ngpu)]
        if self.tp > 1:
            rules.append(lambda: check_tp(self.args, tp_degree=self.tp, seq_len=self.seq_len))
        if self.pp > 1:
            rules.append(lambda: stage_layers(self.args, self.parallelism))
            rules.append(lambda: check_microbatches(self.parallelism, local_batch_size=self.local_batch_size))
        problems: list[str] = []
        for rule in rules:
            try:
                rule()
            except ConfigError as e:
                problems += e.problems
        if problems:
            raise ConfigError(*problems)
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name}: expected one of {', '.join(DTYPE_BYTES)}")
        checkpoint_every(self.ac)  # raises on a bad ac
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum: expected >= 1, got {self.grad_accum}")
        if self.allocator not in ("cuda", "cpu"):
            raise ValueError(f"allocator: expected cuda or cpu, got {self.allocator!r}")

    @property
    def args(self) -> ModelArgs:
        return self.model if self.model is not None else FLAVORS[self.flavor]

    @property
    def parallelism(self) -> Parallelism:
        """The [parallelism] section of this job, for the run's own rules."""
        return Parallelism(
            data_parallel_replicate_degree=self.replicate, tensor_parallel_degree=self.tp,
            pipeline_parallel_degree=self.pp, pipeline_parallel_schedule=self.pp_schedule,
            pipeline_parallel_microbatch_size=self.pp_microbatch_size,
            pipeline_parallel_layers_per_stage=self.pp_layers_per_stage,
            pipeline_parallel_first_stage_less_layers=self.pp_first_stage_less_layers,
            pipeline_parallel_last_stage_less_layers=self.pp_last_stage_less_layers,
        )  # fmt: skip

    @property
    def shard(self) -> int:
        return self.ngpu // (self.pp * self.tp * self.replicate)

    @property
    def stages(self) -> list[list[int]]:
        """The blocks of every (virtual) pipeline stage; one stage of all blocks without PP."""
        return stage_layers(self.args, self.parallelism) if self.pp > 1 else [list(range(self.args.n_layers))]

    @property
    def microbatches(self) -> int:
        """Micro-batches of the pipeline per local batch (1 without PP; grad_accum counts the loader's)."""
        return self.local_batch_size // self.pp_microbatch_size if self.pp > 1 else 1

    @property
    def microbatch_tokens(self) -> int:
        """T: the tokens one forward of a stage (or of the model, without PP) processes."""
        return (self.pp_microbatch_size if self.pp > 1 else self.local_batch_size) * self.seq_len


def _block_params(args: ModelArgs) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one block: the matmul weights, the two norm weights."""
    matmuls = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads) + 3 * args.dim * args.ffn_hidden_dim
    return matmuls, 2 * args.dim


_ACTIONS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def rank_ops(schedule: str, *, pp_rank: int, pp: int, n_local: int, n_mb: int) -> list[tuple[str, int, int]]:
    """The forwards (F) and backwards (B; zero bubble: input I, weight W) pp rank `pp_rank` runs, in
    order, as (kind, local stage, micro-batch)."""
    match schedule:
        case "GPipe":
            return [("F", 0, m) for m in range(n_mb)] + [("B", 0, m) for m in range(n_mb)]
        case "1F1B":
            # torch's Schedule1F1B: stage s runs min(n_mb, S - s) forwards, then backward/forward pairs.
            warmup = min(n_mb, pp - pp_rank)
            ops = [("F", 0, m) for m in range(warmup)]
            for m in range(n_mb):
                ops += [("B", 0, m)] + ([("F", 0, warmup + m)] if warmup + m < n_mb else [])
            return ops
    # The interleaved schedules plan every rank's actions in __init__, which needs real PipelineStages
    # (a process group, a device). Their planner (private, torch 2.13) reads only these attributes;
    # the rounds are as in ScheduleInterleaved1F1B.__init__.
    rounds = max(1, n_mb // pp)
    plan = types.SimpleNamespace(
        n_local_stages=n_local, pp_group_size=pp, microbatches_per_round=n_mb // rounds, _n_microbatches=n_mb
    )
    actions = SCHEDULES[schedule]._calculate_single_rank_operations(plan, pp_rank)
    return [
        (_ACTIONS[a.computation_type.name], a.stage_index // pp, a.microbatch_index) for a in actions if a is not None
    ]


def estimate_rank(job: Job, pp_rank: int = 0) -> dict[str, float | int | str]:
    """Per-GPU bytes by component, the allocated peak and the reserved estimate of one pp rank (the module
    docstring tells the story)."""
    args, t, a, r = job.args, job.tp, DTYPE_BYTES[job.param_dtype], DTYPE_BYTES[job.reduce_dtype]
    V, D, F = args.vocab_size, args.dim, args.ffn_hidden_dim
    pipelined = job.pp > 1
    stages = job.stages
    last = len(stages) - 1
    local = rank_stages(pp_rank, pp=job.pp, stages=len(stages)) if pipelined else [0]
    T = job.microbatch_tokens

    # Parameters per rank before FSDP shards them: TP splits the matmul weights and the vocabulary.
    # A tied model's one matrix lives in the root unit (parallelisms/fsdp.py).
    block_sharded, block_replicated = _block_params(args)
    block_p = block_sharded / t + block_replicated
    embedding_p = 0.0 if args.tie_word_embeddings else V * D / t
    output_p = V * D / t + D  # the root unit: output projection (or the tied matrix) + final norm

    def stage_p(g: int) -> float:
        return len(stages[g]) * block_p + (embedding_p if g == 0 else 0) + (output_p if g == last else 0)

    rank_p = sum(stage_p(g) for g in local)
    largest_unit = max([block_p] + [embedding_p] * (0 in local) + [output_p] * (last in local))

    # Sharded fp32 master state: FSDP splits what TP left again.
    params, grads, adam = (n * rank_p / job.shard for n in (4, 4, 8))
    on_gpu = not job.cpu_offload
    static = params + adam if on_gpu else 0.0
    block_shards = 4 * block_p / job.shard if on_gpu else 0.0  # one block's fp32 gradient shards
    earlier_grads = grads if on_gpu and job.grad_accum > 1 else 0.0  # the step's earlier micro-batches'

    # Gathered in param_dtype. Without PP the embedding and blocks are resharded after forward and
    # the root (norm + output) is not; in backward one block is gathered plus the prefetched one.
    # Under PP the rank's stages stay gathered from their first forward to the end of the step.
    if pipelined:
        gathered = dict.fromkeys(("loss", "block", "embedding"), a * rank_p)
    else:
        gathered = {
            "loss": a * output_p,
            "block": a * (output_p + 2 * block_p),
            "embedding": a * (output_p + embedding_p),
        }

    # Activations of one micro-batch through one stage.
    batch = T // job.seq_len
    acts = activation_bytes(args, batch=batch, seq_len=job.seq_len, act_bytes=a, ac=job.ac, tp=t, rmsnorm=job.rmsnorm)
    per_none = acts["per_block_no_ac"]
    per_ckpt = block_bytes_checkpointed(args, tokens=T, act_bytes=a, tp=t, op_sac=job.ac == "selective-op")
    every = checkpoint_every(job.ac)

    def block_acts(g: int) -> list[float]:
        return [per_ckpt if every and (i + 1) % every == 0 else per_none for i in range(len(stages[g]))]

    chunked = 0 < job.loss_chunk_tokens < T
    log_softmax = 0 if chunked else acts["log_softmax"]
    ids = 16 * T  # token ids and labels (int64)
    stage_output = a * T * D / t  # kept by a pipeline stage for its backward; the last stage's feeds the norm

    def outside(g: int) -> float:
        return ids + (acts["outside_blocks"] - ids + log_softmax if g == last else stage_output)

    # Transients. Start of the loss backward, in fp32 per logit: the saved log-softmax (4, counted
    # with the activations) plus, for the fused cross-entropy (t = 1), nll's gradient and
    # log-softmax's gradient (4 + 4); under loss parallel (t > 1) torch's DTensor backward builds
    # zeros_like(x), exp(x), their sum and the product (up to 4 x 4 alive). Plus the logits in
    # param_dtype while the loop still holds them.
    logits = a * T * V / t if job.logits_kept_in_backward else 0.0
    loss_transient = (8 if t == 1 else 12) * T * V / t + logits
    if chunked:
        # loss.py: forward keeps no logits; backward recomputes one chunk (bf16 logits, fp32 copy,
        # log-softmax, gradients) while the gradients of the final norm's output and of the output
        # projection accumulate.
        C = job.loss_chunk_tokens
        loss_transient = (a + 4 + 4 + (8 if t == 1 else 12)) * C * V / t + 4 * T * D + a * output_p
    # Backward of one block: recomputation (AC) of what it did not keep, its activation gradients
    # (about two T x D and two T x F tensors alive at once; under TP one T x D is the full-size
    # partial gradient of a gathered input) and its unsharded gradient in param_dtype plus its
    # reduce_dtype copy (FSDP's reduce-scatter input; under PP the accumulator's first upcast).
    grad_acts = a * T * (D + D / t + 2 * F / t)
    rs_buffers = (a + r) * block_p
    root_grad = a * output_p  # the root unit's unsharded gradient, from the loss backward to the end
    pp_buffers = 2 * a * T * D / t if pipelined else 0.0
    # Zero bubble: between a micro-batch's input and weight backward, what its weight gradients need.
    wgrad_inputs = a * T * (2 * D + (args.n_heads * args.head_dim + F) / t)

    # Replay the rank's forwards and backwards; phases exclude the static state and note the
    # gradient shards they hold (those live in the reduce-scatter stream's pool, see "Reserved").
    if pipelined:
        ops = rank_ops(job.pp_schedule, pp_rank=pp_rank, pp=job.pp, n_local=len(local), n_mb=job.microbatches)
    else:
        ops = [("F", 0, 0), ("B", 0, 0)]
    held: dict[tuple[int, int], float] = {}
    backward_done: set[int] = set()  # local stages with fp32 accumulators (PP: after their first backward)
    phases: dict[str, tuple[float, float, str]] = {}  # kind -> (bytes, shards in them, where)
    most_held = 0

    def phase(kind: str, value: float, shards: float, where: str) -> None:
        if value > phases.get(kind, (-1.0,))[0]:
            phases[kind] = (value, shards, where)

    for kind, s, m in ops:  # s: the local stage, m: the micro-batch
        g = local[s]
        if kind == "F":
            held[(s, m)] = sum(block_acts(g)) + outside(g)
            most_held = max(most_held, len(held))
            continue
        if kind == "W":
            del held[(s, m)]
            continue
        others = sum(held.values()) - held[(s, m)]
        first = g not in backward_done
        accumulators = r * sum(stage_p(k) for k in backward_done) if pipelined else 0.0
        base = earlier_grads + accumulators + others + pp_buffers
        where = f"stage {g}, micro-batch {m}" if pipelined else ""
        if g == last:
            value = gathered["loss"] + base + held[(s, m)] + loss_transient
            phase("loss", value, earlier_grads, where)
        blocks = block_acts(g)
        remaining = sum(blocks) + ids
        out_grad = root_grad if g == last else 0.0
        # Per block processed: its gradient joins the shards (no PP) or, in a stage's first
        # backward, the accumulators (PP); later backwards add into accumulators that exist.
        done_each = (r * block_p if first else 0.0) if pipelined else block_shards
        for j, i in enumerate(reversed(range(len(blocks)))):
            recompute = per_none - blocks[i]
            transient = recompute + grad_acts + (rs_buffers if first or not pipelined else a * block_p)
            done = j * done_each
            value = gathered["block"] + base + done + out_grad + remaining + transient
            shards = earlier_grads + (0.0 if pipelined else done)
            phase("block", value, shards, f"{where}, block {stages[g][i]}".removeprefix(", "))
            remaining -= blocks[i]
        if g == 0 and embedding_p:
            done = len(blocks) * done_each
            value = gathered["embedding"] + base + done + out_grad + ids + (a + (r if first else 0)) * embedding_p
            phase("embedding", value, earlier_grads + (0.0 if pipelined else done), where)
        backward_done.add(g)
        if kind == "I":
            held[(s, m)] = len(blocks) * wgrad_inputs
        else:
            del held[(s, m)]

    peak_kind = max(phases, key=lambda k: phases[k][0])
    peak_value, peak_shards, peak_where = phases[peak_kind]
    allocated = static + peak_value
    # Reserved: state + the reduce-scatter stream's shards + the all-gather stream's flat outputs +
    # the compute stream's peak with fragmentation (module docstring, "Reserved").
    rs_pool = grads if on_gpu else 4 * largest_unit / job.shard
    ag_pool = a * max(largest_unit, 2 * block_p)
    compute = max(value - shards for value, shards, _ in phases.values())
    reserved = static + rs_pool + ag_pool + (1 + FRAGMENTATION) * compute if job.allocator == "cuda" else allocated
    overhead = job.overhead_gib * GiB
    rank_blocks = sum(len(stages[g]) for g in local)
    recompute_max = max(per_none - min(block_acts(g), default=per_none) for g in local)  # the worst block's
    return {
        "pp_rank": pp_rank,
        "pp_stages": ", ".join(map(str, local)),
        "rank_blocks": rank_blocks,
        "microbatches_held": most_held,
        "params": params,
        "grads": grads,
        "adam": adam,
        "state_on_gpu": params + grads + adam if on_gpu else 0.0,
        "state_on_host": 0.0 if on_gpu else params + grads + adam,
        "grads_at_peak": peak_shards,
        "block_unit": a * block_p,
        "output_unit": a * output_p,
        "embedding_unit": a * embedding_p,
        "gathered_loss_phase": gathered["loss"],
        "gathered_block_phase": gathered["block"],
        "act_per_block_no_ac": per_none,
        "act_per_block_checkpointed": acts["per_block_checkpointed"],
        "act_blocks": sum(sum(block_acts(g)) for g in local),
        "act_outside_blocks": acts["outside_blocks"],
        "loss_buffers": log_softmax + loss_transient,
        "logits_held": logits,
        "root_grad": root_grad,
        "accumulators": r * rank_p if pipelined else 0.0,
        "pp_buffers": pp_buffers,
        "block_backward": recompute_max + grad_acts + rs_buffers,
        "recompute": recompute_max,
        "grad_acts": grad_acts,
        "rs_buffers": rs_buffers,
        **{f"{kind}_phase": phases.get(kind, (0.0,))[0] for kind in ("loss", "block", "embedding")},
        **{f"{kind}_phase_at": phases.get(kind, (0.0, 0.0, "-"))[2] for kind in ("loss", "block", "embedding")},
        "peak_phase": f"{peak_kind} backward" + (f" ({peak_where})" if peak_where else ""),
        "allocator_peak": allocated,
        "rs_pool": rs_pool,
        "ag_pool": ag_pool,
        "compute_peak": compute,
        "reserved": reserved,
        "overhead": overhead,
        "total": reserved + overhead,
    }


def estimate(job: Job) -> dict[str, float | int | str]:
    """estimate_rank of the pp rank that needs the most memory (reserved; without PP the one rank)."""
    return max((estimate_rank(job, rank) for rank in range(job.pp)), key=lambda e: e["reserved"])


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
        and parallelized (parallelize_llama, FSDP included) on a process group whose collectives do nothing
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
    # Imported here: torch's testing and tracking tools are for this check only.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from parallelisms.tp import loss_parallel_context

    if not isinstance(model, FSDPModule):
        raise ValueError("fake_step_memory: the model is not FSDP-wrapped (parallelize_llama applies FSDP when dp > 1 "
                         "or param_dtype is not float32); FSDPMemTracker needs FSDP's hooks")  # fmt: skip
    first, last = model.tok_embeddings is not None, model.norm is not None
    stage = not (first and last)
    meshes = [p.device_mesh for p in model.parameters() if isinstance(p, DTensor)]
    tp = next((m.size(m.mesh_dim_names.index("tp")) for m in meshes if "tp" in (m.mesh_dim_names or ())), 1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=device)
        optimizer = optimizer_factory(model)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()  # creates AdamW's state
        if not accumulated:
            optimizer.zero_grad(set_to_none=True)
        labels = torch.randint(0, model.args.vocab_size, (batch, seq_len), device=device)
        if first:
            inputs = [torch.randint(0, model.args.vocab_size, (batch, seq_len), device=device)]
        else:
            shape = (batch, seq_len // tp, model.args.dim)
            inputs = [torch.empty(shape, device=device, dtype=param_dtype, requires_grad=True)]
        inputs *= microbatches  # the same fake tensor: a pipeline's received inputs cost no more than this
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((inputs[0], labels))
        head = functools.partial(loss_fn, model, labels=labels) if last else None
        with tracker, loss_parallel_context(loss_parallel):
            outputs = []
            for x in inputs:
                # The tracker refuses a second forward of the root module (it takes it for the next step);
                # its per-module statistics are all it resets, not the peak.
                tracker.reset_mod_stats()
                outputs.append(model(x, head=head))
            for out in outputs:
                if stage:  # torch.distributed.pipelining's stage backward
                    model.set_requires_gradient_sync(False)
                    model.set_reshard_after_backward(False)
                out.backward(None if last else torch.empty_like(out))
            del outputs
        peak: dict[str, int] = {}
        for snapshot in tracker.get_tracker_snapshot("peak").values():
            for kind, nbytes in snapshot.items():
                name = _TRACKED.get(getattr(kind, "value", kind), "total")
                peak[name] = peak.get(name, 0) + nbytes
    return peak


def fake_job_memory(job: Job, *, pp_rank: int = 0, device: str = "cpu") -> dict[str, int]:
    """fake_step_memory for `job`: pp rank `pp_rank`'s stage (the whole model without PP) built on the meta
    device, parallelized by parallelize_llama on job.ngpu fake ranks (this process rank 0 of them; it
    starts the fake process group unless one of job.ngpu ranks is running, and ends what it started),
    stepped with the micro-batches the stage holds at once (estimate_rank's microbatches_held).

    Single-stage schedules only (1F1B, GPipe): an interleaved rank's stages interleave their
    micro-batches, which one fake step of one module does not reproduce (estimate_rank replays them).
    """
    import torch.distributed as dist

    from config import ActivationCheckpoint, Compile
    from loss import Loss
    from models.llama3 import Transformer
    from models.llama3.model import with_seq_len
    from parallelisms.parallelize import parallelize_llama
    from parallelisms.pp import stage_module

    if job.pp > 1 and len(job.stages) != job.pp:
        raise ValueError(f"fake_job_memory: {job.pp_schedule} runs {len(job.stages) // job.pp} stages per rank; "
                         "only single-stage schedules (1F1B, GPipe) are stepped on fake tensors")  # fmt: skip
    started = not dist.is_initialized()
    if started:
        # Registers torch's "fake" backend (torch.testing, torch 2.13): collectives that return at once.
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=job.ngpu)
    elif dist.get_world_size() != job.ngpu:
        raise ValueError(
            f"fake_job_memory: a process group of {dist.get_world_size()} ranks runs, the job has {job.ngpu}"
        )
    try:
        training = Training(
            seq_len=job.seq_len, local_batch_size=job.local_batch_size, mixed_precision_param=job.param_dtype,
            mixed_precision_reduce=job.reduce_dtype, enable_cpu_offload=job.cpu_offload,
            loss_chunk_tokens=job.loss_chunk_tokens,
        )  # fmt: skip
        every = checkpoint_every(job.ac)
        ac = ActivationCheckpoint(
            mode="none" if not every else "selective" if job.ac.startswith("selective") else "full",
            selective_ac_option=job.ac.removeprefix("selective-") if job.ac.startswith("selective") else "op",
        )
        dims = ParallelDims.from_config(job.parallelism, world_size=job.ngpu)
        mesh = dims.build_mesh(device)
        with torch.device("meta"):
            model = Transformer(with_seq_len(job.args, job.seq_len))
        if job.pp > 1:
            stages, g = job.stages, pp_rank
            model = stage_module(model, stages[g], first=g == 0, last=g == len(stages) - 1)
        model = parallelize_llama(
            model, dims=dims, mesh=mesh, training=training, parallelism=job.parallelism, ac=ac,
            compile=Compile(enable=False),
        )  # fmt: skip
        return fake_step_memory(
            model,
            optimizer_factory=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True),
            batch=job.microbatch_tokens // job.seq_len, seq_len=job.seq_len, loss_fn=Loss(job.loss_chunk_tokens),
            device=torch.device(device), param_dtype=getattr(torch, job.param_dtype), loss_parallel=job.tp > 1,
            microbatches=int(estimate_rank(job, pp_rank)["microbatches_held"]), accumulated=job.grad_accum > 1,
        )  # fmt: skip
    finally:
        if started:
            dist.destroy_process_group()


# ------------------------------------------------------------------------- CLI


@dataclass(frozen=True)
class Reference:
    """A published peak and the Job that reproduces its setup."""

    name: str
    job: Job
    published: dict[str, float]  # label -> GiB
    note: str


# torchtitan docs/performance.md (benchmarks/llama3_h100_202412_torchtitan.md): H100 SXM with
# 96 GB HBM2e, torch nightly of 2024-12-23, eager nn.RMSNorm (composite then), `del pred` before
# backward; "Memory(GiB)" is torch.cuda.max_memory_reserved, without the CUDA context / NCCL, the
# maximum over all GPUs.
_TT = dict(rmsnorm="composite")
# Table 5's 405B: FSDP 8 x TP 8 x PP 8, local batch 32 in torchtitan's default micro-batches then (as many as
# stages: 8 of 4 sequences), full AC.
_TT_405B_PP = dict(
    flavor="llama3_405b",
    ngpu=512,
    tp=8,
    pp=8,
    local_batch_size=32,
    pp_microbatch_size=4,
    seq_len=8192,
    ac="full",
    **_TT,
)
REFERENCES: tuple[Reference, ...] = (
    Reference(
        "8B, 8 GPUs, FSDP, bs 2, SAC op",
        Job(flavor="llama3_8b", ngpu=8, local_batch_size=2, seq_len=8192, ac="selective-op", **_TT),
        {"FSDP": 82.4, "FSDP + compile": 77.0},
        "torchtitan Table 1 (docs/performance.md)",
    ),
    Reference(
        "8B, 128 GPUs, FSDP, bs 2, SAC op",
        Job(flavor="llama3_8b", ngpu=128, local_batch_size=2, seq_len=8192, ac="selective-op", **_TT),
        {"FSDP": 67.0, "FSDP + compile": 62.0},
        "torchtitan Table 3: same job, state sharded 16x thinner",
    ),
    Reference(
        "70B, 64 GPUs, FSDP8 x TP8, bs 8, full AC",
        Job(flavor="llama3_70b", ngpu=64, tp=8, local_batch_size=8, seq_len=8192, ac="full", **_TT),
        {},
        "torchtitan's llama3_70b.toml preset (64 GPUs); no published peak",
    ),
    Reference(
        "70B, 256 GPUs, FSDP32 x TP8, bs 16, full AC",
        Job(flavor="llama3_70b", ngpu=256, tp=8, local_batch_size=16, seq_len=8192, ac="full", **_TT),
        {"2D + compile + float8": 71.9, "+ async TP": 67.6},
        "torchtitan Table 4; compile + float8 not modelled (bf16 estimate)",
    ),
    Reference(
        "405B, 128 GPUs, FSDP16 x TP8, bs 2, full AC",
        Job(flavor="llama3_405b", ngpu=128, tp=8, local_batch_size=2, seq_len=8192, ac="full", **_TT),
        {},
        "torchtitan's llama3_405b.toml preset (128 H100; no published peak)",
    ),
    Reference(
        "405B, 512 GPUs, FSDP8 x TP8 x PP8 1F1B, bs 32",
        Job(pp_schedule="1F1B", **_TT_405B_PP),
        {"3D + compile + float8 + async TP": 82.5},
        "torchtitan Table 5: 8 micro-batches of 4 (its default then: as many as stages); not modelled: compile, float8",
    ),
    Reference(
        "405B, 512 GPUs, FSDP8 x TP8 x PP8 Interleaved1F1B",
        Job(pp_schedule="Interleaved1F1B", **_TT_405B_PP),
        {"3D + compile + float8 + async TP": 72.7},
        "torchtitan Table 5, 2 stages per rank (its split then differed slightly from stage_layers')",
    ),
)


def _row(label: str, value: float, note: str = "") -> str:
    return f"  {label:<30} {value / GiB:8.2f} GiB" + (f"   {note}" if note else "")


def breakdown(job: Job, pp_rank: int | None = None) -> str:
    """The per-GPU breakdown as printed by the script: of `pp_rank`, or of the rank that needs the most."""
    e = estimate(job) if pp_rank is None else estimate_rank(job, pp_rank)
    a = job.args
    T = job.microbatch_tokens
    per_logit = (12 if job.tp == 1 else 16) + (DTYPE_BYTES[job.param_dtype] if job.logits_kept_in_backward else 0)
    kept = "logits held through backward" if job.logits_kept_in_backward else "logits freed before backward"
    if 0 < job.loss_chunk_tokens < T:
        T, per_logit = job.loss_chunk_tokens, 8 + DTYPE_BYTES[job.param_dtype] + (8 if job.tp == 1 else 12)
        kept = f"chunked: one chunk of {T:,} tokens at a time + the gradients of the final norm's output and the output"
    checkpointed = f", {e['act_per_block_checkpointed'] / GiB:.3f} checkpointed" if job.ac != "none" else ""
    layout = f"{job.ngpu} GPUs = replicate {job.replicate} x shard {job.shard} x tp {job.tp}"
    rank, grad_note = "", "reduce-scattered block by block in backward"
    if job.pp > 1:
        layout = f"{job.ngpu} GPUs = pp {job.pp} x replicate {job.replicate} x shard {job.shard} x tp {job.tp}"
        which = "the worst" if pp_rank is None else "asked for"
        rank = (
            f"\n  pipeline: {job.pp_schedule}, {job.microbatches} micro-batches of {job.pp_microbatch_size} x "
            f"{job.seq_len} tokens, {len(job.stages)} stages | pp rank {e['pp_rank']} ({which}): stage(s) "
            f"{e['pp_stages']}, {e['rank_blocks']} blocks, up to {e['microbatches_held']} micro-batch(es) in flight"
        )
        grad_note = "reduce-scattered at the end of the step"
    held = f", {e['microbatches_held']} micro-batch(es) of them held" if job.pp > 1 else ""
    return "\n".join(
        [
            f"{job.flavor}: {num_params(a) / 1e9:.2f}B params | {layout} | local batch {job.local_batch_size} x "
            f"{job.seq_len} tokens, grad accumulation {job.grad_accum} | params {job.param_dtype}, reduce "
            f"{job.reduce_dtype} | AC {job.ac} | RMSNorm {job.rmsnorm}"
            + (" | CPU offload" if job.cpu_offload else "")
            + rank,
            _row("sharded fp32 params", e["params"], "4 B per parameter of the rank / (shard x tp)"),
            _row("AdamW state (2 x fp32)", e["adam"]),
            _row(
                "gradients (fp32 shards)",
                e["grads"],
                f"{grad_note}; {e['grads_at_peak'] / GiB:.2f} GiB of them at the peak",
            ),
            _row("  -> on the GPU", e["state_on_gpu"], f"host: {e['state_on_host'] / GiB:.2f} GiB" * job.cpu_offload),
            _row(
                "gathered params in flight",
                max(e["gathered_loss_phase"], e["gathered_block_phase"]),
                "the rank's stages, from their first forward to the end of the step"
                if job.pp > 1
                else f"norm+output unit {e['output_unit'] / GiB:.2f}, + 2 blocks x {e['block_unit'] / GiB:.2f} in backward",
            ),
            *(
                [
                    _row(
                        "gradient accumulators",
                        e["accumulators"],
                        "unsharded, reduce_dtype, from a stage's first backward",
                    )
                ]
                if job.pp > 1
                else [_row("root unit's gradient", e["root_grad"], "unsharded, param_dtype, loss backward to the end")]
            ),
            _row(
                f"activations, {e['rank_blocks']} blocks",
                e["act_blocks"],
                f"per micro-batch{held}; per block {e['act_per_block_no_ac'] / GiB:.3f} without AC{checkpointed}",
            ),
            _row("activations outside blocks", e["act_outside_blocks"], "final norm, token ids"),
            _row(
                "logits + loss buffers",
                e["loss_buffers"],
                f"{T:,} x {a.vocab_size // job.tp:,} logits x {per_logit} B ({kept})",
            ),
            _row(
                "one block's backward",
                e["block_backward"],
                f"recompute {e['recompute'] / GiB:.2f} + activation grads {e['grad_acts'] / GiB:.2f} "
                f"+ unsharded grads/RS {e['rs_buffers'] / GiB:.2f}",
            ),
            *([_row("pp send/recv buffers", e["pp_buffers"])] if job.pp > 1 else []),
            _row(
                "peak, allocated",
                e["allocator_peak"],
                f"at the {e['peak_phase']}: static state + max(loss phase {e['loss_phase'] / GiB:.2f}, "
                f"block phase {e['block_phase'] / GiB:.2f}, embedding phase {e['embedding_phase'] / GiB:.2f})",
            ),
            _row(
                "peak, reserved",
                e["reserved"],
                (
                    f"static + shards {e['rs_pool'] / GiB:.2f} + all-gather outputs {e['ag_pool'] / GiB:.2f} + "
                    f"{1 + FRAGMENTATION:.2f} x compute stream {e['compute_peak'] / GiB:.2f} (caching allocator)"
                )
                if job.allocator == "cuda"
                else "no caching allocator: = allocated",
            ),
            _row("CUDA context + NCCL (assumed)", e["overhead"]),
            _row("total per GPU", e["total"], "reserved + overhead"),
        ]
    )


def fake_breakdown(job: Job, pp_rank: int = 0) -> str:
    """fake_job_memory's categories at its peak next to the formula's allocated peak, for the same rank (MiB)."""
    start = time.perf_counter()
    fake = fake_job_memory(job, pp_rank=pp_rank)
    seconds = time.perf_counter() - start
    e = estimate_rank(job, pp_rank)
    MiB = 2**20
    lines = [
        f"fake-tensor step (torch's FSDPMemTracker, {seconds:.1f} s), pp rank {pp_rank}: peak {fake['total'] / MiB:,.1f} "
        f"MiB; the formula's allocated peak {e['allocator_peak'] / MiB:,.1f} MiB ({fake['total'] / e['allocator_peak'] - 1:+.1%})"
    ]
    lines += [f"  {name:<30} {nbytes / MiB:10,.1f} MiB" for name, nbytes in fake.items() if nbytes and name != "total"]
    return "\n".join(lines)


def references() -> str:
    head = f"{'setup':<52} {'alloc':>6} {'resvd':>6} {'+ovh':>6}  published (torch.cuda max reserved, GiB) vs resvd"
    lines = [
        "Estimates in GiB: allocated peak, reserved (caching allocator), reserved + assumed CUDA/NCCL overhead",
        head,
        "-" * len(head),
    ]
    for ref in REFERENCES:
        e = estimate(ref.job)
        reserved = e["reserved"] / GiB
        published = ", ".join(f"{k} {v:.1f} ({reserved / v - 1:+.0%})" for k, v in ref.published.items()) or "-"
        lines.append(
            f"{ref.name:<52} {e['allocator_peak'] / GiB:6.1f} {reserved:6.1f} {e['total'] / GiB:6.1f}  {published}"
        )
        where = f"peak at the {e['peak_phase']}" + (f", pp rank {e['pp_rank']}" if ref.job.pp > 1 else "")
        lines.append(f"{'':<52} {'':>6} {'':>6} {'':>6}  {ref.note}; {where}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--flavor", default="llama3_8b", choices=sorted(FLAVORS))
    p.add_argument("--ngpu", type=int, default=8, help="GPUs in the job")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree (sequence + loss parallel on)")
    p.add_argument(
        "--replicate", type=int, default=1, help="HSDP replicate degree (dp_shard = ngpu / pp / tp / replicate)"
    )
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--local-batch-size", type=int, default=1, help="sequences per data-parallel rank")
    p.add_argument(
        "--grad-accum", type=int, default=1,
        help="micro-batches per optimizer step (global batch / (local batch x dp))",
    )  # fmt: skip
    p.add_argument("--param-dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--reduce-dtype", default="float32", choices=sorted(DTYPE_BYTES))
    p.add_argument("--ac", default="selective-op", help=f"one of {', '.join(AC_MODES)} (or selective-<k>)")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP CPUOffloadPolicy: sharded state in host memory")
    p.add_argument(
        "--rmsnorm", default="fused", choices=["fused", "composite"], help="fused kernel (torch >= 2.8 CUDA)"
    )
    p.add_argument("--keep-logits", action="store_true", help="a loop that holds the logits through backward")
    p.add_argument(
        "--loss-chunk-tokens", type=int, default=Training().loss_chunk_tokens,
        help="training.loss_chunk_tokens (0: the whole micro-batch's logits at once)",
    )  # fmt: skip
    pp = Parallelism()
    p.add_argument("--pp", type=int, default=1, help="pipeline_parallel_degree")
    p.add_argument("--pp-schedule", default=pp.pipeline_parallel_schedule, choices=list(SCHEDULES))
    p.add_argument(
        "--pp-microbatch-size", type=int, default=pp.pipeline_parallel_microbatch_size,
        help="sequences per pipeline micro-batch (local batch / this = micro-batches)",
    )  # fmt: skip
    p.add_argument(
        "--pp-layers-per-stage", type=int, default=pp.pipeline_parallel_layers_per_stage,
        help="blocks per stage (default: 1 stage per rank, 2 for the interleaved schedules)",
    )  # fmt: skip
    p.add_argument("--pp-first-stage-less-layers", type=int, default=pp.pipeline_parallel_first_stage_less_layers)
    p.add_argument("--pp-last-stage-less-layers", type=int, default=pp.pipeline_parallel_last_stage_less_layers)
    p.add_argument("--pp-rank", type=int, default=None, help="break down this pp rank (default: the worst)")
    p.add_argument("--allocator", default="cuda", choices=["cuda", "cpu"], help="cpu: no caching allocator")
    p.add_argument("--overhead-gib", type=float, default=2.0, help="CUDA context + NCCL, outside the allocator")
    p.add_argument(
        "--fake-step", action="store_true",
        help="also step the job on fake tensors (fake_job_memory) and print torch's count next to the formula's",
    )  # fmt: skip
    p.add_argument("--references", action="store_true", help="compare with torchtitan's published peaks and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.references:
        print(references())
        return 0
    try:
        job = Job(
            flavor=args.flavor, ngpu=args.ngpu, tp=args.tp, replicate=args.replicate, seq_len=args.seq_len,
            local_batch_size=args.local_batch_size, grad_accum=args.grad_accum, param_dtype=args.param_dtype,
            reduce_dtype=args.reduce_dtype, ac=args.ac, cpu_offload=args.cpu_offload, rmsnorm=args.rmsnorm,
            logits_kept_in_backward=args.keep_logits, loss_chunk_tokens=args.loss_chunk_tokens,
            pp=args.pp, pp_schedule=args.pp_schedule, pp_microbatch_size=args.pp_microbatch_size,
            pp_layers_per_stage=args.pp_layers_per_stage, pp_first_stage_less_layers=args.pp_first_stage_less_layers,
            pp_last_stage_less_layers=args.pp_last_stage_less_layers, allocator=args.allocator,
            overhead_gib=args.overhead_gib,
        )  # fmt: skip
        if args.pp_rank is not None and not 0 <= args.pp_rank < job.pp:
            raise ValueError(f"pp-rank: expected 0 to {job.pp - 1}, got {args.pp_rank}")
    except ConfigError as e:
        print("\n".join(f"error: {problem}" for problem in e.problems), file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(breakdown(job, args.pp_rank))
    if args.fake_step:
        print(fake_breakdown(job, 0 if args.pp_rank is None else args.pp_rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
