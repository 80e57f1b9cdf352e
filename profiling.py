"""Profiler traces and CUDA memory snapshots of training steps ([profiling] section).

    with profile_loop(cfg.profiling, dump_folder=..., rank=rank, start_step=start_step) as profiler:
        for step in range(start_step + 1, steps + 1):
            ...                                   # one training step
            profiler.step()

Traces (`enable_profiling`): the last `profiler_active` steps of every `profile_freq` are recorded by
torch.profiler, up to `profiler_warmup` steps before them warm the profiler up, and each rank writes
`<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json`, a Chrome trace: open it in
https://ui.perfetto.dev or chrome://tracing. CPU ops always, CUDA kernels where there is a GPU.
Inside, the step is labelled `ProfilerStep#<k>`: the profiler's own count, from 0 in this run.

Memory snapshots (`enable_memory_snapshot`, CUDA only): the caching allocator records every
allocation with its stack, and each rank writes
`<dump_folder>/<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle` every
`profile_freq` steps, and `iteration_<step>_exit/` when the step runs out of memory: drag it
onto https://pytorch.org/memory_viz. On CPU there is no such allocator: a warning, nothing else.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from config import Profiling
from errors import warn


class Stepper(Protocol):
    def step(self) -> None: ...


class _Off:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def maybe_profile(cfg: Profiling, *, dump_folder: str | Path, rank: int, start_step: int) -> Iterator[Stepper]:
    """A torch.profiler.profile whose `.step()` ends a training step; a no-op unless enable_profiling."""
    if not cfg.enable_profiling:
        yield _Off()
        return
    folder = Path(dump_folder) / cfg.save_traces_folder
    # The recorded (active) steps end each cycle of profile_freq steps; up to profiler_warmup steps
    # before them run the profiler unrecorded (its first steps carry its own start-up overhead).
    active = cfg.profiler_active
    warmup = min(cfg.profiler_warmup, cfg.profile_freq - active)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Profiler won't be using warmup")  # profile_freq = 1
        cycle = torch.profiler.schedule(wait=cfg.profile_freq - active - warmup, warmup=warmup, active=active)

    def schedule(n: int) -> torch.profiler.ProfilerAction:
        # The profiler counts from 0 at the first step of this run; a resumed run starts at start_step.
        return cycle(start_step + n)

    loop_done = False

    def write_trace(prof: torch.profiler.profile) -> None:
        if loop_done:  # the loop ended (or raised) before the step being recorded finished
            return
        step = start_step + prof.step_num  # the step just recorded
        out = folder / f"iteration_{step}"
        out.mkdir(parents=True, exist_ok=True)
        begin = time.perf_counter()
        prof.export_chrome_trace(str(out / f"rank{rank}_trace.json"))
        if rank == 0:
            print(f"profiler: step {step} trace written to {out} ({time.perf_counter() - begin:.1f} s)", flush=True)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with warnings.catch_warnings():
        # Each cycle's events are written by write_trace, so that they are cleared afterwards is the point.
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")
        with torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=write_trace, record_shapes=True
        ) as prof:
            try:
                yield prof
            finally:
                loop_done = True


@contextlib.contextmanager
def maybe_memory_snapshot(cfg: Profiling, *, dump_folder: str | Path, rank: int, start_step: int) -> Iterator[Stepper]:
    """Record CUDA allocator history; `.step()` dumps a snapshot every profile_freq steps; also on OOM."""
    if not cfg.enable_memory_snapshot:
        yield _Off()
        return
    if not torch.cuda.is_available():
        warn(
            "profiling.enable_memory_snapshot is ignored: memory snapshots record the CUDA caching "
            "allocator and this machine has no CUDA device"
        )
        yield _Off()
        return
    snapshot = _MemorySnapshot(
        Path(dump_folder) / cfg.save_memory_snapshot_folder, rank=rank, freq=cfg.profile_freq, step=start_step
    )
    _record_memory_history(True)
    try:
        yield snapshot
    except torch.OutOfMemoryError:
        snapshot.dump(f"iteration_{snapshot.step_num + 1}_exit")  # the step that ran out of memory
        raise
    finally:
        _record_memory_history(False)


@contextlib.contextmanager
def profile_loop(cfg: Profiling, *, dump_folder: str | Path, rank: int, start_step: int) -> Iterator[Stepper]:
    """maybe_profile and maybe_memory_snapshot together; call `.step()` once at the end of every step."""
    where = {"dump_folder": dump_folder, "rank": rank, "start_step": start_step}
    with maybe_profile(cfg, **where) as trace, maybe_memory_snapshot(cfg, **where) as snapshot:
        yield _Both(trace, snapshot)


class _Both:
    def __init__(self, *steppers: Stepper):
        self.steppers = steppers

    def step(self) -> None:
        for stepper in self.steppers:
            stepper.step()


class _MemorySnapshot:
    def __init__(self, folder: Path, *, rank: int, freq: int, step: int):
        self.folder, self.rank, self.freq, self.step_num = folder, rank, freq, step

    def step(self) -> None:
        self.step_num += 1
        if self.step_num % self.freq == 0:
            self.dump(f"iteration_{self.step_num}")

    def dump(self, name: str) -> None:
        out = self.folder / name
        out.mkdir(parents=True, exist_ok=True)
        # Private API (PyTorch 2.13), the one documented at pytorch.org/docs/stable/torch_cuda_memory.html.
        torch.cuda.memory._dump_snapshot(str(out / f"rank{self.rank}_memory_snapshot.pickle"))
        if self.rank == 0:
            print(f"memory snapshot: {out}", flush=True)


def _record_memory_history(enabled: bool) -> None:
    # Private API (PyTorch 2.13), the documented way to record allocator history; the ring buffer
    # keeps the last 100k allocations and frees (a few KB each).
    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=100_000)


class ProfileStep:
    """After each step: the step ends for the profiler and memory snapshots (no-ops by default)."""

    def __init__(self, profiler: Stepper):
        self.profiler = profiler

    def __call__(self, step: int, result: object) -> bool:
        self.profiler.step()
        return False
