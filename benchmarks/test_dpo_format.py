"""DPO with the chat format's tokens counted vs masked (docs/failures.md #8), measured by benchmarks/dpo_format.py on
a tiny run: both sides start from one chat model, differ in what they count by the end-of-turn token, and every
held-out pair and prompt is scored."""

from __future__ import annotations

import math
from typing import Any

import pytest

from benchmarks import dpo_format
from benchmarks.harness import read_results, run_python

HELD_OUT, NEW_TOKENS = 4, 8


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("dpo_format") / "dpo_format.json"
    proc = run_python("-m", "benchmarks.dpo_format", "--out", str(out), "--sft-steps", "2", "--steps", "2",
                      "--pairs", "8", "--held-out", str(HELD_OUT), "--batch", "1", "--seq-len", "128",
                      "--new-tokens", str(NEW_TOKENS), capture=True, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_results(out)


def test_both_sides_start_from_the_chat_model_and_differ_by_the_end_of_turn(results: dict[str, Any]) -> None:
    """Step 1 of each run is the reference (the sigmoid loss ln 2); counted, each reply's log-probability holds one
    token more than masked, the end of turn, so it is lower on the same weights."""
    counted, masked = (results["runs"][side]["train"] for side in dpo_format.SIDES)
    for run in (counted, masked):
        assert run[0]["loss"] == pytest.approx(math.log(2), abs=1e-4), run[0]
        assert len(run) == 2
    for key in ("logps/chosen", "logps/rejected"):
        assert counted[0][key] < masked[0][key] - 1e-3, (counted[0], masked[0])


def test_every_held_out_pair_and_prompt_is_scored(results: dict[str, Any]) -> None:
    for name, scored in results["scored"].items():
        assert len(scored["eot"]) == len(scored["text_logps"]) == len(scored["greedy"]) == HELD_OUT, name
        assert all(0 < p < 1 for pair in scored["eot"] for p in pair), scored["eot"]
        assert all(logp < 0 for pair in scored["text_logps"] for logp in pair), scored["text_logps"]
        assert ("reply_accuracy" in scored) == (name != "start")
    assert dpo_format.repeats([5, 6, 7, 8, 5, 6, 7]) and not dpo_format.repeats([5, 6, 7, 5, 6, 8])


def test_rows(results: dict[str, Any]) -> None:
    rows = dpo_format.rows(results)
    assert len(rows) == 7 and all(r.problem == dpo_format.PROBLEM and r.unit == "" for r in rows)
    assert (rows[0].broken, rows[0].fixed) == ("format counted", "format masked")
    assert all(0 <= r.broken_value <= 1 and 0 <= r.fixed_value <= 1 for r in rows)
