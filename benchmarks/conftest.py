"""The benchmarks' tests start their processes as the rest of the suite does (tests/launch.py): forked from an
interpreter that has imported torch once, the ranks started without torchrun's launcher. `make bench` starts each
as a new interpreter under torchrun (benchmarks/harness.py, LAUNCH None)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import harness


def _forked(
    args: tuple[str, ...], *, nproc: int | None, capture: bool, timeout: float | None, env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    from tests.launch import python, torchrun

    limit = 600 if timeout is None else timeout
    if nproc is None:
        proc = python(*args, timeout=limit, env=env, cwd=cwd)
    else:
        proc = torchrun(args[0], *args[1:], nproc=nproc, timeout=limit, env=env, check=False, cwd=cwd)
    if not capture:  # what passing them through would have shown
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
    return proc


@pytest.fixture(autouse=True, scope="session")
def forked_launches() -> Iterator[None]:
    harness.LAUNCH = _forked
    yield
    harness.LAUNCH = None
