"""benchmarks/data_pipeline.py on a small corpus: what its rows and table are made of."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import data_pipeline


def test_data_pipeline_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "data_pipeline.json"
    args = ["--out", str(out), "--mb", "3", "--seq-len", "512", "--global-batch", "16", "--attn-seq-len", "128",
            "--attn-steps", "2"]  # fmt: skip
    assert data_pipeline.main(args) == 0
    results = json.loads(out.read_text())["results"]
    prep = results["preparation"]
    assert prep["identical"] and prep["shards"] >= 2  # the same token files with 1 and 2 workers
    assert 2.0 <= prep["bytes_per_token"] < 2.01  # uint16 plus one .npy header per shard
    assert prep["runs"]["1"]["mb_per_s"] > 0 and prep["runs"]["2"]["mb_per_s"] > 0
    assert results["loader"]["ms"] > 0 and results["attention"]["documents_per_window"] > 1
    rows = data_pipeline.rows(results)
    assert [(r.problem, r.unit) for r in rows] == [
        ("data preparation", "MB/s"), ("data preparation", "B"), ("block-causal attention", "ms"),
    ]  # fmt: skip
    # The block-causal panel says which side was the faster here (CPU: a dense mask) and where block_causal differs.
    ms = results["attention"]["ms"]
    faster = min(ms, key=ms.get)
    assert rows[2].note.splitlines() == [
        f"CPU, a dense mask: {faster} is {max(ms.values()) / ms[faster]:.2f}x faster.",
        "GPU, FlexAttention: make bench-gpu.",
    ]
