"""benchmarks/checkpoint_checksums.py at a small size: what its rows and table are made of."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import checkpoint_checksums


def test_checkpoint_checksums_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "checkpoint_checksums.json"
    args = ["--out", str(out), "--gib", "0.01", "--repeats", "1", "--folder", str(tmp_path)]
    assert checkpoint_checksums.main(args) == 0
    results = json.loads(out.read_text())["results"]
    assert results["big"]["bytes"] == 10 * 2**20 and results["model"]["bytes"] > 12 * 5_000_000
    assert set(results["model"]["seconds"]) == {"save", "load", "async"} and set(results["big"]["seconds"]) == {
        "save",
        "load",
    }
    assert all(s > 0 for r in ("model", "big") for by_side in results[r]["seconds"].values() for s in by_side.values())
    rows = checkpoint_checksums.rows(results)
    assert [(r.problem, r.unit, r.broken) for r in rows] == [("checkpoint checksums", "s", "no checksums")] * 4
    assert rows[0].metric == "save 0.01 GiB" and rows[3].metric == "async save's blocking time, debugmodel"
    assert list(tmp_path.iterdir()) == [out]  # the checkpoints it wrote are gone
