"""docs/failures.md #1 and #2 on CPU, counted rather than timed.

#1: HF's reentrant gradient checkpointing plus a per-block checkpoint from outside runs each layer's
forward 3 times per step (2 with one AC, 1 without), and backward FLOPs grow by one decoder-layer
forward per extra level; apply_ac_hf refuses both halves of that setup (benchmarks/test_hf_llama.py).
#2: with use_cache=True the recomputation appends to the KV cache again: CheckpointError (with
flash_attention_2's semantics), a shape error (eager) or a cache twice as long (sdpa, transformers 5);
reentrant AC trains on silently wrong gradients; use_cache=False + apply_ac_hf gives the no-AC gradients.

The tiny model of benchmarks.hf_llama.TINY, fp32; the benchmarks measure the same on a larger one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import hf_llama, metadata, recompute
from benchmarks.harness import read_results
from benchmarks.hf_llama import TINY
from benchmarks.recompute import VARIANTS, Counted

EXACT = 1e-6  # recomputation is exact: the fixes must match no AC to float32 round-off at most
WRONG = 0.05  # reentrant AC with a KV cache: ||grad - ref|| / ||ref|| above 5% (measured 0.55-0.87)


@dataclass
class Step:
    """One variant's counted step, with checkpoint early stop on (the default) and off."""

    counted: Counted
    no_early_stop: Counted
    grads: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def steps() -> dict[str, Step]:
    base = hf_llama.build_hf_llama(TINY)
    tokens = hf_llama.random_batch(TINY)
    out = {}
    with hf_llama.quiet_transformers():
        for name in VARIANTS:
            model = recompute.make_variant(name, base)
            counted = recompute.counted_step(model, tokens)
            out[name] = Step(counted, recompute.counted_step(model, tokens, early_stop=False), hf_llama.grads(model))
    return out


@pytest.fixture(scope="module")
def cases() -> dict[str, Any]:
    with hf_llama.quiet_transformers():
        return metadata.measure(TINY)


# ------------------------------------------------------------------ problem 1


def test_attention_forwards_per_layer(steps: dict[str, Step]) -> None:
    expected = {"nested": 3, "nested_wrapper": 3, "single": 2, "none": 1}
    for name, per_layer in expected.items():
        calls = steps[name].counted.attention_forwards
        assert len(calls) == TINY.num_hidden_layers, calls
        assert set(calls.values()) == {per_layer}, (name, calls)


def test_backward_flops_grow_by_one_layer_forward_per_level(steps: dict[str, Step]) -> None:
    none = steps["none"].counted
    layer_fwd = recompute.layer_flops(none)  # forward FLOPs of all decoder layers, counted
    last_mm = recompute.layer_flops(none, ".mlp.down_proj")
    assert 0 < last_mm < layer_fwd < none.forward_flops

    def extra(name: str, *, early_stop: bool = True) -> int:
        get = (lambda s: s.counted) if early_stop else (lambda s: s.no_early_stop)
        return get(steps[name]).backward_flops - get(steps["none"]).backward_flops

    # Early stop off: each recomputation is a whole layer forward.
    assert extra("single", early_stop=False) == layer_fwd
    assert extra("nested", early_stop=False) == 2 * layer_fwd
    assert extra("nested_wrapper", early_stop=False) == 2 * layer_fwd
    # The default early stop ends a non-reentrant recomputation once its last saved tensor (the input
    # of the final matmul) is back, so that matmul is not rerun; a reentrant one always runs in full.
    assert extra("single") == layer_fwd - last_mm
    assert extra("nested") == 2 * layer_fwd - last_mm
    assert extra("nested_wrapper") == 2 * layer_fwd
    flops = {name: steps[name].counted.backward_flops for name in VARIANTS}
    assert flops["nested"] > flops["single"] > flops["none"]


def test_recomputation_is_exact(steps: dict[str, Step]) -> None:
    for name in ("nested", "nested_wrapper", "single"):
        assert hf_llama.max_abs_diff(steps[name].grads, steps["none"].grads) <= EXACT, name


# ------------------------------------------------------------------ problem 2


def test_kv_cache_under_non_reentrant_ac_fails(cases: dict[str, Any]) -> None:
    seq = TINY.seq_len
    # flash_attention_2's semantics: the recomputation runs through with doubled keys and values,
    # and the metadata check catches it (the reported error).
    error = cases["attention"]["fa2_semantics_cpu"]["non_reentrant"]["error"]
    assert error["type"] == "torch.utils.checkpoint.CheckpointError"
    assert "Recomputed values for the following tensors have different metadata" in error["first_line"]
    keys_and_values = [s for s in error["shapes"] if len(s["saved"]) == 4]  # (bs, kv_heads, seq, head_dim)
    assert any(
        s["saved"][:2] == s["recomputed"][:2] and s["saved"][2] == seq and s["recomputed"][2] == 2 * seq
        for s in keys_and_values
    ), error["shapes"]
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


def test_apply_ac_hf_refusal_is_recorded(cases: dict[str, Any]) -> None:
    assert "use_cache is True" in cases["refusal"] and "use_cache = False" in cases["refusal"]


def test_rows_headline_first(cases: dict[str, Any]) -> None:
    """What `make bench` charts for #2: the silent gradient error, then the CheckpointError."""
    grad_error, checkpoint_error, cached = metadata.rows(cases)
    assert grad_error.broken_value > WRONG and grad_error.fixed_value <= EXACT
    assert (checkpoint_error.broken_value, checkpoint_error.fixed_value) == (1.0, 0.0)
    assert (cached.broken_value, cached.fixed_value) == (2 * TINY.seq_len, 0)


def test_benchmark_json(tmp_path: Path) -> None:
    """Both modules' --out JSON, with the keys `make bench` summarizes (their rows())."""
    assert recompute.main(["--tiny", "--steps", "2", "--out", str(tmp_path / "recompute.json")]) == 0
    r = read_results(tmp_path / "recompute.json")
    assert [r["variants"][v]["attention_forwards_per_layer"] for v in VARIANTS] == [3, 3, 2, 1]
    assert r["variants"]["nested"]["recomputed_layer_forwards_no_early_stop"] == 2.0
    assert r["variants"]["single"]["recomputed_layer_forwards_no_early_stop"] == 1.0
    assert r["step_time_ratio_nested_vs_single"] > 0 and len(r["variants"]["none"]["step_seconds"]) == 2
    assert "gradient_checkpointing_disable()" in r["refusals"]["hf_gradient_checkpointing"]
    assert "already activation-checkpointed" in r["refusals"]["checkpoint_wrapper"]
    attention_forwards = recompute.rows(r)[0]
    assert (attention_forwards.broken_value, attention_forwards.fixed_value) == (3, 2)

    assert metadata.main(["--tiny", "--attention", "sdpa", "--out", str(tmp_path / "metadata.json")]) == 0
    sdpa = read_results(tmp_path / "metadata.json")["attention"]["sdpa"]
    assert sdpa["reentrant"]["rel_grad_norm_error"] > WRONG
    assert sdpa["fix"]["max_abs_grad_diff"] <= EXACT
