"""LoRA's bench (benchmarks/lora.py) on a tiny run: the three sides, 3 steps each on 2 ranks from a seed checkpoint,
what trains counted as PEFT counts it, and the memory, optimizer and checkpoint bytes each side must hold."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from benchmarks import lora
from benchmarks.harness import read_results, run_python


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("lora")
    seed = run_python("train.py", "--config", "configs/debug.toml", f"--job.dump_folder={tmp / 'base'}",
                      "--checkpoint.create_seed_checkpoint", capture=True)  # fmt: skip
    assert seed.returncode == 0, seed.stderr[-3000:]
    out = tmp / "bench" / "lora.json"
    proc = run_python("-m", "benchmarks.lora", "--out", str(out), "--base", str(tmp / "base" / "checkpoint" / "step-0"),
                      "--steps", "3", "--rounds", "1", "--nproc", "2", capture=True, timeout=500)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_results(out)


def peft_counts(target_modules: str | list[str]) -> tuple[int, int]:
    """PEFT's (trainable, all) parameters of the debug model as transformers builds it, r 8 on `target_modules`."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from config import load_config_and_keys, run_model_args
    from models import family, hf

    cfg, _ = load_config_and_keys(["--config", "configs/debug.toml"])
    config = hf.hf_config(family("llama3"), run_model_args(cfg), dtype=torch.float32)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=target_modules))
    return peft.get_nb_trainable_parameters()


def test_what_each_side_trains_and_holds(results: dict[str, Any]) -> None:
    """What trains is PEFT's count; every rank's optimizer holds AdamW's 2 fp32 moments per trained parameter of its
    shard (and a step counter per tensor); a LoRA rank holds the full run's weights plus its adapters (fp32 here:
    debug.toml's mixed_precision_param), a fraction of its optimizer state and less at its peak; a LoRA step folder
    holds the adapters and their moments, the full one every weight and its moments (and DCP's few KiB per tensor)."""
    sides = results["sides"]
    assert set(sides) == set(lora.SIDES)
    full = sides["full"]
    adapters, total = peft_counts(["q_proj"])  # PEFT's total counts its adapters
    assert full["trained"] == full["parameters"] == total - adapters
    for name, targets in (("lora_all", "all-linear"), ("lora_qv", ["q_proj", "v_proj"])):
        assert (sides[name]["trained"], sides[name]["parameters"]) == peft_counts(targets), name
    for name, side in sides.items():
        ranks = side["ranks"]
        assert len(ranks) == 2 and sum(r["trained_local"] for r in ranks) == side["trained"], name
        for r, f in zip(ranks, full["ranks"], strict=True):
            assert 8 * r["trained_local"] <= r["optimizer_bytes"] < 8 * r["trained_local"] + 4096, (name, r)
            assert r["peak_bytes"] == r["weights_bytes"] + r["optimizer_bytes"] + r["step_peak_bytes"], (name, r)
            assert r["step_ms"] > 0 and r["max_rss_bytes"] > r["peak_bytes"], (name, r)
            if name != "full":
                assert r["weights_bytes"] == f["weights_bytes"] + 4 * r["trained_local"], (name, r, f)
                assert r["optimizer_bytes"] < f["optimizer_bytes"] / 10 and r["peak_bytes"] < f["peak_bytes"], name
        ckpt = side["checkpoint"]
        assert len(ckpt["rank_bytes"]) == 2 and sum(ckpt["rank_bytes"]) <= ckpt["bytes"], (name, ckpt)
        assert 12 * side["trained"] <= ckpt["bytes"] < 12 * side["trained"] + 2 * 2**20, (name, ckpt)
    assert sides["lora_qv"]["ranks"][0]["peak_bytes"] < sides["lora_all"]["ranks"][0]["peak_bytes"]


def test_step_one_is_the_base_and_rows_compare_with_full(results: dict[str, Any]) -> None:
    """B starts at zero, so each LoRA run's first step computes the base's answer loss on the same batch as the full
    run's; every loss is finite; the rows pair each LoRA side with the full fine-tune, peak memory first."""
    sides = results["sides"]
    for name, side in sides.items():
        assert len(side["loss"]) == 3 and all(map(math.isfinite, side["loss"])), name
        assert side["loss"][0] == pytest.approx(sides["full"]["loss"][0], rel=1e-5), name
    rows = lora.rows(results)
    assert len(rows) == 12 and {r.broken for r in rows} == {"full fine-tune"}
    assert [r.fixed for r in rows[::6]] == [lora.LABELS["lora_all"], lora.LABELS["lora_qv"]]
    assert rows[0].unit == "MiB" and rows[0].ratio < 1 and rows[2].fixed_value == sides["lora_all"]["trained"]
