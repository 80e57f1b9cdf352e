"""benchmarks/generation.py on its tiny shape, one round: the four setups give the same greedy tokens, and every
row has both sides measured (make bench runs the debug and ~100M shapes, make bench-gpu the 1b and 8b ones built in
memory; the numbers are in docs/benchmarks.md)."""

from __future__ import annotations

import math

import torch

from benchmarks import generation


def test_the_four_setups_decode_the_same_tokens_and_each_row_is_measured() -> None:
    shape = generation.measure_shape("tiny", new_tokens=6, rounds=1)
    assert shape["same_tokens"] and set(shape["decode_tokens_per_s"]) == set(generation.SETUPS)
    results = {"copy_bytes_per_s": generation.copy_bandwidth(mib=16), "shapes": {"tiny": shape}}
    rows = generation.rows(results)
    assert [r.broken for r in rows] == ["hf generate", "no cache", "copy bandwidth"]
    # Each row's two sides are the measured rates. Their signs are not asserted: 5 tokens of the tiny model take
    # milliseconds, and on a busy machine the 1-token run subtracted can take longer.
    rate = shape["decode_tokens_per_s"]
    assert [(r.broken_value, r.fixed_value) for r in rows[:2]] == [
        (rate["hf generate"], rate["cache + compile"]), (rate["no cache"], rate["cache"]),
    ]  # fmt: skip
    assert all(math.isfinite(r.broken_value) and math.isfinite(r.fixed_value) for r in rows)
    assert rows[2].broken_value > 0
    weights = shape["weight_bytes"] * rate["cache + compile"]
    assert math.isclose(rows[2].fixed_value, weights / 1e9)
    assert "same tokens: True" in generation.table(results)
    assert math.isclose(shape["ms_per_token"]["cache + compile"], 1e3 / rate["cache + compile"])
    # Without "no cache" (1b and 8b, built in memory): the eager row compares the eager cache with the compiled one.
    del shape["decode_tokens_per_s"]["no cache"]
    assert [(r.broken, r.fixed) for r in generation.rows(results)][1] == ("cache", "cache + compile")
    assert "no cache         not run" in generation.table(results)


def test_the_big_shapes_share_their_weights_with_transformers_model_without_a_folder() -> None:
    """models_in_memory: transformers' model and ours hold the same tensors (8B's exist once) and compute the same
    logits; the 8b shape is Llama 3.1 8B's, whose roofline on an H100 is about 223 tokens/s (one embedding row)."""
    reference, ours = generation.models_in_memory(
        generation.llama_config("tiny"), device=torch.device("cpu"), dtype=torch.float32
    )
    theirs = {p.data_ptr() for p in reference.parameters()}
    assert all(p.data_ptr() in theirs for p in ours.parameters()) and len(theirs) == len(list(ours.parameters()))
    tokens = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), reference(tokens).logits, atol=1e-4, rtol=0)
    from models import family

    fam = family("llama3")
    args = fam.hf.model_args_from_hf_config(generation.llama_config("8b").to_dict(), source="8b")
    with torch.device("meta"):
        model = fam.model_cls(args).to(torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Llama 3.1 8B's count
    read = generation.bytes_per_token(model, prompt=16, new_tokens=64)
    assert 222 < 3.35e12 / sum(read.values()) < 224


def test_the_bandwidth_fraction_counts_the_weights_a_token_reads_and_the_whole_kv_cache() -> None:
    assert generation.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert generation.peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert generation.peak_bandwidth("NVIDIA H200") == 4.8e12
    assert generation.peak_bandwidth("NVIDIA A100-SXM4-80GB") == 2.0e12
    assert generation.peak_bandwidth("NVIDIA A100 80GB PCIe") == 2.0e12
    assert generation.peak_bandwidth("NVIDIA L4") is None and generation.peak_bandwidth("cpu") is None
    from models.llama3 import FLAVORS, Transformer

    model = Transformer(FLAVORS["debugmodel"])
    a = model.args
    read = generation.bytes_per_token(model, prompt=16, new_tokens=64)
    # Every weight but the embedding table, of which one row; fp32. 16 + 64 positions round up to one 128 cache.
    assert read["weights"] == 4 * (sum(p.numel() for p in model.parameters()) - a.vocab_size * a.dim + a.dim)
    assert read["kv_cache"] == 4 * 2 * a.n_layers * 128 * a.kv_heads * a.head_dim
    shape = {"bytes_read_per_token": read, "decode_tokens_per_s": {"cache + compile": 100.0}}
    results = {"peak_bytes_per_s": 1e12, "shapes": {"s": shape}}
    assert math.isclose(generation.bandwidth_fraction(results, "s"), 100 * sum(read.values()) / 1e12)
    assert generation.bandwidth_fraction(results | {"peak_bytes_per_s": None}, "s") is None
