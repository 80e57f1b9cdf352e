"""README's `eval.py --tasks hellaswag` where the Hugging Face hub does not answer and nothing is cached: one line,
within seconds of the start, as a user runs it (a new process: its imports count). tests/test_eval.py checks the
same line in process, with lm-eval's index of its tasks already built."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.launch import python


def test_a_hub_task_without_the_hub_is_refused_before_lm_eval_reads_its_tasks(tmp_path: Path) -> None:
    """Said before lm-eval indexes its 14,000 task files (seconds) and before the checkpoint loads: the step folder
    is empty, which loading it would say instead."""
    pytest.importorskip("lm_eval")
    folder = tmp_path / "checkpoint" / "step-100"
    folder.mkdir(parents=True)
    hf = tmp_path / "hf"  # nothing cached; online as configured, but the hub's address refuses connections
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(hf), "HF_HUB_CACHE": str(hf / "hub"),
           "HF_DATASETS_CACHE": str(hf / "datasets"), "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"}  # fmt: skip
    begin = time.perf_counter()
    proc = python("eval.py", "--checkpoint", str(folder), "--tasks", "hellaswag", "--limit", "100", env=env)
    seconds = time.perf_counter() - begin
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith(
        "error: --tasks: hellaswag needs its dataset, which could not be read (not cached here, and "
        "http://127.0.0.1:9 did not answer); download it where"
    ), line
    assert seconds < 10, f"{seconds:.1f} s"  # the imports and the check: 4-5 s here; lm-eval's index, 6-12 s more
