"""Pause points inside a save, for aiming a kill at a chosen moment of it (`scripts/chaos.py`).

A save passes six points, in order; which ranks pass each, and what the folder holds there:

- `start`: every rank, before DCP's first collective; rank 0 has made the empty `step-<N>.partial/`.
- `write`: every rank, in the thread that writes (an async save's background thread), after the first bytes of
  its first shard file: that file is partly written.
- `metadata`: rank 0 (DCP's coordinator), once every rank's files are written, before it writes anything else.
- `manifest`: rank 0, `checksums.json` written, `.metadata` not yet renamed into place.
- `publish`: rank 0, the save complete (`.metadata` there), before `step-<N>.partial` is renamed `step-<N>`.
- `prune`: rank 0, the save published, an older step renamed `step-<M>.pruned` and not yet deleted.

`CHECKPOINT_PAUSE_AT="<point>[,step=<N>][,rank=<R>][,seconds=<S>]"` makes that rank (every rank that passes
the point when no rank is given) print one line to stderr, `CHECKPOINT_PAUSE_AT: rank R (pid P) paused at
<point> of step N for S s`, and sleep S seconds (default 10), once in the save of step N (once in every save when
no step is given); the line tells a watcher which process to kill while it holds still there. Unset, a point costs
one lookup in os.environ. A fault-injection tool only: nothing in a run sets it.
"""

from __future__ import annotations

import os
import re
import sys
import time

VARIABLE = "CHECKPOINT_PAUSE_AT"
POINTS = ("start", "write", "metadata", "manifest", "publish", "prune")
RANK0_POINTS = ("metadata", "manifest", "publish", "prune")  # the others' ranks pass start and write too
_STEP_FOLDER = re.compile(r"^step-(\d+)(\.partial)?$")
_paused: set[tuple[str, int | None]] = set()  # (point, step) this process has paused at: once each


def pause_point(point: str, step: int | None) -> None:
    """Pause here when CHECKPOINT_PAUSE_AT names this point (and this step and rank, where it names them)."""
    if not (spec := os.environ.get(VARIABLE)):
        return
    name, *options = spec.split(",")
    settings = dict(option.partition("=")[::2] for option in options)
    if name not in POINTS or set(settings) - {"step", "rank", "seconds"}:
        raise ValueError(f"{VARIABLE}={spec!r}: expected one of {', '.join(POINTS)}, then step=N, rank=R, seconds=S")
    rank = int(os.environ.get("RANK", "0"))
    if name != point or (point, step) in _paused:
        return
    if settings.get("step", str(step)) != str(step) or settings.get("rank", str(rank)) != str(rank):
        return
    _paused.add((point, step))
    seconds = float(settings.get("seconds", 10))
    line = f"{VARIABLE}: rank {rank} (pid {os.getpid()}) paused at {point} of step {step} for {seconds:g} s"
    print(line, file=sys.stderr, flush=True)
    time.sleep(seconds)


def step_of(folder: str | os.PathLike) -> int | None:
    """The step of a `step-<N>` or `step-<N>.partial` folder; None for any other (a seed's, an export's)."""
    match = _STEP_FOLDER.match(os.path.basename(os.fspath(folder)))
    return int(match.group(1)) if match else None
