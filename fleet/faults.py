"""Faults played on purpose, for tests and drills: a rank that freezes, sleeps or slows down as a step starts
(`FLEET_FAULT`), and a rank held still at a named point inside a checkpoint save, to aim a kill there
(`CHECKPOINT_PAUSE_AT`, scripts/chaos.py). Nothing in a run sets either; this module is imported only when one is
set (fleet/__init__.py), so a run without them neither imports nor parses any of it.

`FLEET_FAULT="<kind>,rank=<R>,step=<N>[,seconds=<S>]"` makes rank R misbehave as step N starts: `stop` sends
itself SIGSTOP (frozen, as a hung node is), `sleep` sleeps S seconds (default an hour) outside any collective,
`spin` works S more seconds in that step and every later one (a slow rank); several faults are separated by ";".
The fleet's step start (fleet/monitor.py) calls the hook `step_faults` returns.

`CHECKPOINT_PAUSE_AT="<point>[,step=<N>][,rank=<R>][,seconds=<S>]"` holds a rank still at one of the points a save
passes (the checkpoint code calls the hook `pause_points` returns at each; it knows nothing of this variable). In
order, which ranks pass each, and what the folder holds there:

- `start`: every rank, before DCP's first collective; rank 0 has made the empty `step-<N>.partial/`.
- `write`: every rank, in the thread that writes (an async save's background thread), after the first bytes of
  its first shard file: that file is partly written.
- `metadata`: rank 0 (DCP's coordinator), once every rank's files are written, before it writes anything else.
- `manifest`: rank 0, `checksums.json` written, `.metadata` not yet renamed into place.
- `publish`: rank 0, the save complete (`.metadata` there), before `step-<N>.partial` is renamed `step-<N>`.
- `prune`: rank 0, the save published, an older step renamed `step-<M>.pruned` and not yet deleted.

That rank (every rank that passes the point when no rank is given) prints one line to stderr,
`CHECKPOINT_PAUSE_AT: rank R (pid P) paused at <point> of step N for S s`, and sleeps S seconds (default 10), once
in the save of step N (once in every save when no step is given); the line tells a watcher which process to kill
while it holds still there.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

FLEET_FAULT = "FLEET_FAULT"
PAUSE_AT = "CHECKPOINT_PAUSE_AT"
FAULTS = ("stop", "sleep", "spin")
POINTS = ("start", "write", "metadata", "manifest", "publish", "prune")
RANK0_POINTS = ("metadata", "manifest", "publish", "prune")  # the others' ranks pass start and write too


def _settings(options: list[str]) -> dict[str, str]:
    return dict(option.partition("=")[::2] for option in options)


# ---------------------------------------------------------------------------- a rank that misbehaves


@dataclass
class Fault:
    """One fault of FLEET_FAULT, played by this rank as a step starts."""

    kind: str
    step: int
    seconds: float

    def __call__(self, step: int) -> None:
        if step == self.step:  # what a drill times the detection from
            line = f"{FLEET_FAULT}: rank {os.environ.get('RANK', 0)} (pid {os.getpid()}) {self.kind} at step {step}"
            print(f"{line} ({time.time():.3f})", file=sys.stderr, flush=True)
        if self.kind == "spin" and step >= self.step:
            until = time.perf_counter() + self.seconds
            while time.perf_counter() < until:
                pass
        elif self.kind == "sleep" and step == self.step:
            time.sleep(self.seconds)
        elif self.kind == "stop" and step == self.step:
            os.kill(os.getpid(), signal.SIGSTOP)


def parse_faults(spec: str, *, rank: int) -> list[Fault]:
    """Rank `rank`'s faults of a FLEET_FAULT value (several are separated by ";"); ValueError in one line for a
    value that is not one."""
    faults = []
    for one in filter(None, spec.split(";")):
        kind, *options = one.split(",")
        settings = _settings(options)
        if kind not in FAULTS or not {"rank", "step"} <= set(settings) <= {"rank", "step", "seconds"}:
            raise ValueError(f"{FLEET_FAULT}={one!r}: expected {' or '.join(FAULTS)}, rank=R, step=N, seconds=S")
        if int(settings["rank"]) == rank:
            faults.append(Fault(kind, int(settings["step"]), float(settings.get("seconds", 3600))))
    return faults


def step_faults(rank: int) -> Callable[[int], None] | None:
    """The hook the fleet calls as each step starts (its number): FLEET_FAULT's faults of rank `rank`; None when it
    names none of this rank's."""
    faults = parse_faults(os.environ.get(FLEET_FAULT, ""), rank=rank)
    if not faults:
        return None

    def play(step: int) -> None:
        for fault in faults:
            fault(step)

    return play


# ---------------------------------------------------------------------------- a rank held still inside a save


@dataclass
class Pause:
    """CHECKPOINT_PAUSE_AT: where (the point, the step or every step) and how long this rank holds still, once each."""

    point: str
    step: int | None
    seconds: float
    rank: int
    done: set[int]  # the steps it has paused at

    def __call__(self, point: str, step: int) -> None:
        if point != self.point or (self.step is not None and step != self.step) or step in self.done:
            return
        self.done.add(step)
        line = (
            f"{PAUSE_AT}: rank {self.rank} (pid {os.getpid()}) paused at {point} of step {step} for {self.seconds:g} s"
        )
        print(line, file=sys.stderr, flush=True)
        time.sleep(self.seconds)


def parse_pause(spec: str, *, rank: int) -> Pause | None:
    """CHECKPOINT_PAUSE_AT's pause for rank `rank` (None: it names another rank); ValueError in one line for a value
    that is not one."""
    name, *options = spec.split(",")
    settings = _settings(options)
    if name not in POINTS or set(settings) - {"step", "rank", "seconds"}:
        raise ValueError(f"{PAUSE_AT}={spec!r}: expected one of {', '.join(POINTS)}, then step=N, rank=R, seconds=S")
    if int(settings.get("rank", rank)) != rank:
        return None
    step = int(settings["step"]) if "step" in settings else None
    return Pause(name, step, float(settings.get("seconds", 10)), rank, set())


def pause_points() -> Callable[[str, int], None] | None:
    """The hook a save calls at each of its points (the point's name, the step saved): CHECKPOINT_PAUSE_AT's pause
    for this process's rank (RANK); None when it names another rank."""
    return parse_pause(os.environ.get(PAUSE_AT, ""), rank=int(os.environ.get("RANK", "0")))
