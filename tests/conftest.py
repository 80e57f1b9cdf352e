"""Shared fixtures: the tiny debug run every end-to-end test starts from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import python

# The debug model, small enough for many launches on 2 cores.
TINY = [
    "--config", "configs/debug.toml", "--training.seq_len=64", "--training.local_batch_size=2",
    "--metrics.log_freq=1", "--lr_scheduler.warmup_steps=5",
]  # fmt: skip


def losses(dump: Path) -> dict[int, float]:
    """step -> loss, from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


@pytest.fixture(scope="session")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One set of initial weights for every layout (sharded init differs per layout on CPU)."""
    dump = tmp_path_factory.mktemp("seed")
    proc = python("train.py", *TINY, f"--job.dump_folder={dump}", "--checkpoint.create_seed_checkpoint")
    assert proc.returncode == 0, proc.stderr
    return dump / "checkpoint" / "step-0"
