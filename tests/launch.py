"""A small launcher for multi-process gloo tests: the ranks torchrun would start, or torchrun itself, output captured."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TypeVar

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

    The ranks are started directly (forked from a warm interpreter where they can be: `start`), with the environment
    torchrun gives them (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and stopped
    together when one fails, as torchrun stops them: its launcher process would import torch once more per launch,
    seconds of these 2 cores each. stdout and stderr are the ranks' in rank order; the exit status is torchrun's (0,
    or 1 when a rank failed). launcher: start torchrun itself, for a test of what it prints or does (a rank's failure
    summary, its signal forwarding).
    """
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    for _ in range(3):  # a free port can be taken before rank 0 listens on it (gloo's own sockets, other launches)
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
        if proc.returncode == 0 or f"port: {port}, useIpv6: false, code: -98, name: EADDRINUSE" not in proc.stderr:
            break
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
    envs = [{**env, **world, "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0"} for r in range(nproc)]
    return _together(cmd, envs, cwd=cwd, timeout=timeout)


def python(
    *args: str, timeout: float = 600, env: dict[str, str] | None = None, cwd: str | Path = REPO
) -> subprocess.CompletedProcess[str]:
    """Run `python args...` (world size 1, no torchrun), from the repo root unless `cwd`."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return _together([sys.executable, *args], [full_env], cwd=cwd, timeout=timeout)


def _together(
    cmd: list[str], envs: list[dict[str, str]], *, cwd: str | Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """`cmd` once per environment, all at once; the others killed as soon as one fails. stdout and stderr are theirs in
    order; the exit status is the first that is not 0 (a killed one's is negative, as subprocess gives it)."""
    with contextlib.ExitStack() as files:
        # Files, not pipes: a process writing into a full pipe nobody reads yet would stall.
        outs = [
            (files.enter_context(tempfile.TemporaryFile("w+")), files.enter_context(tempfile.TemporaryFile("w+")))
            for _ in envs
        ]
        procs = [
            start(cmd, env=env, cwd=cwd, stdout=out, stderr=err) for env, (out, err) in zip(envs, outs, strict=True)
        ]
        deadline, timed_out = time.monotonic() + timeout, False
        try:
            while any(p.poll() is None for p in procs) and not any(p.returncode not in (None, 0) for p in procs):
                if timed_out := time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout)
        for f in (f for pair in outs for f in pair):
            f.seek(0)
        stdout = "".join(out.read() for out, _ in outs)
        stderr = "".join(err.read() for _, err in outs)
    failed = [p.returncode for p in procs if p.returncode != 0]
    returncode = (failed[0] if len(procs) == 1 else 1) if failed else 0  # torchrun's is 1 when a rank failed
    return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


# ------------------------------------------------------------ warm starts

# A new interpreter for every launch, as users start them (tests/forkserver.py is not used): TESTS_FRESH_PROCESSES=1.
FRESH = os.environ.get("TESTS_FRESH_PROCESSES") == "1"
# Variables read when Python, OpenMP, BLAS, torch, dynamo or inductor load, which a fork cannot change: one server per
# value of these. (A server also answers an environment that differs in any other variable its imports read with
# Stale, and a new interpreter runs that launch.)
AT_IMPORT = (
    "PYTHON",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH_",
    "TORCHINDUCTOR_",
    "TORCHDYNAMO_",
    "INDUCTOR_",
    "CXX",
    "PYTORCH_",
    "CUDA_",
    "LD_",
    "MALLOC_",
    "TMPDIR",
    "HOME",
)


def start(
    cmd: list[str], *, env: dict[str, str], cwd: str | Path, stdout: IO[str], stderr: IO[str]
) -> subprocess.Popen[str] | Forked:
    """`cmd` started as a new interpreter: forked from a warm server (tests/forkserver.py) when it is `python SCRIPT.py
    ...` or `python -m MODULE ...`, a new process otherwise."""
    args = cmd[1:]
    warm = (
        not FRESH
        and sys.platform == "linux"
        and cmd[0] == sys.executable
        and bool(args)
        and (args[0] == "-m" or args[0].endswith(".py"))
    )
    if not warm:
        return subprocess.Popen(
            cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=True
        )
    try:
        return Forked(_SERVERS.address(env), args, cwd=cwd, env=env, stdout=stdout, stderr=stderr)
    except Stale:  # the server's imports read a variable this environment sets otherwise
        return subprocess.Popen(
            cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=True
        )


class Stale(Exception):
    """A fork server's answer to an environment its imports would have read differently: start a new interpreter."""


class Forked:
    """What `_together` uses of subprocess.Popen, for a child of a fork server: poll, wait, kill, pid, returncode."""

    def __init__(
        self, server: str, args: list[str], *, cwd: str | Path, env: dict[str, str], stdout: IO[str], stderr: IO[str]
    ):
        self.args = args
        self.returncode: int | None = None
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._conn.connect(server)
        request = json.dumps({"argv": args, "cwd": str(cwd), "env": env}).encode()
        with open(os.devnull) as stdin:
            socket.send_fds(self._conn, [request], [stdin.fileno(), stdout.fileno(), stderr.fileno()])
        answer = self._conn.recv(64).decode()
        if answer.startswith("stale "):
            self._conn.close()
            raise Stale(answer.split(" ", 1)[1])
        self.pid = int(answer)

    def _finish(self) -> None:
        status = self._conn.recv(64)
        self._conn.close()
        if not status:
            raise RuntimeError(f"the fork server of {self.args} exited before its child {self.pid}")
        self.returncode = int(status)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._finish()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class _Servers:
    """The fork servers of this test session, started when first asked for: one per value of the AT_IMPORT variables
    and per LOCAL_RANK (the ranks of one launch then hash strings with different seeds, as new processes do)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: dict[tuple, tuple[subprocess.Popen[bytes], str]] = {}
        self._folder: str | None = None

    def address(self, env: dict[str, str]) -> str:
        # PYTHONPATH is read again by the child (a copy of the repository is served by the same server).
        at_import = sorted((k, v) for k, v in env.items() if k.startswith(AT_IMPORT) and k != "PYTHONPATH")
        key = (tuple(at_import), env.get("LOCAL_RANK", "0"))
        with self._lock:
            if self._folder is None:
                self._folder = tempfile.mkdtemp(prefix="forkserver-")
                atexit.register(self.close)
            if key not in self._started:
                path = f"{self._folder}/{len(self._started)}"
                with open(path + ".log", "wb") as log:
                    server = [sys.executable, str(REPO / "tests" / "forkserver.py"), path + ".sock"]
                    proc = subprocess.Popen(
                        server, cwd=self._folder, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
                    )
                self._started[key] = (proc, path)
            proc, path = self._started[key]
        deadline = time.monotonic() + 300
        while not os.path.exists(path + ".sock"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not start:\n{Path(path + '.log').read_text()[-3000:]}")
            time.sleep(0.02)
        return path + ".sock"

    def close(self) -> None:
        for proc, _ in self._started.values():
            proc.kill()
            proc.wait()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)


_SERVERS = _Servers()


def two_at_a_time(*launches: Callable[[], T]) -> list[T]:
    """Independent launches side by side, their results in the order given: a launch spends its first seconds
    importing torch in one process (train.py of one rank, torchrun's launcher), on one of the machine's two cores."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda launch: launch(), launches))
