"""Muon on shards (docs/failures.md #6), measured by benchmarks/muon.py in one launch of 2 CPU ranks: each shard's
update is another optimizer's, DTensor's and the recipe's are the whole matrix's, and the recipe sends the floor."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks import muon
from benchmarks.harness import read_results, run_python
from models import family, with_seq_len


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("muon") / "muon.json"
    proc = run_python("-m", "benchmarks.muon", "--out", str(out), "--rounds", "2", "--seq-len", "64", nproc=2,
                      capture=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_results(out)


def test_each_shard_alone_is_another_optimizer_and_whole_matrices_are_muon(results: dict[str, Any]) -> None:
    m = results["one_matrix"]
    # bf16 iteration: the whole update's values agree to bf16 rounding (its elements are about whole_max / 4 to
    # whole_max), each shard's differ by a good part of the update itself.
    assert m["recipe_diff"] < 0.05 * m["whole_max"] and m["implicit_diff"] < 0.05 * m["whole_max"], m
    assert m["shard_diff"] > 0.2 * m["whole_max"] and m["shard_diff"] > 10 * m["recipe_diff"], m
    # The recipe moves one gather and one scatter of the matrix in bfloat16: half of it, out and back, per rank.
    assert m["recipe_bytes"] == 2 * (256 * 128 // 2) * 2 // 2, m
    assert m["implicit_bytes"] > 5 * m["recipe_bytes"], m


def test_the_recipe_sends_the_floor_and_the_implicit_path_more(results: dict[str, Any]) -> None:
    d = results["debug_model"]
    fam = family("llama3")
    args = with_seq_len(fam.flavors["debugmodel"], 64)
    hidden = {f"{name}.weight" for name in fam.hidden_matrices}
    with torch.device("meta"):
        block = fam.model_cls(args).layers["0"]
    elements = args.n_layers * sum(p.numel() for n, p in block.named_parameters() if n in hidden)
    assert d["muon_elements"] == elements
    assert d["floor_bytes"] == 2 * (2 - 1) / 2 * elements / 2 * 2
    # Matrices of different sizes dealt round-robin: the busier rank sends a little more than the mean (the floor).
    assert d["floor_bytes"] <= d["Muon_optimizer_bytes"] <= 1.25 * d["floor_bytes"], d
    assert d["implicit_optimizer_bytes"] > 5 * d["Muon_optimizer_bytes"], d
    assert d["AdamW_optimizer_bytes"] == 0, d
    assert d["step_time_ratio"] > 0 and len(d["step_time_ratios"]) == 2


def test_rows(results: dict[str, Any]) -> None:
    shard, sent = muon.rows(results)
    assert shard.broken_value > 10 * shard.fixed_value and sent.broken_value > 5 * sent.fixed_value
