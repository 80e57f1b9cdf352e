"""Per-GPU memory of Llama 3 training under FSDP2 / TP / AC / CPU offload, from the shapes alone.

The formulas behind `scripts/estimate_memory.py`. The activation part is checked against what
`benchmarks/memory.py` measures on the debug model (tests/test_memory.py): on CPU the saved
bytes agree to within 1%, because every term below is one tensor that autograd, a checkpoint or
selective AC's cache really keeps (the difference is FSDP's bf16 copy of the RoPE table that each
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

from dataclasses import dataclass, field
from typing import Literal

from models.llama3 import FLAVORS, ModelArgs, num_params

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
    """One training setup, as scripts/estimate_memory.py's flags describe it."""

    flavor: str = "llama3_8b"
    ngpu: int = 8
    tp: int = 1
    replicate: int = 1
    seq_len: int = 8192
    local_batch_size: int = 1
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    ac: str = "selective-op"
    cpu_offload: bool = False
    rmsnorm: RMSNorm = "fused"
    # train.py keeps `logits` alive through loss.backward(); torchtitan deletes them first.
    logits_kept_in_backward: bool = True
    overhead_gib: float = 2.0
    args: ModelArgs = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", FLAVORS[self.flavor])
        problems = []
        if self.ngpu % (self.tp * self.replicate):
            problems.append(f"ngpu {self.ngpu} is not divisible by tp x replicate = {self.tp * self.replicate}")
        if self.args.n_heads % self.tp or self.args.kv_heads % self.tp:
            problems.append(f"tp {self.tp} does not divide n_heads / n_kv_heads of {self.flavor}")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                problems.append(f"{name}: expected one of {', '.join(DTYPE_BYTES)}")
        checkpointed_blocks(self.args.n_layers, self.ac)  # raises on a bad ac
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def shard(self) -> int:
        return self.ngpu // (self.tp * self.replicate)


def _block_params(args: ModelArgs) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one block: the matmul weights, the two norm weights."""
    matmuls = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads) + 3 * args.dim * args.ffn_hidden_dim
    return matmuls, 2 * args.dim


def estimate(job: Job) -> dict[str, float | int | str]:
    """Per-GPU bytes by component and the peak; see scripts/estimate_memory.py for the story."""
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
    gathered_block_phase = 2 * block_unit

    acts = activation_bytes(
        args, batch=job.local_batch_size, seq_len=job.seq_len, act_bytes=a, ac=job.ac, tp=t, rmsnorm=job.rmsnorm
    )
    # Start of backward, in fp32 per logit: the saved log-softmax (4) plus, for the fused
    # cross-entropy (t = 1), nll's gradient and log-softmax's gradient (4 + 4); under loss parallel
    # (t > 1) torch's DTensor backward builds zeros_like(x), exp(x), their sum and the product
    # (up to 4 x 4 alive). Plus the logits in param_dtype while train.py still holds them.
    logits = a * T * V / t if job.logits_kept_in_backward else 0.0
    loss_backward = acts["log_softmax"] + (8 if t == 1 else 12) * T * V / t + logits
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
