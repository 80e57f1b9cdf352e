"""Predict per-GPU memory of a training setup before asking for GPUs (docs/failures.md #5).

    python estimate_memory.py --flavor llama3_8b --ngpu 8 --local-batch-size 2 --ac selective-op
    python estimate_memory.py --flavor llama3_70b --ngpu 64 --tp 8 --local-batch-size 8 --ac full
    python estimate_memory.py --references   # against torchtitan's published peaks

Components, per GPU (formulas below, where each term is one tensor):

  sharded state     fp32 params, fp32 grads, AdamW exp_avg + exp_avg_sq: 4 + 4 + 8 bytes per
                    parameter / (dp_shard x tp) (norm weights are not TP-sharded). bf16
                    param_dtype does not shrink them; --cpu-offload moves all three to host memory.
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
                    logit of C x V/tp, plus the fp32 gradient of the final norm's output (4*T*D).
  block backward    the recomputation of one checkpointed block (what it did not keep), its
                    activation gradients (~2 T x D + 2 T x F) and its unsharded gradient in
                    param_dtype + the reduce_dtype copy FSDP reduce-scatters.
  peak              state + max(loss phase: norm+output unit + all activations + logits/loss,
                               block phase: two blocks + block activations + block backward)
                    ~ torch.cuda.max_memory_allocated; the caching allocator reserves more.
  overhead          CUDA context, cuBLAS workspaces, NCCL buffers: a fixed --overhead-gib (default
                    2 GiB; ~0.5-1 for the context, ~1 for NCCL on 8 GPUs), outside PyTorch's allocator.

Not modelled: allocator fragmentation (max_memory_reserved is typically 5-15% above allocated),
torch.compile (fuses norms/activations and lowers the transient terms), float8, pipeline and
context parallel, gradient accumulation buffers beyond one micro-batch.

Activations. The formulas are checked against what `benchmarks/memory.py` measures on the debug
model (benchmarks/test_memory.py): on CPU the saved bytes agree to within 2%, because every term
below is one tensor that autograd, a checkpoint or selective AC's cache really keeps (the difference is FSDP's bf16 copy of the RoPE table that each
block receives, 16 KiB there, and scalars). The rest (gathered units in flight, backward working set,
allocator and CUDA/NCCL overhead) is a model, stated term by term, not a measurement.

Notation (per rank): T = local_batch_size x seq_len tokens; D = dim; Dq = n_heads x head_dim
(= D); Dkv = n_kv_heads x head_dim; F = ffn_hidden_dim; H = n_heads; V = vocab; L = n_layers;
a = bytes per element of the compute dtype (FSDP param_dtype: 2 for bf16, 4 for fp32);
t = TP degree (sequence parallel on: norms see T/t tokens, attention/MLP see H/t heads, F/t).

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
    selective k         full AC on every k-th block (blocks k-1, 2k-1, ...), none on the others

Outside the blocks: token ids and labels (int64, 16*T), the final norm (as above), and the
fp32 log-softmax of the loss, 4*T*V/t (loss parallel keeps the vocabulary sharded).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Literal

from config import Parallelism, Training
from errors import ConfigError
from models.llama3 import FLAVORS, ModelArgs, num_params
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tp import check_tp

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
AC_MODES = ("none", "full", "selective-op", "selective-2")
RMSNorm = Literal["fused", "composite"]


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


def checkpointed_blocks(n_layers: int, ac: str) -> int:
    """How many blocks apply_ac checkpoints for `ac` (none, full, selective-op, selective-<k>)."""
    match ac:
        case "none":
            return 0
        case "full" | "selective-op":
            return n_layers
        case _ if ac.startswith("selective-") and ac.removeprefix("selective-").isdigit():
            k = int(ac.removeprefix("selective-"))
            return sum((i + 1) % k == 0 for i in range(n_layers))
    raise ValueError(f"ac: expected one of none, full, selective-op, selective-<k>, got {ac!r}")


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

    def __post_init__(self) -> None:
        """The recipe's own rules (ParallelDims, the TP plan) raise ConfigError; the estimator's inputs ValueError."""
        ParallelDims.from_config(
            Parallelism(data_parallel_replicate_degree=self.replicate, tensor_parallel_degree=self.tp),
            world_size=self.ngpu,
        )
        if self.tp > 1:
            check_tp(self.args, tp_degree=self.tp, seq_len=self.seq_len)
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name}: expected one of {', '.join(DTYPE_BYTES)}")
        checkpointed_blocks(self.args.n_layers, self.ac)  # raises on a bad ac

    @property
    def args(self) -> ModelArgs:
        return self.model if self.model is not None else FLAVORS[self.flavor]

    @property
    def shard(self) -> int:
        return self.ngpu // (self.tp * self.replicate)


def _block_params(args: ModelArgs) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one block: the matmul weights, the two norm weights."""
    matmuls = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads) + 3 * args.dim * args.ffn_hidden_dim
    return matmuls, 2 * args.dim


