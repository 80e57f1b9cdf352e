"""Stop requests: SIGTERM, SIGINT (Ctrl-C) or a `<dump_folder>/STOP` file end a run with a checkpoint
of its last completed step, in seconds, whatever the step length.

Every rank records the first signal it gets (`listen`, from train.py's first lines, so that a signal
during the imports and start-up is a request too, not a KeyboardInterrupt traceback per rank); rank
0 also looks for the STOP file. The ranks agree (`StopRequest.requested`, one all-reduce of a
2-float CPU tensor) at two kinds of points:

- after each optimizer step: the step is complete and is saved;
- between the micro-batches of a step (gradient accumulation): the step in flight is abandoned
  (its gradients dropped, the loader rewound) and the last completed one is saved, so a launcher's
  grace period (torchrun's `--shutdown-timeout`, a scheduler's SIGTERM-to-SIGKILL) has to cover
  one micro-batch and a save, not a whole step. One micro-batch longer than the grace period is
  out of reach.

A second signal stops the process at once, saving nothing. This module imports nothing heavy at
the top: train.py loads it before torch (a few seconds of imports).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received = {"signum": 0, "at": 0.0}  # the first stop signal of this process, and when (time.time())


def listen() -> None:
    """From now on SIGTERM and SIGINT are stop requests (idempotent)."""
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)


def _on_signal(signum: int, frame: Any) -> None:
    if _received["signum"]:
        if os.environ.get("RANK", "0") == "0":
            print(f"{signal.Signals(signum).name} again: stopping at once, nothing saved", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    _received["signum"], _received["at"] = signum, time.time()


class StopRequest:
    """The ranks' agreement on a stop request; `requested` is a collective (every rank calls it at the same points)."""

    def __init__(self, group: Any, *, stop_file: Path, is_rank0: bool):
        listen()
        self.group, self.stop_file, self.is_rank0 = group, stop_file, is_rank0
        self.reason: str | None = None
        self.since = 0.0  # time.time() of the request (rank 0's signal or the STOP file's mtime)

    def requested(self) -> str | None:
        """Why every rank must stop now (the same answer on every rank), or None."""
        import torch  # here, not at the top: see the module docstring
        import torch.distributed as dist

        found = self.is_rank0 and self.stop_file.exists()
        agreed = torch.tensor([float(_received["signum"]), float(found)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        if agreed[1]:
            self.reason = f"{self.stop_file} found"
            self.since = self._mtime() if found else time.time()
        elif agreed[0]:
            self.reason = signal.Signals(int(agreed[0])).name
            self.since = _received["at"] or time.time()
        return self.reason

    def _mtime(self) -> float:
        try:
            return self.stop_file.stat().st_mtime
        except FileNotFoundError:
            return time.time()

    def done(self, message: str) -> None:
        """Rank 0 says how the run stopped and how long after the request; a rerun must not stop again at once."""
        if self.is_rank0:
            self.stop_file.unlink(missing_ok=True)
            print(f"{message} ({time.time() - self.since:.1f} s after the request)", flush=True)


class StopAfterStep:
    """After each step (every rank): on a stop request, save this step and end the run."""

    def __init__(self, request: StopRequest, checkpoint: Any):
        self.request, self.checkpoint = request, checkpoint

    def __call__(self, step: int, result: Any) -> bool:
        if reason := self.request.requested():
            self.checkpoint.save(step, wait=True)
            self.request.done(f"{reason}: saved step {step} and stopped; rerun the same command to resume")
            return True
        return False

    def abandoned(self, step: int, *, start_step: int) -> None:
        """A stop request between the micro-batches of `step`: it is not applied; the last completed step is saved."""
        if step - 1 == start_step:
            saved = "nothing new to save"
        else:
            if self.checkpoint.last_saved != step - 1:  # (an interval save may have written it already)
                self.checkpoint.save(step - 1, wait=True)
            saved = f"saved step {step - 1}"
        self.request.done(
            f"{self.request.reason}: abandoned step {step} in flight, {saved} and stopped; rerun the same command to "
            "resume"
        )
