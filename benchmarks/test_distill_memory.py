"""The distillation loss phase's peak (benchmarks/distill_memory.py): in chunks a fraction of the whole logits', the
whole what the estimator counts per logit."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import distill_memory
from benchmarks.harness import read_results, run_python


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("distill_memory") / "distill_memory.json"
    proc = run_python("-m", "benchmarks.distill_memory", "--out", str(out), "--loss-dim", "64", capture=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_results(out)


def test_chunked_distillation_holds_a_fraction_of_the_whole_logits(results: dict[str, Any]) -> None:
    """distill.DistillLoss, student and frozen teacher projections at Llama 3's vocabulary: the whole micro-batch holds
    what the estimator counts per logit (planning/memory.py: the cross-entropy's 12 B, the teacher's logits and the
    divergence's 4 fp32 tensors, 16 B more; 4 x 8 B in fp32), chunks of 1/4 of the tokens about 1/4 of it plus the
    student's weight- and h-sized gradients."""
    kd = results["distill_phase"]
    whole, chunked, logits = kd["peak_bytes"]["whole"], kd["peak_bytes"]["chunked"], kd["logits_bytes"]
    assert 8 * logits <= whole <= 8.5 * logits, whole / logits
    share = kd["chunk_tokens"] / kd["tokens"]
    assert chunked <= 8.7 * logits * share + 2 * 4 * kd["vocab"] * kd["dim"] + 4 * 4 * kd["tokens"] * kd["dim"]
    assert whole / chunked > 3
    (row,) = distill_memory.rows(results)
    assert (row.broken, row.fixed) == ("whole logits", "chunks of 512") and row.ratio < 0.35