def estimate(job: Job) -> dict[str, float | int | str]:
    """Per-GPU bytes by component and the peak; the module docstring tells the story."""
    args, t, a = job.args, job.tp, DTYPE_BYTES[job.param_dtype]
    r = DTYPE_BYTES[job.reduce_dtype]
    T = job.local_batch_size * job.seq_len
    V, D = args.vocab_size, args.dim

    # Sharded fp32 master state: TP splits the matmul weights, FSDP splits everything again.
    norm_params = args.n_layers * 2 * D + D
    local_params = ((num_params(args) - norm_params) / t + norm_params) / job.shard
    params, grads, adam = 4 * local_params, 4 * local_params, 8 * local_params
    on_gpu_state = 0.0 if job.cpu_offload else params + grads + adam

    # All-gathered units in param_dtype. The norm + output unit is not resharded after forward
    # ("default"), so it is still gathered when backward starts; blocks are gathered one at a
    # time plus one prefetched.
    block_sharded, block_replicated = _block_params(args)
    block_unit = a * (block_sharded / t + block_replicated)
    output_unit = a * (V * D / t + D)
    gathered_loss_phase = output_unit
    # The root unit (norm + output) stays gathered until the end of backward (parallelisms/fsdp.py).
    gathered_block_phase = 2 * block_unit + output_unit

    acts = activation_bytes(
        args, batch=job.local_batch_size, seq_len=job.seq_len, act_bytes=a, ac=job.ac, tp=t, rmsnorm=job.rmsnorm
    )
    # Start of backward, in fp32 per logit: the saved log-softmax (4) plus, for the fused
    # cross-entropy (t = 1), nll's gradient and log-softmax's gradient (4 + 4); under loss parallel
    # (t > 1) torch's DTensor backward builds zeros_like(x), exp(x), their sum and the product
    # (up to 4 x 4 alive). Plus the logits in param_dtype while train.py still holds them.
    logits = a * T * V / t if job.logits_kept_in_backward else 0.0
    loss_backward = acts["log_softmax"] + (8 if t == 1 else 12) * T * V / t + logits
    if 0 < job.loss_chunk_tokens < T:
        # Chunked (loss.py): forward keeps no logits; backward recomputes one chunk (bf16 logits, fp32
        # copy, log-softmax, gradients) while the gradient of the final norm's output accumulates.
        C = job.loss_chunk_tokens
        loss_backward = (a + 4 + 4 + (8 if t == 1 else 12)) * C * V / t + 4 * T * D
    # Backward of one block: recomputation (AC) of what it did not keep, its activation
    # gradients (about two T x D and two T x F tensors alive at once; under TP one T x D is the
    # full-size partial gradient of a gathered input) and its unsharded gradient in param_dtype
    # plus the reduce_dtype copy FSDP reduce-scatters.
    recompute = (
        max(acts["per_block_no_ac"] - acts["per_block_checkpointed"], 0) if job.ac != "none" else 0
    )  # a checkpointed block (full/selective-op: every block; selective-k: the worst one)
    grad_acts = a * T * (D + D / t + 2 * args.ffn_hidden_dim / t)
    rs_buffers = (a + r) * (block_sharded / t + block_replicated)
    block_backward = recompute + grad_acts + rs_buffers

    loss_phase = gathered_loss_phase + acts["blocks"] + acts["outside_blocks"] + loss_backward
    block_phase = gathered_block_phase + acts["blocks"] + block_backward
    allocator_peak = on_gpu_state + max(loss_phase, block_phase)
    overhead = job.overhead_gib * GiB
    return {
        "params": params,
        "grads": grads,
        "adam": adam,
        "state_on_gpu": on_gpu_state,
        "state_on_host": params + grads + adam - on_gpu_state,
        "block_unit": block_unit,
        "output_unit": output_unit,
        "gathered_loss_phase": gathered_loss_phase,
        "gathered_block_phase": gathered_block_phase,
        "act_per_block_no_ac": acts["per_block_no_ac"],
        "act_per_block_checkpointed": acts["per_block_checkpointed"],
        "act_blocks": acts["blocks"],
        "act_outside_blocks": acts["outside_blocks"],
        "loss_buffers": loss_backward,
        "logits_held": logits,
        "block_backward": block_backward,
        "recompute": recompute,
        "grad_acts": grad_acts,
        "rs_buffers": rs_buffers,
        "loss_phase": loss_phase,
        "block_phase": block_phase,
        "peak_phase": "loss backward" if loss_phase >= block_phase else "block backward",
        "allocator_peak": allocator_peak,
        "overhead": overhead,
        "total": allocator_peak + overhead,
    }


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
# backward; "Memory(GiB)" is torch.cuda.max_memory_reserved, without the CUDA context / NCCL.
_TT = dict(rmsnorm="composite")
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
        "torchtitan's 405B run on 128 H100 (no published peak)",
    ),
)


