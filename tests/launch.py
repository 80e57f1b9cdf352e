"""A small launcher for multi-process gloo tests: torchrun in a subprocess, output captured."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from config import REPO

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    script: str | Path,
    *args: str,
    nproc: int,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    check: bool = True,
    cwd: str | Path = REPO,
) -> subprocess.CompletedProcess[str]:
    """Run `torchrun --nproc_per_node=nproc script args...` on CPU/gloo, from the repo root unless `cwd`."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(script), *args,
    ]  # fmt: skip
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def python(
    *args: str, timeout: float = 600, env: dict[str, str] | None = None, cwd: str | Path = REPO
) -> subprocess.CompletedProcess[str]:
    """Run `python args...` (world size 1, no torchrun), from the repo root unless `cwd`."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def two_at_a_time(*launches: Callable[[], T]) -> list[T]:
    """Independent launches side by side, their results in the order given: a launch spends its first seconds
    importing torch in one process (train.py of one rank, torchrun's launcher), on one of the machine's two cores."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda launch: launch(), launches))
