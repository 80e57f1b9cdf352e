"""Distillation's bench (benchmarks/distill.py) on a tiny run: a teacher of 2 steps, four students of 2 steps each on
one process, every held-out loss and step time read, and the rows built from them."""

from __future__ import annotations

import math
from typing import Any

import pytest

from benchmarks import distill
from benchmarks.harness import read_results, run_python


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("distill") / "distill.json"
    proc = run_python("-m", "benchmarks.distill", "--out", str(out), "--teacher-steps", "2", "--steps", "2",
                      "--nproc", "1", capture=True, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_results(out)


def test_four_students_and_their_teacher_are_scored(results: dict[str, Any]) -> None:
    """Each student's held-out loss at its last step and its step time; a kd_loss only with the teacher; the student
    from random init starts above the one pruned from the teacher (the same 2 blocks of the teacher's weights)."""
    runs = results["runs"]
    assert set(runs) == {f"{s}_{side}" for s in distill.STARTS for side in distill.SIDES}
    for name, run in runs.items():
        assert math.isfinite(run["held_out"]) and run["step_ms"] > 0, (name, run)
        assert bool(run["kd_loss"]) == name.endswith("teacher"), (name, run)
    assert runs["random_labels"]["held_out"] > runs["pruned_labels"]["held_out"]
    assert math.isfinite(results["teacher_held_out"])
    rows = distill.rows(results)
    assert [(r.broken, r.fixed) for r in rows] == [("labels alone", "with the teacher")] * 3
    assert rows[0].broken_value == runs["random_labels"]["held_out"] and rows[2].unit == "ms"
