"""The ranks of a job as a fleet: `launch.py` starts them (`python -m fleet.launch`, torchrun with Ctrl-C a stop
request and the recipe's refusals passed on in their one line), `stop.py` turns a signal or a STOP file into a stop
the ranks agree on, `monitor.py` names a slow rank and ends a job whose rank stopped answering, `faults.py` plays
faults on purpose for tests and drills.

The faults are a leaf: `step_faults` and `pause_points` import faults.py only when its variable is set, so a run
without them imports nothing of it. This file imports nothing heavy either (no torch).
"""

from __future__ import annotations

import os
from collections.abc import Callable

# faults.py's FLEET_FAULT and PAUSE_AT, spelled here so that a run that sets neither need not import it to know
# (tests/test_chaos.py checks that setting each imports it).
_FLEET_FAULT, _PAUSE_AT = "FLEET_FAULT", "CHECKPOINT_PAUSE_AT"


def step_faults(rank: int) -> Callable[[int], None] | None:
    """The hook the fleet's step start calls with the step's number: FLEET_FAULT's faults of rank `rank`
    (fleet/faults.py); None without any."""
    if not os.environ.get(_FLEET_FAULT):
        return None
    from fleet import faults

    return faults.step_faults(rank)


def pause_points() -> Callable[[str, int], None] | None:
    """The hook a checkpoint save calls at each of its points (the point's name, the step): CHECKPOINT_PAUSE_AT's
    pause (fleet/faults.py); None without one."""
    if not os.environ.get(_PAUSE_AT):
        return None
    from fleet import faults

    return faults.pause_points()
