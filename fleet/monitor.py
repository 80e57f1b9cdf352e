"""The fleet's two quiet failures made loud: a slow rank named, a frozen rank ended.

In a synchronous job every rank's step takes as long as the slowest rank's, so a slow rank (a busy host, a throttled
device, slow storage) shows nowhere: the job just runs at its speed. What differs between the ranks is how long each
works before it waits for the others. Every `metrics.log_freq` steps the ranks gather that figure, and rank 0 names the
slowest rank (rank, host, local rank) when it is more than `metrics.straggler_threshold` behind the others' median;
metrics.jsonl keeps every rank's figures (`rank_busy_s`, `rank_data_s`).

A rank that stops answering (a hung kernel, a frozen node) leaves the others waiting in a collective until its
time-out, which must be long enough for the slowest legitimate collective. A watchdog thread per rank, armed when a step
starts and disarmed when it ends, ends the job when a step takes longer than `comm.hang_timeout_seconds` (by default 5
x the median step, at least 60 s): every rank that can still run writes all its threads' stacks and what it waits in
to `<dump_folder>/hang/rank<N>.txt`, the lowest of them prints one line naming the ranks that did not arrive, the
frozen ones of each host are killed by their neighbours, and every rank exits with status 124, which ends the job under torchrun (and restarts it under `--max-restarts`). A frozen
process writes nothing: its missing file is what names it. docs/faults.md says what the user sees and does.

Both are one object, `Fleet`, with two entries in train.py's work after a step: `step_done` right after the log (the
step's figures; on logging steps the gather and the report) and `step_starts` last (the next step's clocks, the
watchdog armed). What runs between them (validation, a save, the profiler) is not part of a step.

For tests and drills, `on_step_start` is a hook called as each step starts (fleet/faults.py's FLEET_FAULT: a rank
that freezes, sleeps or slows down); None in a run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from config import Comm, Metrics
from metrics import MetricsLogger, logged

if TYPE_CHECKING:
    from data.loader import GlobalBatchLoader
    from fleet.stop import StopRequest

HANG_EXIT = 124  # the exit status of a job ended by the watchdog (coreutils' `timeout` uses it too)
AUTO_FACTOR, AUTO_FLOOR_S = 5, 60.0  # "auto": this many median steps, at least this many seconds
AUTO_AFTER = 3  # "auto" arms once this many steps are timed (the first step of a process, its compile, never is)
AUTO_WINDOW = 100  # the steps whose median "auto" reads: the latest, so that a run whose steps change follows them


def busy_seconds() -> float:
    """Seconds this thread has spent on a CPU or ready and waiting for one (Linux's /proc schedstat).

    Both count: a rank whose core another process shares waits in the run queue, and that wait is what makes it slow.
    The time it sleeps (in a blocking collective, or for storage) is not counted. Without schedstat: its CPU time."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, runnable, _ = f.read().split()
        return (int(on_cpu) + int(runnable)) / 1e9
    except (OSError, ValueError):
        return time.thread_time()


@dataclass
class Window:
    """This rank's timed steps since the last report."""

    steps: int = 0
    busy: float = 0.0  # seconds working (busy_seconds) in those steps
    data: float = 0.0  # seconds reading their samples


@dataclass
class Peer:
    """A rank as the others know it (gathered at start-up): where to look for it, and the process to end."""

    host: str
    local_rank: int
    pid: int

    def describe(self, rank: int) -> str:
        return f"rank {rank} (host {self.host}, local rank {self.local_rank})"


class Fleet:
    """The slow-rank report and the hang watchdog of a run (see the module docstring); `close` stops the watchdog."""

    def __init__(
        self,
        comm: Comm,
        metrics: Metrics,
        *,
        dump_folder: str,
        total_steps: int,
        loader: GlobalBatchLoader,
        logger: MetricsLogger,
        stop_request: StopRequest,
        group: dist.ProcessGroup | None,
        on_step_start: Callable[[int], None] | None = None,
    ):
        self.setting = comm.hang_timeout_seconds
        self.threshold, self.log_freq = metrics.straggler_threshold, metrics.log_freq
        self.total_steps, self.loader, self.logger, self.stop_request = total_steps, loader, logger, stop_request
        self.group = group  # a CPU (gloo) group: the report's gather moves a few floats, no device sync
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.hang_folder = Path(dump_folder) / "hang"
        if self.rank == 0:
            set_aside_previous_hang(self.hang_folder)
        peers: list[Any] = [None] * self.world
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        dist.all_gather_object(peers, (socket.gethostname(), local_rank, os.getpid()), group=group)  # start-up
        self.peers = [Peer(host, local, pid) for host, local, pid in peers]
        self.on_step_start = on_step_start
        self.step_times: deque[float] = deque(maxlen=AUTO_WINDOW)
        self.window, self.window_first = Window(), 0
        self.began: tuple[float, float, float] | None = None  # (wall, busy, data) when the step in flight began
        self.watchdog = Watchdog(self.hang) if self.setting != 0 else None

    # ------------------------------------------------------------ the two entries

    def step_done(self, step: int, result: object) -> bool:
        """Step `step` is done: the watchdog disarmed, its figures counted; on logging steps, the slow-rank report."""
        if self.watchdog is not None:
            self.watchdog.disarm()
        if self.began is not None:  # (the first step of a process is not timed: it began before any entry ran)
            wall, busy, data = self.began
            self.step_times.append(time.perf_counter() - wall)
            if not self.window.steps:
                self.window_first = step
            self.window.steps += 1
            self.window.busy += busy_seconds() - busy
            self.window.data += self.loader.reading_seconds - data
            self.began = None
        # Every rank timed the same steps: all of them gather, or none. One process has no fleet to compare.
        if self.world > 1 and self.window.steps and logged(step, freq=self.log_freq, total_steps=self.total_steps):
            self.report(step)
        return False

    def step_starts(self, step: int, result: object) -> bool:
        """The last work after step `step`: step `step + 1` starts now; its clocks start and the watchdog is armed."""
        if step >= self.total_steps:
            return False
        self.began = (time.perf_counter(), busy_seconds(), self.loader.reading_seconds)
        if self.watchdog is not None and (seconds := deadline(self.setting, self.step_times)) is not None:
            self.watchdog.arm(step + 1, seconds)
        if self.on_step_start is not None:
            self.on_step_start(step + 1)
        return False

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()

    # ------------------------------------------------------------ the slow rank

    def report(self, step: int) -> None:
        """One all_gather of two floats per rank on the CPU group; rank 0 logs every rank's figures and names the
        slowest when it is more than the threshold behind."""
        n = self.window.steps
        mine = torch.tensor([self.window.busy / n, self.window.data / n], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine, group=self.group)
        self.window = Window()
        if self.rank != 0:
            return
        busy = [float(figures[0]) for figures in everyone]
        data = [float(figures[1]) for figures in everyone]
        line = slow_rank_line(busy, data, peers=self.peers, threshold=self.threshold, steps=(self.window_first, step))
        self.logger.log_ranks(step, {"rank_busy_s": busy, "rank_data_s": data}, line=line)

    # ------------------------------------------------------------ the hang

    def hang(self, step: int, seconds: float, main: int) -> None:
        """The watchdog thread, step `step` not done after `seconds`: write this rank's stacks, wait for the other
        ranks' (a rank frozen or dead writes none), the lowest rank that wrote prints the one line, and exit.

        A stop request in progress (fleet/stop.py) saves and ends the run on its own: nothing is done then."""
        if self.stop_request.reason is not None:
            return
        self.hang_folder.mkdir(parents=True, exist_ok=True)
        frame = sys._current_frames().get(main)
        where = waiting_in(frame) if frame is not None else "the main thread has ended"
        mine = self.hang_folder / f"rank{self.rank}.txt"
        partial = mine.with_suffix(".partial")
        with partial.open("w") as f:
            f.write(
                f"{self.peers[self.rank].describe(self.rank)}, pid {os.getpid()}: step {step} not done after "
                f"{seconds:g} s; {where}\n\nEvery thread, the most recent call first:\n"
            )
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        os.replace(partial, mine)  # whole, for the rank that reads it
        # The ranks arm as they leave the same after-step work, so their watchdogs fire within moments of each other;
        # the rest of the grace is for a slow filesystem. One directory listing a poll: thousands of ranks wait here.
        until = time.monotonic() + min(5 + seconds / 10, 30)
        while time.monotonic() < until and len(self.written()) < self.world:
            time.sleep(0.5)
        written = self.written()
        self.end_frozen_neighbours(written)
        reported = self.hang_folder / ".reported"
        if self.rank == min(written):
            firsts = {rank: first_line(self.hang_folder / f"rank{rank}.txt") for rank in written}
            print(
                f"error: {hang_line(step, seconds, firsts, self.peers, self.hang_folder)}", file=sys.stderr, flush=True
            )
            reported.touch()
        else:  # the reporter prints before this rank's exit ends the job (torchrun stops the others)
            until = time.monotonic() + 10
            while time.monotonic() < until and not reported.exists():
                time.sleep(0.1)
        sys.stdout.flush()
        os._exit(HANG_EXIT)

    def end_frozen_neighbours(self, written: set[int]) -> None:
        """SIGKILL the ranks of this host that wrote no stacks. A frozen process ignores the SIGTERM torchrun ends a
        job with, and torchrun waits its --shutdown-timeout (scripts/run_multinode.sh gives ranks minutes to save on a
        stop) before it kills one; ended here, the job ends as soon as every rank has exited."""
        me = self.peers[self.rank]
        for rank, peer in enumerate(self.peers):
            if rank not in written and peer.host == me.host:
                with contextlib.suppress(OSError):  # (only a process of this job: the same command line as this one)
                    if Path(f"/proc/{peer.pid}/cmdline").read_bytes() == Path("/proc/self/cmdline").read_bytes():
                        os.kill(peer.pid, signal.SIGKILL)

    def written(self) -> set[int]:
        """The ranks whose hang file is there."""
        names = set(os.listdir(self.hang_folder))
        return {rank for rank in range(self.world) if f"rank{rank}.txt" in names}


def first_line(path: Path) -> str:
    with path.open() as f:
        return f.readline()


def deadline(setting: float | str, step_times: Sequence[float]) -> float | None:
    """The seconds the next step may take, or None (not armed): comm.hang_timeout_seconds (0: off), or "auto"'s
    AUTO_FACTOR x the median of the latest steps, at least AUTO_FLOOR_S, once AUTO_AFTER steps are timed.

    A multiple of the median, not of the mean or the last step: one long step (a recompile, a slow read) moves
    neither. The floor is for short steps, whose times vary most (a garbage collection, a page fault)."""
    if setting == "auto":
        if len(step_times) < AUTO_AFTER:
            return None
        return max(AUTO_FLOOR_S, AUTO_FACTOR * statistics.median(step_times))
    return float(setting) or None


def slow_rank_line(
    busy: list[float], data: list[float], *, peers: list[Peer], threshold: float, steps: tuple[int, int]
) -> str | None:
    """The console's line naming the slowest rank, or None when no rank is more than `threshold` behind.

    A rank's figure is its time working plus its time reading data, per step. It is compared with the median of the
    other ranks, not of all: with 2 ranks the median of all would be half the slow one."""
    if len(busy) < 2:
        return None
    total = [b + d for b, d in zip(busy, data, strict=True)]
    slowest = max(range(len(total)), key=total.__getitem__)
    others = statistics.median(t for r, t in enumerate(total) if r != slowest)
    if others <= 0 or (behind := total[slowest] / others - 1) <= threshold:
        return None
    first, last = steps
    span = f"step {last}" if first == last else f"steps {first}-{last}"
    return (
        f"slow rank, {span}: {peers[slowest].describe(slowest)} works {1000 * total[slowest]:.0f} ms a step, "
        f"{100 * behind:.0f}% more than the other ranks' median of {1000 * others:.0f} ms (reading data "
        f"{1000 * data[slowest]:.0f} ms of it; metrics.straggler_threshold = {threshold:g}); the others wait for it"
    )


def hang_line(step: int, seconds: float, written: dict[int, str], peers: list[Peer], folder: Path) -> str:
    """One line for the whole job: which ranks did not arrive (wrote no stacks, or are not in a collective)."""
    silent = [r for r in range(len(peers)) if r not in written]
    outside = [r for r, first in sorted(written.items()) if "; not in a collective" in first]
    waiting = [r for r in sorted(written) if r not in outside]
    late = [f"{peers[r].describe(r)} wrote no stacks (frozen or dead)" for r in silent]
    late += [f"{peers[r].describe(r)} is busy outside any collective (see {folder / f'rank{r}.txt'})" for r in outside]
    if late:
        what = "; ".join(late) + (f"; {_ranks(waiting)} waited for it" if waiting else "")
    else:
        what = (
            "every rank waits in a collective that does not complete (ranks in different collectives, or the network)"
        )
    return (
        f"step {step} did not finish within {seconds:g} s (comm.hang_timeout_seconds): {what}"
        + f"; stacks in {folder}; rerun the same command to resume from the last checkpoint"
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def waiting_in(frame: Any) -> str:
    """What a thread stopped at `frame` waits in: the collective (the innermost torch.distributed call, and the
    recipe's line that led to it), or, outside any, its innermost line."""
    stack = traceback.extract_stack(frame)  # outermost first
    ours = [f for f in stack if "site-packages" not in f.filename and "/lib/python" not in f.filename]
    caller = f", from {_short(ours[-1])}" if ours else ""
    for f in reversed(stack):
        if f"{os.sep}torch{os.sep}distributed{os.sep}" in f.filename:
            return f"in a collective: {_short(f)}{caller}"
    return f"not in a collective: at {_short(stack[-1])}" if stack else "not in a collective"


def _short(f: traceback.FrameSummary) -> str:
    path = f.filename.split("site-packages" + os.sep, 1)[-1]
    repo = str(Path(__file__).parent.parent) + os.sep
    return f"{path.removeprefix(repo)}:{f.lineno} {f.name}"


def set_aside_previous_hang(folder: Path) -> None:
    """A previous run's `hang/` becomes `hang-<its time>/`: `hang/` holds this run's stacks only, and none is lost."""
    if not folder.is_dir():
        return
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(folder.stat().st_mtime))
    aside, again = folder.with_name(f"hang-{stamp}"), 1
    while aside.exists():
        aside, again = folder.with_name(f"hang-{stamp}-{again}"), again + 1
    os.replace(folder, aside)


class Watchdog:
    """A daemon thread that calls `expired(step, seconds, main_thread_id)` when a step armed for `seconds` is not
    disarmed in time. It waits on a condition, so arming and disarming cost a lock each, and it runs while the main
    thread waits in a collective (which releases the GIL)."""

    def __init__(self, expired: Callable[[int, float, int], None]):
        self.expired, self.main = expired, threading.get_ident()
        self.condition = threading.Condition()
        self.armed: tuple[int, float, float] | None = None  # (step, its deadline on time.monotonic, seconds)
        self.closed = False
        threading.Thread(target=self._watch, name="fleet-watchdog", daemon=True).start()

    def arm(self, step: int, seconds: float) -> None:
        with self.condition:
            self.armed = (step, time.monotonic() + seconds, seconds)
            self.condition.notify()

    def disarm(self) -> None:
        with self.condition:
            self.armed = None

    def close(self) -> None:
        with self.condition:
            self.armed, self.closed = None, True
            self.condition.notify()

    def _watch(self) -> None:
        while True:
            with self.condition:
                if self.closed:
                    return
                if self.armed is None:
                    self.condition.wait()
                    continue
                step, deadline, seconds = self.armed
                if (left := deadline - time.monotonic()) > 0:
                    self.condition.wait(left)
                    continue
                self.armed = None
            self.expired(step, seconds, self.main)  # exits the process, or returns when a stop is under way
