"""A transformers LlamaForCausalLM trained through train.py and parallelize_llama, and the
guards that refuse the two documented activation-checkpointing failures on that route."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY, losses
from tests.launch import python, torchrun


def test_hf_llama_trains_with_fsdp_and_ac(tmp_path: Path) -> None:
    proc = torchrun(
        "train.py", *TINY, "--model.name=hf_llama", "--activation_checkpoint.mode=full", "--training.steps=8",
        "--training.local_batch_size=4", f"--job.dump_folder={tmp_path}", nproc=2,
    )  # fmt: skip
    assert "world 2 = replicate 1 x shard 2" in proc.stdout
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, 9))
    assert got[8] < got[1] - 0.3, got


@pytest.mark.parametrize(
    ("broken", "expected"),
    [
        ("--model.hf_gradient_checkpointing", "Hugging Face gradient checkpointing is on"),  # PROBLEMS.md #1
        ("--model.hf_use_cache", "use_cache: True while activation checkpointing is on"),  # PROBLEMS.md #2
    ],
)
def test_broken_hf_settings_are_refused_under_ac(broken: str, expected: str) -> None:
    proc = python("train.py", *TINY, "--model.name=hf_llama", "--activation_checkpoint.mode=full", broken)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr
    assert "known-broken setting" in proc.stderr  # the opt-in itself is warned about