def _row(label: str, value: float, note: str = "") -> str:
    return f"  {label:<30} {value / GiB:8.2f} GiB" + (f"   {note}" if note else "")


def breakdown(job: Job) -> str:
    """The per-GPU breakdown as printed by the script."""
    e = estimate(job)
    a = job.args
    T = job.local_batch_size * job.seq_len
    per_logit = (12 if job.tp == 1 else 16) + (DTYPE_BYTES[job.param_dtype] if job.logits_kept_in_backward else 0)
    kept = "logits held through backward" if job.logits_kept_in_backward else "logits freed before backward"
    if 0 < job.loss_chunk_tokens < T:
        T, per_logit = job.loss_chunk_tokens, 8 + DTYPE_BYTES[job.param_dtype] + (8 if job.tp == 1 else 12)
        kept = f"chunked: one chunk of {T:,} tokens at a time + the final norm's fp32 gradient"
    checkpointed = f", {e['act_per_block_checkpointed'] / GiB:.3f} checkpointed" if job.ac != "none" else ""
    return "\n".join(
        [
            f"{job.flavor}: {num_params(a) / 1e9:.2f}B params | {job.ngpu} GPUs = replicate {job.replicate} x "
            f"shard {job.shard} x tp {job.tp} | local batch {job.local_batch_size} x {job.seq_len} tokens | "
            f"params {job.param_dtype}, reduce {job.reduce_dtype} | AC {job.ac} | RMSNorm {job.rmsnorm}"
            + (" | CPU offload" if job.cpu_offload else ""),
            _row("sharded fp32 params", e["params"], f"4 B x {num_params(a) / 1e9:.2f}B / (shard x tp)"),
            _row("gradients (fp32 shards)", e["grads"]),
            _row("AdamW state (2 x fp32)", e["adam"]),
            _row("  -> on the GPU", e["state_on_gpu"], f"host: {e['state_on_host'] / GiB:.2f} GiB" * job.cpu_offload),
            _row(
                "gathered params in flight",
                max(e["gathered_loss_phase"], e["gathered_block_phase"]),
                f"norm+output unit {e['output_unit'] / GiB:.2f}, + 2 blocks x {e['block_unit'] / GiB:.2f} in backward",
            ),
            _row(
                f"activations, {a.n_layers} blocks",
                e["act_blocks"],
                f"per block {e['act_per_block_no_ac'] / GiB:.3f} without AC{checkpointed}",
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
            _row(
                "peak, allocated",
                e["allocator_peak"],
                f"at {e['peak_phase']}: state + max(loss phase {e['loss_phase'] / GiB:.2f}, "
                f"block phase {e['block_phase'] / GiB:.2f})",
            ),
            _row("CUDA context + NCCL (assumed)", e["overhead"]),
            _row("total per GPU", e["total"]),
        ]
    )


def references() -> str:
    head = f"{'setup':<44} {'estimate':>8} {'+ovh':>6}  published (torch.cuda max reserved, GiB)"
    lines = ["Estimate = allocated peak (GiB); +ovh adds the assumed CUDA/NCCL overhead", head, "-" * len(head)]
    for ref in REFERENCES:
        e = estimate(ref.job)
        peak = e["allocator_peak"] / GiB
        published = ", ".join(f"{k} {v:.1f} ({peak / v - 1:+.0%})" for k, v in ref.published.items()) or "-"
        lines.append(f"{ref.name:<44} {peak:8.1f} {e['total'] / GiB:6.1f}  {published}")
        lines.append(f"{'':<44} {'':>8} {'':>6}  {ref.note}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--flavor", default="llama3_8b", choices=sorted(FLAVORS))
    p.add_argument("--ngpu", type=int, default=8, help="GPUs in the job")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree (sequence + loss parallel on)")
    p.add_argument("--replicate", type=int, default=1, help="HSDP replicate degree (dp_shard = ngpu / tp / replicate)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--local-batch-size", type=int, default=1, help="sequences per data-parallel rank")
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
    p.add_argument("--overhead-gib", type=float, default=2.0, help="CUDA context + NCCL, outside the allocator")
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
            local_batch_size=args.local_batch_size, param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype,
            ac=args.ac, cpu_offload=args.cpu_offload, rmsnorm=args.rmsnorm,
            logits_kept_in_backward=args.keep_logits, loss_chunk_tokens=args.loss_chunk_tokens,
            overhead_gib=args.overhead_gib,
        )  # fmt: skip
    except ConfigError as e:
        print("\n".join(f"error: {problem}" for problem in e.problems), file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(breakdown(job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
