"""The distillation loss phase's peak memory (distill.DistillLoss): the student's and a frozen teacher's projections
at Llama 3's vocabulary, the cross-entropy and the divergence, forward and backward, fp32, with the whole logits and in
chunks, at the shapes of benchmarks/memory.py's cross-entropy alone (its LOSS_PHASE).

    python -m benchmarks.distill_memory --out outputs/bench/distill_memory.json

One process; tests.instruments.LiveBytes counts the bytes alive. The estimator counts 8 fp32 bytes per logit for
the whole phase (planning/memory.py: the cross-entropy's 12 B per logit at its bf16 compute, the teacher's logits
and the divergence's four fp32 tensors): benchmarks/test_distill_memory.py holds the measurement to it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn

from benchmarks import harness
from benchmarks.harness import Row
from benchmarks.memory import LOSS_PHASE, PROBLEM
from config import Distill
from distill import DistillLoss
from tests.instruments import LiveBytes

MiB = 2**20


class _Head(nn.Module):
    """What DistillLoss reads of a model: `project` (dim -> vocab) and `args.vocab_size`."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.project = nn.Linear(dim, vocab, bias=False)
        self.args = argparse.Namespace(vocab_size=vocab)


def distill_phase(*, tokens: int, dim: int, vocab: int, chunk_tokens: int) -> dict[str, Any]:
    """benchmarks.memory.loss_phase for distill.DistillLoss (forward KL, kd_ratio 0.5): the student's and the frozen
    teacher's projections of the same shapes, the cross-entropy and the divergence, forward and backward, fp32."""
    torch.manual_seed(0)
    student, teacher = _Head(dim, vocab), _Head(dim, vocab).requires_grad_(False)
    h = torch.randn(1, tokens, dim, requires_grad=True)
    teacher_h = torch.randn(1, tokens, dim)
    labels = torch.randint(0, vocab, (1, tokens))
    peaks, seconds = {}, {}
    for name, chunk in (("whole", 0), ("chunked", chunk_tokens)):
        loss_fn = DistillLoss(chunk, settings=Distill(enable=True), teacher=teacher)
        start = time.perf_counter()
        with LiveBytes().track() as live:
            loss_fn(student, h, labels, teacher_h=teacher_h).total.backward()
        peaks[name], seconds[name] = live.peak, time.perf_counter() - start
    return {"tokens": tokens, "dim": dim, "vocab": vocab, "chunk_tokens": chunk_tokens,
            "logits_bytes": 4 * tokens * vocab, "peak_bytes": peaks, "seconds": seconds}  # fmt: skip


def measure(args: argparse.Namespace) -> dict[str, Any]:
    shapes = LOSS_PHASE | {"dim": args.loss_dim}
    return {"distill_phase": distill_phase(**shapes)}


def rows(results: dict[str, Any]) -> list[Row]:
    kd = results["distill_phase"]
    return [
        Row(problem=PROBLEM, metric=f"distillation loss phase peak, student + teacher, {kd['tokens']:,} tokens x vocab "
            f"{kd['vocab']:,}", unit="MiB", broken="whole logits", broken_value=kd["peak_bytes"]["whole"] / MiB,
            fixed=f"chunks of {kd['chunk_tokens']}", fixed_value=kd["peak_bytes"]["chunked"] / MiB),
    ]  # fmt: skip


def table(results: dict[str, Any]) -> str:
    kd = results["distill_phase"]
    return (
        f"distillation loss phase (student + frozen teacher projections, cross-entropy + divergence, forward + "
        f"backward, fp32), {kd['tokens']:,} tokens, dim {kd['dim']}, vocab {kd['vocab']:,}: peak "
        f"{kd['peak_bytes']['whole'] / MiB:.0f} MiB with the whole logits, {kd['peak_bytes']['chunked'] / MiB:.0f} MiB "
        f"in chunks of {kd['chunk_tokens']} tokens ({kd['seconds']['whole']:.1f} s vs {kd['seconds']['chunked']:.1f} "
        f"s)"
    )


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--loss-dim", type=int, default=LOSS_PHASE["dim"], help="the hidden size (its matmuls' cost)")


def main(argv: list[str] | None = None) -> int:
    return harness.main("distill_memory", argv, doc=__doc__, add_args=add_args, measure=measure, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
