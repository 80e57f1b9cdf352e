"""What the benchmarks share: how each one runs as a command, starts processes and reports; the progress lines of a
run of several (`make bench`, `make bench-gpu`).

Every benchmark module `benchmarks/<name>.py` has two entry points:

    main(argv)       `python -m benchmarks.<name> [--out X.json] [options]` (through `harness.main`):
                     measures, prints its own table, writes {"benchmark", "torch", "results"} to X.json.
    rows(results)    what `make bench` (benchmarks/run.py) shows of those results: `Row`s, the
                     problem's headline metric first (it is the one charted).

benchmarks/ is a leaf: nothing outside it imports it, and the test suite passes without it. Its
own tests (benchmarks/test_*.py) start benchmarks with `run_python` below, which they point at the test suite's
forked launches (`LAUNCH`, benchmarks/conftest.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from config import REPO
from errors import is_rank0

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of `make bench`: a metric measured on a broken setup and on its fix."""

    problem: str  # e.g. "#1 nested AC": docs/failures.md #1
    metric: str
    unit: str  # "" for a dimensionless number
    broken: str  # the setup, as a short label
    broken_value: float
    fixed: str
    fixed_value: float
    # What the two bars alone would mislead about, said under the problem's panel (its lines kept) and the table: a
    # fix that buys correctness and costs time on this device, with another kernel on another.
    note: str = ""

    @property
    def ratio(self) -> float:
        """fixed / broken; nan when broken is 0."""
        return self.fixed_value / self.broken_value if self.broken_value else float("nan")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"ratio": self.ratio}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Row:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})  # older: no note


# ------------------------------------------------------------------ one benchmark's command line


def main(
    name: str,
    argv: list[str] | None,
    *,
    doc: str,
    add_args: Callable[[argparse.ArgumentParser], None],
    measure: Callable[[argparse.Namespace], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
    world: int | None = None,
) -> int:
    """`python -m benchmarks.<name>`: parse `--out` and `add_args`' options, `measure`, print `table`, write the JSON.

    world: a multi-process benchmark, by default of `world` ranks. Started without torchrun it starts
    itself under torchrun with `--world` ranks and returns torchrun's exit status; under torchrun
    every rank runs `measure` (which opens `process_group()`) and rank 0 prints and writes.
    """
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / f"{name}.json", help="JSON result")
    if world is not None:
        # Not "--nproc": torchrun would take it for a prefix of its own --nproc-per-node when relaunching.
        parser.add_argument("--world", type=int, default=world, help="ranks to start when not under torchrun")
    add_args(parser)
    args = parser.parse_args(argv)
    if world is not None and "RANK" not in os.environ:
        return run_python("-m", f"benchmarks.{name}", *argv, nproc=args.world).returncode

    results = measure(args)
    if is_rank0():
        print(table(results), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"benchmark": name, "torch": torch.__version__, "results": results}
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.out}", flush=True)
    return 0


def read_results(path: Path) -> dict[str, Any]:
    """The `results` a benchmark wrote to `path` (what its `rows` reads)."""
    return json.loads(path.read_text())["results"]


@contextlib.contextmanager
def process_group() -> Iterator[torch.device]:
    """The process group of a torchrun launch: NCCL on this rank's GPU where there is one, else gloo on CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        yield device
        # Leave together: a rank tearing gloo down while its peer is still in it was seen to
        # abort ("terminate called without an active exception") under load.
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ processes


def repo_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment, plus the repo on PYTHONPATH and one OMP thread per process unless set."""
    env = {"OMP_NUM_THREADS": "1", **os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _command(args: tuple[str, ...], nproc: int | None) -> list[str]:
    # --standalone: a rendezvous on a free local port, so that concurrent launches do not collide.
    launcher = [] if nproc is None else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [sys.executable, *launcher, *args]


def run_python(
    *args: str,
    nproc: int | None = None,
    capture: bool = False,
    log: Path | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO,
) -> subprocess.CompletedProcess[str]:
    """`python args...` from the repo root (or `cwd`), or `torchrun --nproc_per_node=nproc args...` when nproc
    is given.

    capture: keep stdout and stderr (text) instead of passing them through. log: append them, together, to this
    file instead (the processes it starts in turn write there too). env: added to `repo_env()`.
    """
    if LAUNCH is not None:
        proc = LAUNCH(
            args, nproc=nproc, capture=capture or log is not None, timeout=timeout, env=repo_env(env), cwd=cwd
        )
        if log is not None:
            with open(log, "a") as f:
                f.write(proc.stdout + proc.stderr)
        return proc
    if log is None:
        return subprocess.run(
            _command(args, nproc), cwd=cwd, env=repo_env(env), text=True, capture_output=capture, timeout=timeout
        )
    with open(log, "a") as f:
        return subprocess.run(
            _command(args, nproc), cwd=cwd, env=repo_env(env), text=True, stdout=f, stderr=subprocess.STDOUT,
            timeout=timeout,
        )  # fmt: skip


class Launch(Protocol):
    def __call__(
        self, args: tuple[str, ...], *, nproc: int | None, capture: bool, timeout: float | None, env: dict[str, str],
        cwd: Path,
    ) -> subprocess.CompletedProcess[str]: ...  # fmt: skip


# What starts `run_python`'s processes instead of a new interpreter (under torchrun's launcher with nproc): None in
# `make bench`; the benchmarks' tests fork them as the test suite does (benchmarks/conftest.py).
LAUNCH: Launch | None = None


def start_python(*args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """`python args...` from the repo root in the background, stdout and stderr captured (text)."""
    return subprocess.Popen(
        _command(args, None), cwd=REPO, env=repo_env(env), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


# ------------------------------------------------------------------------------ progress


def clock(seconds: float) -> str:
    """3m12s."""
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s:02d}s"


class Progress:
    """The progress lines of a run of parts, each part a benchmark of minutes: `part 2/5 NAME: TEXT`.

    `start` says that a part starts, the time elapsed and an estimate of the rest: the expected seconds of the
    parts not yet finished, scaled by how the run is going (the seconds the finished parts took over the seconds
    they were expected to take: a busy machine slows every part alike). `finish` records a part's seconds.
    A part skipped is neither started nor finished, and leaves the pace alone.
    """

    def __init__(self, expected: Mapping[str, float]) -> None:
        self.expected = dict(expected)  # name -> expected wall seconds, in the run's order
        self.begin = time.monotonic()
        self.started: dict[str, float] = {}  # name -> when it started
        self.took: dict[str, float] = {}  # name -> its seconds, once finished

    def elapsed(self) -> float:
        return time.monotonic() - self.begin

    def pace(self) -> float:
        """The finished parts' seconds over their expected seconds; 1 until one has finished."""
        planned = sum(self.expected[name] for name in self.took)
        return sum(self.took.values()) / planned if planned else 1.0

    def rest(self, name: str) -> float:
        """The estimated seconds of `name` and the parts after it."""
        names = list(self.expected)
        return self.pace() * sum(self.expected[n] for n in names[names.index(name) :])

    def say(self, name: str, text: str) -> None:
        print(f"part {list(self.expected).index(name) + 1}/{len(self.expected)} {name}: {text}", flush=True)

    def start(self, name: str) -> None:
        self.say(name, f"starting | elapsed {clock(self.elapsed())} | estimated rest {clock(self.rest(name))}")
        self.started[name] = time.monotonic()

    def finish(self, name: str) -> float:
        """Its seconds since `start`, counted in the pace from now on."""
        self.took[name] = time.monotonic() - self.started[name]
        return self.took[name]
