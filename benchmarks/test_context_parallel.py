"""benchmarks/context_parallel.py with CP 1 and 2 (one and two CPU ranks): what a rank saves for backward and the
keys and values it all-gathers are what planning/estimate_memory.py predicts for the job (Job.dims.cp, cp_kv_bytes), and a rank
of CP 2 saves less than one rank alone, though more than half (the gathered keys and values span the window)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import context_parallel
from models.llama3 import FLAVORS


def test_context_parallel_benchmark_matches_the_estimator(tmp_path: Path) -> None:
    out = tmp_path / "context_parallel.json"
    assert context_parallel.main(["--out", str(out), "--seq-len", "1024", "--cps", "1", "2"]) == 0
    results = json.loads(out.read_text())["results"]
    alone, cp2 = results["runs"]["1"], results["runs"]["2"]
    for run in (alone, cp2):
        predicted = run["predicted"]
        assert abs(run["activation_bytes"] - predicted["activation_bytes"]) <= 0.01 * predicted["activation_bytes"], run
        assert run["kv_gathered_bytes"] == predicted["kv_gathered_bytes"], run
        assert run["kv_grad_reduce_scattered_bytes"] == run["kv_gathered_bytes"], run  # backward: the same tensors
    assert alone["kv_gathered_bytes"] == 0
    assert alone["activation_bytes"] / 2 < cp2["activation_bytes"] < alone["activation_bytes"]
    assert [r.unit for r in context_parallel.rows(results)] == ["MiB", "MiB"]


def test_make_bench_window_is_planned_past_the_debug_flavors_table() -> None:
    """make bench runs the part at its default window (8,192 tokens, CP 1, 2, 4): past the 2,048 positions the debug
    flavor allows a training run, so the prediction is planned from the launch's own config, not loaded (loading it
    failed on 2026-11-28, and make bench stopped there)."""
    parser = argparse.ArgumentParser()
    context_parallel.add_args(parser)
    defaults = parser.parse_args([])
    assert defaults.seq_len > FLAVORS["debugmodel"].max_seq_len
    saved = [
        context_parallel.predicted(cp, seq_len=defaults.seq_len, n_layers=defaults.n_layers)["activation_bytes"]
        for cp in defaults.cps
    ]
    assert saved == sorted(saved, reverse=True) and saved[-1] > saved[0] / defaults.cps[-1], saved
