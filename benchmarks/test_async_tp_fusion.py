"""Async TP (docs/failures.md #4): what inductor's micro-pipeline TP pass fuses in this recipe's compiled TP blocks,
counted by benchmarks/async_tp_fusion.py (one process, ~25 s: ten compiles without kernel generation)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import async_tp_fusion
from benchmarks.harness import read_results, run_python
from tests.parity_worker import TP_STATISTICS

# Per block, the TP plan's collectives (sequence parallel): forward, an all-gather before attention's and the MLP's
# column-wise linears, a reduce-scatter after their row-wise ones; backward, the same mirrored.
PLAN = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
FUSED = {"fused_all_gather_matmul": 2, "fused_matmul_reduce_scatter": 2}
# Backward: the gradient's all-gathers feed the row-wise linears' matmuls and fuse; each reduce-scatter is of the
# input's gradient of several column-wise linears (wq + wk + wv; w1 + w3), a sum of matmuls, which the pass does not
# match by design (it fuses a reduce-scatter with the one matmul that produces its input): plain in torchtitan's
# block, fused in the recipe's once SummedMatmuls (parallelisms/async_tp.py) made each sum one matmul.
PLAIN_BACKWARD = {"fused_all_gather_matmul": 2, "reduce_scatter_tensor": 2}
BACKWARD = FUSED


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    out = tmp_path_factory.mktemp("async_tp_fusion") / "async_tp_fusion.json"
    proc = run_python("-m", "benchmarks.async_tp_fusion", "--out", str(out), capture=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "before -> after inductor's micro-pipeline TP pass" in proc.stdout  # the table
    return {(r["family"], r["ac"]): r for r in read_results(out)["layouts"]}


@pytest.mark.parametrize(("family", "ac"), [(f, a) for f, a in async_tp_fusion.LAYOUTS if a != "op, gathers kept"])
def test_every_forward_collective_of_the_tp_plan_is_fused(
    family: str, ac: str, layouts: dict[tuple[str, str], dict[str, Any]]
) -> None:
    """No AC, op SAC (async TP's policy) and full AC, every family: the pass sees the plan's collectives and fuses
    each one, forward and backward (the reduce-scatters of a sum of matmuls once SummedMatmuls made it one)."""
    result = layouts[(family, ac)]
    assert "error" not in result, result  # full AC with TP compiles (parallelisms/ac.py CheckpointedModule.compile)
    # A family's statistic all-reduces (tests/parity_worker.py, TP_STATISTICS) have no matmul beside them to fuse with.
    statistics = {"all_reduce": TP_STATISTICS[family]} if TP_STATISTICS[family] else {}
    assert result["before"]["forward"] == {**PLAN, **statistics}
    assert result["after"]["forward"] == {**FUSED, **statistics}
    # Op SAC recomputes the forward's all-gathers in backward (async TP's policy): fused there too. It keeps the
    # statistics (parallelisms/ac.py): not sent again.
    regathers = 2 if ac == "op" else 0
    assert result["before"]["backward"] == {**PLAN, "all_gather_into_tensor": 2 + regathers, **statistics}
    assert result["after"]["backward"] == {**BACKWARD, "fused_all_gather_matmul": 2 + regathers, **statistics}


def test_an_all_gather_op_sac_keeps_is_not_fused(layouts: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Op SAC as plain TP runs it keeps the all-gathers' outputs for backward: a second user of the gathered tensor,
    and the pass leaves both forward all-gathers plain. Hence parallelize_model's policy under async TP."""
    kept = layouts[("llama3", "op, gathers kept")]
    assert kept["after"]["forward"] == {"all_gather_into_tensor": 2, "fused_matmul_reduce_scatter": 2}
    assert kept["after"]["backward"] == BACKWARD
    row, _ = async_tp_fusion.rows({"tp": 2, "layouts": list(layouts.values())})
    assert (row.broken_value, row.fixed_value) == (2, 0)


def test_torchtitans_block_keeps_its_backward_reduce_scatters_plain(
    layouts: dict[tuple[str, str], dict[str, Any]],
) -> None:
    """torchtitan 0.2.2's Llama block, its own TP plan and compile, counted the same way: the forward fuses as this
    recipe's does, the backward leaves both reduce-scatters plain; this recipe's leaves none."""
    peer = layouts[(async_tp_fusion.TORCHTITAN, "none")]
    assert peer["before"]["forward"] == PLAN and peer["after"]["forward"] == FUSED
    assert peer["after"]["backward"] == PLAIN_BACKWARD
    _, row = async_tp_fusion.rows({"tp": 2, "layouts": list(layouts.values())})
    assert (row.broken_value, row.fixed_value) == (2, 0)
