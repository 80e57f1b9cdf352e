"""benchmarks/gpu_costs.py on 2 CPU ranks: a training step reads nothing back with fused AdamW, the compiled
model compiles its graphs in the first step and then only the no-grad graph of a validation, no graph breaks."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import gpu_costs


def test_gpu_costs_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "gpu_costs.json"
    assert gpu_costs.main(["--out", str(out), "--steps", "4"]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["host_reads"]["fused"] == 0 and results["host_reads"]["foreach"] >= 1
    assert (results["graphs_first_step"], results["graphs_after"], results["graph_breaks"]) == (1, 1, 0), results
    assert [r.unit for r in gpu_costs.rows(results)] == ["reads", "graphs"]
