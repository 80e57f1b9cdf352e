"""benchmarks/float8.py: FSDP all-gather bytes with float8 weights, counted on the tensors FSDP sends."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import float8
from benchmarks.harness import read_results, run_python
from models.llama3 import FLAVORS


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("float8") / "float8.json"
    proc = run_python("-m", "benchmarks.float8", f"--out={out}", nproc=2, capture=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_results(out)


def test_float8_all_gather_moves_one_byte_per_block_weight(results: dict[str, Any]) -> None:
    s = results["setups"]
    # Converting the linears alone changes no collective: FSDP still gathers bf16 weights.
    assert s["float8"]["all_gather_bytes"] == s["bf16"]["all_gather_bytes"]
    assert s["float8"]["all_gathers"] == s["float8_all_gather"]["all_gathers"]
    # With the float8 all-gather every block matmul weight is gathered as 1 byte instead of 2, twice per step
    # (forward, and again in backward after the reshard); embedding, norms and output stay bf16.
    a = FLAVORS["debugmodel"]
    per_block = a.dim * a.head_dim * (2 * a.n_heads + 2 * a.kv_heads) + 3 * a.dim * a.hidden_dim
    saved = s["bf16"]["all_gather_bytes"] - s["float8_all_gather"]["all_gather_bytes"]
    assert saved == 2 * results["n_layers"] * per_block
    # Rowwise float8 (torchao's rowwise recipe) keeps FSDP's all-gather in bf16.
    assert s["float8_rowwise"]["all_gather_bytes"] == s["bf16"]["all_gather_bytes"]
    (row,) = float8.rows(results)  # no step-time or tokens/s row where float8 is emulated
    assert row.fixed == "float8 all-gather" and 0.6 < row.ratio < 0.7
