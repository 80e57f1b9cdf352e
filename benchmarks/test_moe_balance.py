"""The load-balancing loss per micro-batch vs over the global batch (docs/failures.md #7), measured by
benchmarks/moe_balance.py on a short run: on experts specialized by kind and balanced over the global batch, the
per-micro-batch form counts an imbalance the global form does not, and the routing is counted whole."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import moe_balance
from benchmarks.harness import read_results, run_python

STEPS, ROWS, SEQ_LEN = 2, 1, 32


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("moe_balance") / "moe_balance.json"
    proc = run_python("-m", "benchmarks.moe_balance", "--out", str(out), "--steps", str(STEPS), "--rows", str(ROWS),
                      "--seq-len", str(SEQ_LEN), capture=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_results(out)


def test_the_specialized_start_is_balanced_over_the_global_batch_only(results: dict[str, Any]) -> None:
    """At the first step (one router for both forms): each kind on its own half of the experts, so the global form's
    loss is at its minimum, top_k = 2, and the per-micro-batch form's far above it."""
    broken, fixed = (results["runs"][scope] for scope in moe_balance.SCOPES)
    assert fixed["aux_loss"][0] == pytest.approx(2.0, rel=2e-2), fixed["aux_loss"]
    assert broken["aux_loss"][0] > 1.5 * fixed["aux_loss"][0], broken["aux_loss"]
    assert broken["losses"][0] == fixed["losses"][0]  # the same start, the same first batch


def test_the_routing_is_counted_whole(results: dict[str, Any]) -> None:
    for run in results["runs"].values():
        for kind in run["counts"]:  # every held-out token's top_k choices, in every layer
            assert all(sum(layer) == ROWS * SEQ_LEN * 2 for layer in kind), kind
        shares = [share for kind in run["kind_share"] for share in kind]
        assert all(0.5 <= share <= 1.0 for share in shares) and len(shares) == 2 * 4, shares
        assert len(run["losses"]) == len(run["aux_loss"]) == STEPS


def test_rows(results: dict[str, Any]) -> None:
    share, logged, load, loss = moe_balance.rows(results)
    assert logged.broken_value > 1.5 * logged.fixed_value
    assert (share.broken, share.fixed) == ("per micro-batch", "global batch") and load.unit == loss.unit == ""
