"""Pipeline parallel's split and rules (parallelisms/pp.py), and the dry run (planning/dry_run.py) of the big recipes.

The pipelines themselves train in tests/test_parallelisms.py (loss parity of every schedule, x FSDP,
x TP), tests/test_parallel_configs.py (configs/debug_pp.toml) and tests/test_train.py (resume PP <-> no PP).
"""

from __future__ import annotations

import pytest

from config import Parallelism
from errors import ConfigError
from models.llama3 import FLAVORS
from parallelisms.pp import SCHEDULES, check_microbatches, rank_stages, stage_layers
from planning.flags import job as planned_job
from planning.memory import estimate
from tests.launch import python


def sizes(flavor: str, **keys: object) -> list[int]:
    return [len(s) for s in stage_layers(FLAVORS[flavor], Parallelism(**keys))]  # type: ignore[arg-type]


def test_layers_are_spread_like_torchtitan() -> None:
    # The embedding and the output count as one block each (first/last_stage_less_layers = 1).
    assert sizes("debugmodel", pipeline_parallel_degree=2) == [3, 3]
    assert sizes("llama3_405b", pipeline_parallel_degree=8) == [15] + [16] * 6 + [15]
    interleaved = sizes("llama3_405b", pipeline_parallel_degree=8, pipeline_parallel_schedule="Interleaved1F1B")
    assert interleaved == [7] + [8] * 14 + [7]
    keys = dict(
        pipeline_parallel_degree=4, pipeline_parallel_layers_per_stage=11, pipeline_parallel_schedule="Interleaved1F1B"
    )
    assert sizes("llama3_70b", **keys) == [10, 11] + [10] * 5 + [9]  # (80 + 2) / 8 stages: 10, 2 of them 11
    assert sizes("debugmodel", pipeline_parallel_degree=2, pipeline_parallel_first_stage_less_layers=0) == [4, 2]
    layers = stage_layers(FLAVORS["llama3_8b"], Parallelism(pipeline_parallel_degree=4))
    assert [i for s in layers for i in s] == list(range(32))  # every block once, in order
    assert rank_stages(1, pp=4, stages=8) == [1, 5]


@pytest.mark.parametrize(
    ("flavor", "keys", "expected"),
    [
        ("debugmodel", {"pipeline_parallel_schedule": "ZBVZeroBubble"}, "is not one of 1F1B, GPipe"),
        ("llama3_1b", {}, "ties the output projection to the embedding"),
        ("llama3_8b", {"pipeline_parallel_layers_per_stage": 5}, "makes 7 stages"),
        ("llama3_8b", {"pipeline_parallel_layers_per_stage": 3}, "makes 6 stages per rank, but 1F1B runs one"),
        (
            "llama3_8b",
            {"pipeline_parallel_layers_per_stage": 17, "pipeline_parallel_schedule": "Interleaved1F1B"},
            "makes 1 stage per rank, but Interleaved1F1B interleaves 2",
        ),
        ("debugmodel", {"pipeline_parallel_degree": 4, "pipeline_parallel_first_stage_less_layers": 3}, "fewer than"),
    ],
)
def test_bad_pipeline_keys_name_key_and_fix(flavor: str, keys: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as e:
        stage_layers(FLAVORS[flavor], Parallelism(**{"pipeline_parallel_degree": 2, **keys}))
    assert all(p.startswith("parallelism.pipeline_parallel_") for p in e.value.problems)


def test_micro_batches() -> None:
    cfg = {"pp": 4, "schedule": "1F1B", "microbatch_size": 2}
    assert check_microbatches(**cfg, local_batch_size=8) == 4
    with pytest.raises(ConfigError, match="does not divide training.local_batch_size 7"):
        check_microbatches(**cfg, local_batch_size=7)
    with pytest.raises(ConfigError, match="fewer than the 4 stages 1F1B needs"):
        check_microbatches(**cfg, local_batch_size=6)
    assert check_microbatches(**{**cfg, "schedule": "GPipe"}, local_batch_size=6) == 3


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "InterleavedZeroBubble"])
def test_interleaved_micro_batches_come_in_rounds(schedule: str) -> None:
    """torch runs these schedules' micro-batches in max(1, n // pp) equal rounds and fails otherwise (in the
    estimator's copy of its plan, a KeyError from every rank): refused in one line; every count accepted plans."""
    for pp, most, refused in ((2, 12, [5, 7, 9, 11]), (4, 16, [9, 11, 13, 14])):
        found = []
        for n in range(1, most + 1):
            try:
                job = planned_job(
                    flavor="llama3_8b", ngpu=pp, pp=pp, pp_schedule=schedule, local_batch_size=n, seq_len=1024
                )
            except ConfigError as e:
                (line,) = e.problems
                assert line.startswith(f"parallelism.pipeline_parallel_microbatch_size: 1 makes {n} micro-batches")
                assert f"make it a multiple of {pp}" in line
                found.append(n)
                continue
            assert job.microbatches == n and estimate(job)["total"] > 0  # torch's plan for every rank
        assert found == refused, (pp, found)


def test_the_schedule_facts_are_torchs() -> None:
    """parallelisms/pp.py states what it needs of each schedule without importing torch.distributed.pipelining (it
    imports dynamo): the facts are those of torch's classes."""
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleSingle,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    for name, schedule in SCHEDULES.items():
        cls = schedule.torch_class()
        assert cls.__name__ == schedule.class_name, name
        assert schedule.single == issubclass(cls, PipelineScheduleSingle), name
        # The interleaved schedules are the ones torch runs in rounds (their __init__ sets microbatches_per_round).
        assert schedule.in_rounds == issubclass(cls, ScheduleInterleaved1F1B | ScheduleInterleavedZeroBubble), name


def test_train_py_starts_without_dynamo() -> None:
    """Starting train.py (a config check, --help, a refusal) imports neither dynamo nor the pipelining package: each
    costs every process about 0.7 s before it does anything."""
    code = "import sys, train; print(sorted(m for m in ('torch._dynamo', 'torch.distributed.pipelining') if m in sys.modules))"
    proc = python("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
