"""`make bench`'s table and chart (benchmarks/run.py), from rows made up here: no benchmark runs."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from benchmarks import run
from benchmarks.harness import Row

STAIRCASE = ["no sharding", "FSDP(2)", "+ bf16", "+ full AC"]
ROWS = [
    Row("#3 HSDP", "bytes crossing nodes", "MiB", "FULL_SHARD", 96.0, "HSDP", 44.0),
    Row("#3 HSDP", "bytes crossing nodes", "MiB", "replication", 66.0, "HSDP", 44.0),
    Row("#3 HSDP", "step time", "ms", "FULL_SHARD", 9.0, "HSDP", 5.0),  # not the headline: not charted
    Row("#4 cache", "graphs served", "graphs", "shared", 2, "keyed", 0),
    *(Row("#5 memory", "device memory", "MiB", before, 2.0**-i, after, 2.0 ** -(i + 1))
      for i, (before, after) in enumerate(itertools.pairwise(STAIRCASE))),
]  # fmt: skip


def test_one_panel_per_problem_with_its_headline_setups_broken_first() -> None:
    hsdp, cache, memory = run.panels(ROWS)
    assert (hsdp.problem, hsdp.metric, hsdp.unit) == ("#3 HSDP", "bytes crossing nodes", "MiB")
    assert [(b.label, b.value, b.broken) for b in hsdp.bars] == [
        ("FULL_SHARD", 96.0, True), ("replication", 66.0, True), ("HSDP", 44.0, False),
    ]  # fmt: skip
    assert [(b.value, b.broken) for b in cache.bars] == [(2, True), (0, False)]
    assert [b.label for b in memory.bars] == STAIRCASE
    assert [b.broken for b in memory.bars] == [True, False, False, False]


def test_plot_only_redraws_from_bench_json(tmp_path: Path) -> None:
    (tmp_path / "bench.json").write_text(json.dumps({"rows": [r.to_json() for r in ROWS]}))
    assert run.main(["--plot-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
    assert [Row.from_json(r) for r in json.loads((tmp_path / "bench.json").read_text())["rows"]] == ROWS


def test_plot_only_without_a_bench_json_is_one_line(tmp_path: Path, capsys) -> None:
    assert run.main(["--plot-only", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --plot-only: {tmp_path / 'bench.json'} not found; run `make bench` first (or pass --out)\n"
