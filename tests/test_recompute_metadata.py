"""PROBLEMS.md #1 and #2 on CPU, counted rather than timed.

#1: HF's reentrant gradient checkpointing plus a per-block checkpoint from outside runs each layer's
forward 3 times per step (2 with one AC, 1 without), and backward FLOPs grow by one decoder-layer
forward per extra level; apply_ac refuses both halves of that setup.
#2: with use_cache=True the recomputation appends to the KV cache again: CheckpointError (with
flash_attention_2's semantics), a shape error (eager) or a cache twice as long (sdpa, transformers 5);
reentrant AC trains on silently wrong gradients; use_cache=False + apply_ac gives the no-AC gradients.

The tiny model of benchmarks.recompute.TINY, fp32; the benchmarks measure the same on a larger one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import metadata, recompute
from benchmarks.recompute import TINY, VARIANTS, Counted

EXACT = 1e-6  # recomputation is exact: the fixes must match no AC to float32 round-off at most
WRONG = 0.05  # reentrant AC with a KV cache: ||grad - ref|| / ||ref|| above 5% (measured ~0.4)


@pytest.fixture(scope="module")
def steps() -> dict[str, dict[str, Any]]:
    """Per variant: a counted step (checkpoint early stop on and off) and its gradients."""
    base = recompute.build_hf_llama(TINY)
    tokens = recompute.random_batch(TINY)
    out = {}
    with recompute.quiet_transformers():
        for name in VARIANTS:
            model = recompute.make_variant(name, base)
            counted = recompute.counted_step(model, tokens)
            out[name] = {
                "counted": counted,
                "grads": recompute.grads(model),
                "no_early_stop": recompute.counted_step(model, tokens, early_stop=False),
            }
        out["refusals"] = recompute.refusals(base)
    return out


@pytest.fixture(scope="module")
def cases() -> dict[str, Any]:
    with recompute.quiet_transformers():
        return metadata.measure(TINY)


# ------------------------------------------------------------------ problem 1


def test_attention_forwards_per_layer(steps: dict[str, dict[str, Any]]) -> None:
    expected = {"nested": 3, "nested_wrapper": 3, "single": 2, "none": 1}
    for name, per_layer in expected.items():
        calls = steps[name]["counted"].attention_forwards
        assert len(calls) == TINY.num_hidden_layers, calls
        assert set(calls.values()) == {per_layer}, (name, calls)


def test_backward_flops_grow_by_one_layer_forward_per_level(steps: dict[str, dict[str, Any]]) -> None:
    none: Counted = steps["none"]["counted"]
    layer_fwd = recompute.layer_flops(none)  # forward FLOPs of all decoder layers, counted
    last_mm = recompute.layer_flops(none, ".mlp.down_proj")
    assert 0 < last_mm < layer_fwd < none.forward_flops

    def extra(name: str, key: str = "counted") -> int:
        return steps[name][key].backward_flops - steps["none"][key].backward_flops

    # Early stop off: each recomputation is a whole layer forward.
    assert extra("single", "no_early_stop") == layer_fwd
    assert extra("nested", "no_early_stop") == 2 * layer_fwd
    assert extra("nested_wrapper", "no_early_stop") == 2 * layer_fwd
    # The default early stop ends a non-reentrant recomputation once its last saved tensor (the input
    # of the final matmul) is back, so that matmul is not rerun; a reentrant one always runs in full.
    assert extra("single") == layer_fwd - last_mm
    assert extra("nested") == 2 * layer_fwd - last_mm
    assert extra("nested_wrapper") == 2 * layer_fwd
    flops = {name: steps[name]["counted"].backward_flops for name in VARIANTS}
    assert flops["nested"] > flops["single"] > flops["none"]


def test_recomputation_is_exact(steps: dict[str, dict[str, Any]]) -> None:
    for name in ("nested", "nested_wrapper", "single"):
        assert recompute.max_abs_diff(steps[name]["grads"], steps["none"]["grads"]) <= EXACT, name


def test_apply_ac_refuses_a_second_checkpointing(steps: dict[str, dict[str, Any]]) -> None:
    refusals = steps["refusals"]
    assert "Hugging Face gradient checkpointing on" in refusals["hf_gradient_checkpointing"]
    assert "gradient_checkpointing_disable()" in refusals["hf_gradient_checkpointing"]
    assert "CheckpointWrapper" in refusals["checkpoint_wrapper"]
    assert "already activation-checkpointed" in refusals["checkpoint_wrapper"]


# ------------------------------------------------------------------ problem 2


def test_kv_cache_under_non_reentrant_ac_fails(cases: dict[str, Any]) -> None:
    seq = TINY.seq_len
    # flash_attention_2's semantics: the recomputation runs through with doubled keys and values,
    # and the metadata check catches it (the reported error).
    error = cases["attention"]["fa2_semantics_cpu"]["non_reentrant"]["error"]
    assert error["type"] == "torch.utils.checkpoint.CheckpointError"
    assert "Recomputed values for the following tensors have different metadata" in error["first_line"]
    pairs = error["saved_vs_recomputed_shapes"]
    assert any(s[:2] == r[:2] and s[2] == seq and r[2] == 2 * seq for s, r in pairs if len(s) == 4), pairs
    # eager: the mask built for seq_len keys does not fit the doubled keys.
    error = cases["attention"]["eager"]["non_reentrant"]["error"]
    assert error["type"] == "RuntimeError"
    assert f"({2 * seq}) must match the size of tensor b ({seq})" in error["first_line"]
    # sdpa: transformers 5 slices the extra keys away (no error), but the cache was written twice.
    sdpa = cases["attention"]["sdpa"]["non_reentrant"]
    assert sdpa["error"] is not None or sdpa["cached_tokens"] == 2 * seq, sdpa


def test_kv_cache_under_reentrant_ac_gives_wrong_gradients(cases: dict[str, Any]) -> None:
    for attention in ("sdpa", "fa2_semantics_cpu"):
        case = cases["attention"][attention]["reentrant"]
        assert case["error"] is None, case
        assert case["rel_grad_norm_error"] > WRONG, (attention, case)
    # sdpa attends to the stale keys from the no_grad forward: no gradient reaches k_proj / v_proj.
    missing = cases["attention"]["sdpa"]["reentrant"]["params_without_grad"]
    assert {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(TINY.num_hidden_layers) for p in "kv"} <= set(
        missing
    )


def test_fix_matches_no_ac(cases: dict[str, Any]) -> None:
    for attention, row in cases["attention"].items():
        # The fix, HF's own checkpointing (which turns the cache off), and the cache without any AC.
        for setup in ("fix", "hf_workaround", "no_ac_with_cache"):
            case = row[setup]
            assert case["error"] is None, (attention, setup, case)
            assert case["max_abs_grad_diff"] <= EXACT, (attention, setup, case)
        assert row["fix"]["cached_tokens"] == 0
    own = cases["own_transformer"]
    assert own["max_abs_grad_diff"] <= EXACT
    assert own["buffers_unchanged_by_step"]


def test_apply_ac_refuses_kv_cache(cases: dict[str, Any]) -> None:
    assert "use_cache is True" in cases["refusal"]
    assert "use_cache = False" in cases["refusal"]


def test_benchmark_json(tmp_path: Path) -> None:
    """Both modules' --out JSON, with the keys `make bench` summarizes (benchmarks/run.py)."""
    assert recompute.main(["--tiny", "--steps", "2", "--out", str(tmp_path / "recompute.json")]) == 0
    data = json.loads((tmp_path / "recompute.json").read_text())
    assert data["benchmark"] == "recompute"
    r = data["results"]
    assert [r["variants"][v]["attention_forwards_per_layer"] for v in VARIANTS] == [3, 3, 2, 1]
    assert r["variants"]["nested"]["recomputed_layer_forwards_no_early_stop"] == 2.0
    assert r["variants"]["single"]["recomputed_layer_forwards_no_early_stop"] == 1.0
    assert r["step_time_ratio_nested_vs_single"] > 0 and len(r["variants"]["none"]["step_seconds"]) == 2
    assert r["refusals"]["hf_gradient_checkpointing"] and r["refusals"]["checkpoint_wrapper"]

    assert metadata.main(["--tiny", "--attention", "sdpa", "--out", str(tmp_path / "metadata.json")]) == 0
    data = json.loads((tmp_path / "metadata.json").read_text())
    assert data["benchmark"] == "metadata"
    sdpa = data["results"]["attention"]["sdpa"]
    assert sdpa["reentrant"]["rel_grad_norm_error"] > WRONG
    assert sdpa["fix"]["max_abs_grad_diff"] <= EXACT
    assert data["results"]["refusal"]
