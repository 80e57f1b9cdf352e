"""torchrun, with Ctrl-C a stop request rather than a crash: `python -m fleet.launch` takes torchrun's arguments
(`make train` runs it).

A terminal's Ctrl-C sends SIGINT to its foreground process group: make, torchrun, not the ranks (torchrun starts
each in a session of its own). torchrun turns SIGINT into its SignalException: it sends SIGINT on to the ranks,
waits for them and raises the exception again, whatever they did: three warnings, a traceback and exit status 1
after the ranks of train.py saved their last step and exited 0 (stop.py). Here SIGINT is taken from torchrun
(its `--signals-to-handle`, PET_SIGNALS_TO_HANDLE) and the first one is sent on to the ranks as it is: torchrun
then sees them end as any run ends, exit 0 and nothing more when they saved and stopped, its failure summary
when one did not. With no ranks yet, or on a second Ctrl-C, torchrun's own handling takes over: it signals the
ranks (a second SIGINT stops them at once), kills those still running after its `--shutdown-timeout`, and this
launcher exits 130, as a shell does for Ctrl-C. SIGTERM, SIGHUP and SIGQUIT stay torchrun's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

_sent_to: list[int] = []  # the ranks the first Ctrl-C was sent on to


def main() -> int:
    # torchrun's default list without SIGINT. PyTorch 2.9 added the option; an older torchrun takes SIGINT
    # whatever this says, and prints its traceback as before.
    handled = os.environ.get("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")
    os.environ["PET_SIGNALS_TO_HANDLE"] = ",".join(name for name in handled if name.strip() != "SIGINT")
    try:
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.run import main as torchrun
    except KeyboardInterrupt:  # during the imports: nothing started yet
        return 128 + signal.SIGINT
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        torchrun()  # its arguments: sys.argv[1:]
    except SignalException as e:
        if e.sigval != signal.SIGINT:
            raise
        return 128 + signal.SIGINT
    return 0


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
