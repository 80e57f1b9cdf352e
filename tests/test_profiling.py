"""[profiling]: per-rank profiler traces every profile_freq steps; memory snapshots refused on CPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from config import Profiling, load_config
from errors import ConfigError
from profiling import maybe_profile


def test_two_rank_run_writes_a_trace_per_rank_every_profile_freq_steps(
    two_rank_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """The shared 30-step run of tests/conftest.py, profiling every 15 steps."""
    dump, proc = two_rank_run
    traces = dump / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_15", "iteration_30"]
    for iteration in ("iteration_15", "iteration_30"):
        assert sorted(p.name for p in (traces / iteration).iterdir()) == ["rank0_trace.json", "rank1_trace.json"]
        for rank in (0, 1):
            trace = json.loads((traces / iteration / f"rank{rank}_trace.json").read_text())
            names = {event.get("name") for event in trace["traceEvents"]}
            assert names & {"aten::mm", "aten::addmm"}, sorted(n for n in names if n and n.startswith("aten::"))
            assert any(n and n.startswith("ProfilerStep#") for n in names)  # exactly the recorded step
            assert "c10d::_allgather_base_" in names  # FSDP's all-gathers are in the trace
            assert trace["distributedInfo"]["rank"] == rank
    assert proc.stdout.count("profiler: step 15 trace written") == 1  # rank 0 only
    # Memory snapshots need the CUDA caching allocator: on CPU one warning (rank 0), no files.
    assert proc.stderr.count("profiling.enable_memory_snapshot is ignored") == 1, proc.stderr[-3000:]
    assert not (dump / "memory_snapshot").exists()


def test_resumed_run_profiles_the_same_steps(tmp_path: Path) -> None:
    """Traces land on multiples of profile_freq counted from step 0, whatever step the run resumed at."""
    cfg = Profiling(enable_profiling=True, profile_freq=3)
    with maybe_profile(cfg, dump_folder=tmp_path, rank=0, start_step=4) as profiler:
        for _ in range(5, 11):  # steps 5..10
            torch.mm(torch.randn(16, 16), torch.randn(16, 16))
            profiler.step()
    assert sorted(p.name for p in (tmp_path / "profile_traces").iterdir()) == ["iteration_6", "iteration_9"]


def test_profile_freq_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"profiling.profile_freq: must be >= 1, got 0"):
        load_config(["--config", "configs/debug.toml", "--profiling.profile_freq=0"])
