"""Predict per-GPU memory of a training setup before asking for GPUs (PROBLEMS.md #5).

    python scripts/estimate_memory.py --flavor llama3_8b --ngpu 8 --local-batch-size 2 --ac selective-op
    python scripts/estimate_memory.py --flavor llama3_70b --ngpu 64 --tp 8 --local-batch-size 8 --ac full
    python scripts/estimate_memory.py --references   # against torchtitan's published peaks

Components, per GPU (formulas in benchmarks/memory_model.py, where each term is one tensor):

  sharded state     fp32 params, fp32 grads, AdamW exp_avg + exp_avg_sq: 4 + 4 + 8 bytes per
                    parameter / (dp_shard x tp) (norm weights are not TP-sharded). bf16
                    param_dtype does not shrink them; --cpu-offload moves all three to host memory.
  gathered params   FSDP units all-gathered in param_dtype: the norm + output unit (not resharded
                    after forward by default) while backward starts, later two blocks (the one in
                    backward and the prefetched one). bf16 halves them.
  activations       per block as documented in benchmarks/memory_model.py (no AC: norms, q/k/v/out
                    and logsumexp of SDPA, four T x F tensors of the SwiGLU; full AC: the block
                    input; selective op: the block input + every other matmul output + SDPA's
                    outputs; selective k: full AC on every k-th block), plus the final norm and token
                    ids. The same formulas agree with the bytes benchmarks/memory.py measures on the
                    debug model to within 1% (tests/test_memory.py).
  logits + loss     T x V/tp logits. Forward: bf16 logits + fp32 copy + fp32 log-softmax (saved)
                    = 2+4+4 bytes per logit. Start of backward (higher): the saved log-softmax +
                    the fp32 gradients of nll and of log-softmax = 12 bytes (tp = 1, fused
                    cross-entropy); under loss parallel (tp > 1) torch's DTensor backward keeps up
                    to 4 fp32 temporaries (zeros_like(x), exp(x), their sum, the product): 16 bytes.
                    Plus 2 bytes while train.py still holds the logits (torchtitan deletes them
                    before backward: --free-logits).
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
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

# Runnable without installing the repo: its root holds models/ and benchmarks/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.memory_model import AC_MODES, DTYPE_BYTES, GiB, Job, estimate  # noqa: E402
from models.llama3 import FLAVORS, num_params  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Reference:
    """A published peak and the Job that reproduces its setup."""

    name: str
    job: Job
    published: dict[str, float]  # label -> GiB
    note: str


# torchtitan docs/performance.md (benchmarks/llama3_h100_202412_torchtitan.md): H100 SXM with
# 96 GB HBM2e, torch nightly of 2024-12-23, eager nn.RMSNorm (composite then), `del pred` before
# backward; "Memory(GiB)" is torch.cuda.max_memory_reserved, without the CUDA context / NCCL.
_TT = dict(rmsnorm="composite", logits_kept_in_backward=False)
REFERENCES: tuple[Reference, ...] = (
    Reference(
        "8B, 8 GPUs, FSDP, bs 2, SAC op",
        Job(flavor="llama3_8b", ngpu=8, local_batch_size=2, seq_len=8192, ac="selective-op", **_TT),
        {"FSDP": 82.4, "FSDP + compile": 77.0},
        "torchtitan Table 1 (PROBLEMS.md reference numbers)",
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
    kept = "bf16 logits held by train.py" if job.logits_kept_in_backward else "logits freed before backward"
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
                f"norm+output unit {e['output_unit'] / GiB:.2f}, or 2 blocks x {e['block_unit'] / GiB:.2f}",
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
    p.add_argument("--free-logits", action="store_true", help="logits deleted before backward (torchtitan)")
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
            logits_kept_in_backward=not args.free_logits, overhead_gib=args.overhead_gib,
        )  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(breakdown(job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
