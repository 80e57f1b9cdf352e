"""benchmarks/generation.py on its tiny shape, one round: the four setups give the same greedy tokens, and every
row has both sides measured (make bench runs the debug and ~100M shapes; the numbers are in docs/benchmarks.md)."""

from __future__ import annotations

import math

from benchmarks import generation


def test_the_four_setups_decode_the_same_tokens_and_each_row_is_measured() -> None:
    shape = generation.measure_shape("tiny", new_tokens=6, rounds=1)
    assert shape["same_tokens"] and set(shape["decode_tokens_per_s"]) == set(generation.SETUPS)
    results = {"copy_bytes_per_s": generation.copy_bandwidth(mib=16), "shapes": {"tiny": shape}}
    rows = generation.rows(results)
    assert [r.broken for r in rows] == ["hf generate", "no cache", "copy bandwidth"]
    assert all(r.broken_value > 0 and r.fixed_value > 0 and math.isfinite(r.ratio) for r in rows)
    weights = shape["weight_bytes"] * shape["decode_tokens_per_s"]["cache + compile"]
    assert math.isclose(rows[2].fixed_value, weights / 1e9)
    assert "same tokens: True" in generation.table(results)
