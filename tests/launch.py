"""A small launcher for multi-process gloo tests: the ranks torchrun would start, or torchrun itself, output captured."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
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
    launcher: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`torchrun --nproc_per_node=nproc script args...` on CPU/gloo, from the repo root unless `cwd`.

    The ranks are started directly, with the environment torchrun gives them (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and stopped together when one fails, as torchrun stops them: its
    launcher process would import torch once more per launch, seconds of these 2 cores each. stdout and stderr are
    the ranks' in rank order; the exit status is torchrun's (0, or 1 when a rank failed). launcher: start torchrun
    itself, for a test of what it prints or does (a rank's failure summary, its signal forwarding).
    """
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    port = str(free_port())
    if launcher:
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", port,
            str(script), *args,
        ]  # fmt: skip
        proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    else:
        cmd = [sys.executable, str(script), *args]
        proc = _ranks(cmd, nproc=nproc, port=port, env=full_env, cwd=cwd, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def _ranks(
    cmd: list[str], *, nproc: int, port: str, env: dict[str, str], cwd: str | Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """`cmd` as `nproc` ranks of one local group; the others killed as soon as one fails."""
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    with contextlib.ExitStack() as files:
        # Files, not pipes: a rank writing into a full pipe nobody reads yet would stall.
        outs = [
            (files.enter_context(tempfile.TemporaryFile("w+")), files.enter_context(tempfile.TemporaryFile("w+")))
            for _ in range(nproc)
        ]
        ranks = [
            subprocess.Popen(cmd, cwd=cwd, env={**env, **world, "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0"},
                             stdout=out, stderr=err, text=True)
            for r, (out, err) in enumerate(outs)
        ]  # fmt: skip
        deadline, timed_out = time.monotonic() + timeout, False
        try:
            while any(r.poll() is None for r in ranks) and not any(r.returncode not in (None, 0) for r in ranks):
                if timed_out := time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for r in ranks:
                if r.poll() is None:
                    r.kill()
                r.wait()
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout)
        for f in (f for pair in outs for f in pair):
            f.seek(0)
        stdout = "".join(out.read() for out, _ in outs)
        stderr = "".join(err.read() for _, err in outs)
    returncode = 0 if all(r.returncode == 0 for r in ranks) else 1
    return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


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
