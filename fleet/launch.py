"""torchrun, with Ctrl-C a stop request rather than a crash and a refused config said in its one line:
`python -m fleet.launch` takes torchrun's arguments (`make train` runs it).

A terminal's Ctrl-C sends SIGINT to its foreground process group: make, torchrun, not the ranks (torchrun starts
each in a session of its own). torchrun turns SIGINT into its SignalException: it sends SIGINT on to the ranks,
waits for them and raises the exception again, whatever they did: three warnings, a traceback and exit status 1
after the ranks of train.py saved their last step and exited 0 (fleet/stop.py). Here SIGINT is taken from torchrun
(its `--signals-to-handle`, PET_SIGNALS_TO_HANDLE) and the first one is sent on to the ranks as it is: torchrun
then sees them end as any run ends, exit 0 and nothing more when they saved and stopped, its failure summary
when one did not. With no ranks yet, or on a second Ctrl-C, torchrun's own handling takes over: it signals the
ranks (a second SIGINT stops them at once), kills those still running after its `--shutdown-timeout`, and this
launcher exits 130, as a shell does for Ctrl-C. SIGTERM, SIGHUP and SIGQUIT stay torchrun's.

A run the recipe refuses (a bad key, a missing file: errors.py) prints one line naming the key and the fix, and its
ranks exit with status 2. torchrun would add its ChildFailedError report and a traceback through this file, some
forty lines about a launch that did what it should. When the first rank to fail exited 2 and every other failed rank
did too, or was ended by torchrun on the way out, this launcher says nothing more and exits 2 itself. Any other
failure (a crash, a signal, another status) gets torchrun's report as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

_sent_to: list[int] = []  # the ranks the first Ctrl-C was sent on to
REFUSED = 2  # the exit status of a run the recipe refused, its reason said (errors.py `report`)
ENDED_BY_TORCHRUN = (-signal.SIGTERM, -signal.SIGKILL)  # the ranks it stops once one has failed


def main() -> int:
    # torchrun's default list without SIGINT. PyTorch 2.9 added the option; an older torchrun takes SIGINT
    # whatever this says, and prints its traceback as before.
    handled = os.environ.get("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")
    os.environ["PET_SIGNALS_TO_HANDLE"] = ",".join(name for name in handled if name.strip() != "SIGINT")
    try:
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun
    except KeyboardInterrupt:  # during the imports: nothing started yet
        return 128 + signal.SIGINT
    signal.signal(signal.SIGINT, _on_sigint)
    quiet = _QuietRefusal()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(quiet)
    try:
        torchrun()  # its arguments: sys.argv[1:]
    except SignalException as e:
        if e.sigval != signal.SIGINT:
            raise
        return 128 + signal.SIGINT
    except ChildFailedError as e:
        _, first = e.get_first_failure()  # torchrun's root cause
        if not refused(first.exitcode, [f.exitcode for f in e.failures.values()]):
            raise
        return REFUSED
    finally:
        quiet.release()
    return 0


def refused(first: int, codes: list[int]) -> bool:
    """Whether the ranks' exit statuses are the recipe refusing the run: the first to fail exited REFUSED, and every
    other that failed exited REFUSED too or was ended by torchrun after it."""
    return first == REFUSED and all(code in (REFUSED, *ENDED_BY_TORCHRUN) for code in codes)


class _QuietRefusal(logging.Filter):
    """torchrun's agent logs that it ends the other ranks, then which failed first, before it raises. The first lines
    are held until the second says whether the run was refused: then they are dropped with it; otherwise let through
    in order (and whatever is held when torchrun returns or raises otherwise: `release`)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "released", False):
            return True
        if record.msg.startswith("Sending process %s closing signal"):
            self.held.append(record)
            return False
        if record.msg.startswith("failed (exitcode: %s)"):
            if isinstance(record.args, tuple) and record.args[0] == REFUSED:
                self.held = []
                return False
            self.release()
        return True

    def release(self) -> None:
        held, self.held = self.held, []
        for record in held:
            record.released = True
            logging.getLogger(record.name).handle(record)


def _on_sigint(signum: int, frame: Any) -> None:
    ranks = [] if _sent_to else _children()
    if not ranks:
        from torch.distributed.elastic.multiprocessing import SignalException

        raise SignalException(f"Process {os.getpid()} got signal: {signal.SIGINT}", sigval=signal.SIGINT)
    _sent_to.extend(ranks)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):  # one that has just ended
            os.kill(pid, signal.SIGINT)


def _children() -> list[int]:
    """This process's children: the ranks (torchrun's rendezvous store and log tailing are threads, not processes)."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    if (tasks / str(os.getpid()) / "children").exists():  # Linux
        return [int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split()]
    found = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True)  # macOS
    return [int(pid) for pid in found.stdout.split()]


if __name__ == "__main__":
    sys.exit(main())
