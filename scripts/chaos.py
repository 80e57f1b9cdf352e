"""Kill a training job inside a checkpoint save, run the same command again, and check that nothing was lost.

    python scripts/chaos.py --trials 20 --seed 1            # 2 CPU ranks (gloo) under torchrun, the debug model

Each trial draws, from its seed, a save mode (checkpoint.async_mode "disabled" or "async"; checksums are always
recorded), a save (its step), a moment inside it (a pause point of fleet/faults.py: `start`, `write`, `metadata`,
`manifest`, `publish`, `prune`) and a victim (one rank, or the whole job: every rank and torchrun at once). It starts
the job with CHECKPOINT_PAUSE_AT holding one rank still at that moment for --pause seconds, sends SIGKILL to the
victim as soon as that rank says it is there (the other ranks are wherever the save has taken them; a surviving
rank is stopped by torchrun, as after any rank's death), then runs the same command again and checks:

- the rerun resumed from the newest complete step that the kill left (a step folder, or a `.partial` one, whose
  `.metadata` is there and whose every file matches `checksums.json`, read here before the rerun), never from
  a half-written one, and never from an older one;
- its last loss is the straight run's (one run per mode, never killed) to the last bit;
- metrics.jsonl holds each step once, and the checkpoint folder nothing but complete steps: no `.partial`, no
  half-pruned folder.

One row per trial (its seed reruns it alone: `--trials 1 --seed <seed>`); the exit status is 1 when a trial failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python scripts/chaos.py` from anywhere

from checkpoint.checksums import file_digest, read_manifest  # noqa: E402
from fleet.faults import PAUSE_AT, POINTS, RANK0_POINTS  # noqa: E402

PAUSED = re.compile(rf"^{PAUSE_AT}: rank (\d+) \(pid (\d+)\) paused at (\w+) of step (\d+)", re.M)
MODES = {"sync": "disabled", "async": "async"}  # the trial's name -> checkpoint.async_mode


@dataclass(frozen=True)
class Setup:
    """What every trial trains: the debug model at tiny sizes, a save every `interval` steps, `keep` of them kept."""

    ranks: int = 2
    steps: int = 8
    interval: int = 2
    keep: int = 1
    pause: float = 3.0  # seconds the chosen rank holds still at the moment (the kill lands within milliseconds)

    def args(self, mode: str, dump: Path) -> list[str]:
        return [
            "--config", "configs/debug.toml", "--training.seq_len=64", "--training.local_batch_size=2",
            "--metrics.log_freq=1", "--lr_scheduler.warmup_steps=5", "--validation.enable=false", "--eval.enable=false",
            f"--training.steps={self.steps}", "--checkpoint.enable", f"--checkpoint.interval={self.interval}",
            f"--checkpoint.keep_latest_k={self.keep}", f"--checkpoint.async_mode={MODES[mode]}",
            f"--job.dump_folder={dump}",
        ]  # fmt: skip

    def saves(self) -> list[int]:
        return sorted({*range(self.interval, self.steps + 1, self.interval), self.steps})


@dataclass(frozen=True)
class Trial:
    """One kill: drawn from `seed` alone (`draw`), so a seed names the same trial on every machine."""

    seed: int
    mode: str  # "sync" or "async"
    step: int  # the save the kill is aimed into
    moment: str  # a pause point of fleet/faults.py
    paused: int  # the rank held still at the moment
    victim: int | None  # the rank killed; None: the whole job

    @property
    def victim_name(self) -> str:
        return "job" if self.victim is None else f"rank {self.victim}"

    def pause_at(self, seconds: float) -> str:
        return f"{self.moment},step={self.step},rank={self.paused},seconds={seconds:g}"


def draw(seed: int, setup: Setup) -> Trial:
    """The trial of `seed`: mode, save, moment and victim uniform; the rank held still is the victim where the
    moment is one that rank passes, else rank 0 (the only one at rank 0's moments), or any rank for the whole job."""
    rng = random.Random(seed)
    mode = rng.choice(sorted(MODES))
    moment = rng.choice(POINTS)
    saves = setup.saves()
    step = rng.choice(saves[setup.keep :] if moment == "prune" else saves)  # the first `keep` saves prune nothing
    victim = rng.choice([*range(setup.ranks), None])
    if moment in RANK0_POINTS:
        paused = 0
    else:
        paused = victim if victim is not None else rng.randrange(setup.ranks)
    return Trial(seed, mode, step, moment, paused, victim)


# ------------------------------------------------------------------------------------------------------ the job


class Job(Protocol):
    """A started training job: its ranks' processes, and every process of it killed at once."""

    log: Path  # where its ranks' stdout and stderr go

    def ranks(self) -> dict[int, int]:
        """rank -> pid, of the ranks still running."""
        ...

    def kill(self) -> None:
        """SIGKILL to every process of the job at once (the launcher and every rank), as a node's death."""
        ...

    def wait(self, timeout: float) -> int | None:
        """The job's exit status once it ended, None when it had not within `timeout` seconds."""
        ...


Launch = Callable[[list[str], dict[str, str], Path], Job]  # (train.py's args, environment, log) -> a started job


class Torchrun:
    """`torchrun --standalone --nproc_per_node=N train.py ARGS`, as a user starts it; torchrun stops the other
    ranks when one dies (SIGTERM, then SIGKILL after its shutdown timeout) and exits 1."""

    def __init__(self, ranks: int):
        self.nproc = ranks

    def __call__(self, args: list[str], env: dict[str, str], log: Path) -> Job:
        return _TorchrunJob(self.nproc, args, env, log)


class _TorchrunJob:
    def __init__(self, nproc: int, args: list[str], env: dict[str, str], log: Path):
        self.log = log
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [*cmd, "train.py", *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )

    def ranks(self) -> dict[int, int]:
        found = {}
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if (
                    entry.name.isdigit()
                    and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == self.proc.pid
                ):
                    variables = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
                    found[int(variables["RANK"])] = int(entry.name)
        return found

    def kill(self) -> None:
        for pid in [*self.ranks().values(), self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


# ------------------------------------------------------------------------------------------------------ a trial


@dataclass
class Outcome:
    """What a trial found: the step resumed from and the one expected, the last loss, and what went wrong."""

    trial: Trial
    resumed: int | None = None  # the step the rerun continued from (0: from scratch)
    expected: int | None = None  # the newest complete step the kill left
    loss: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def run_trial(trial: Trial, setup: Setup, work: Path, *, straight: float, launch: Launch) -> Outcome:
    """Kill the job at the trial's moment, read what it left, rerun it; `straight`: the last loss of a run of the
    same mode never killed."""
    dump = work / f"trial-{trial.seed}"
    args = setup.args(trial.mode, dump)
    outcome = Outcome(trial)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), PAUSE_AT: trial.pause_at(setup.pause)}
    job = launch(args, env, work / f"trial-{trial.seed}.killed.log")
    if (problem := kill_at_pause(job, trial)) is not None:
        outcome.problems.append(problem)
        return outcome
    outcome.expected = newest_complete(dump / "checkpoint")
    if outcome.expected != (aimed := aimed_at(trial, setup)):
        outcome.problems.append(f"the kill left step {outcome.expected} the newest complete, not step {aimed}")
    env.pop(PAUSE_AT)
    rerun = launch(args, env, work / f"trial-{trial.seed}.rerun.log")
    if (code := rerun.wait(600)) != 0:
        rerun.kill()
        outcome.problems.append(f"the rerun exited {code} (see {rerun.log})")
        return outcome
    outcome.resumed = resumed_from(rerun.log.read_text(), steps=setup.steps)
    if outcome.resumed != outcome.expected:
        outcome.problems.append(f"resumed from step {outcome.resumed}, the newest complete was {outcome.expected}")
    losses = logged_losses(dump / "metrics.jsonl")
    if sorted(losses) != list(range(1, setup.steps + 1)) or any(len(v) != 1 for v in losses.values()):
        outcome.problems.append(f"metrics.jsonl holds steps {[s for s, v in sorted(losses.items()) for _ in v]}")
    outcome.loss = losses.get(setup.steps, [None])[-1]
    if outcome.loss != straight:
        outcome.problems.append(f"last loss {outcome.loss!r}, the straight run's {straight!r}")
    if extra := leftovers(dump / "checkpoint"):
        outcome.problems.append(f"left in the checkpoint folder: {', '.join(extra)}")
    return outcome


def kill_at_pause(job: Job, trial: Trial, *, timeout: float = 600) -> str | None:
    """SIGKILL to the trial's victim once the paused rank says it is at the moment; then wait for the job to end.
    None, or what went wrong."""
    deadline = time.monotonic() + timeout
    while not (said := PAUSED.search(job.log.read_text(errors="replace"))):
        if (code := job.wait(0.02)) is not None:
            return f"the job exited {code} before rank {trial.paused} reached {trial.moment} of step {trial.step}"
        if time.monotonic() > deadline:
            job.kill()
            return f"rank {trial.paused} did not reach {trial.moment} of step {trial.step} in {timeout:.0f} s"
    if trial.victim is None:
        job.kill()
    else:
        pid = int(said.group(2)) if trial.victim == trial.paused else job.ranks().get(trial.victim)
        if pid is None:
            job.kill()
            return f"rank {trial.victim} had ended before the kill"
        os.kill(pid, signal.SIGKILL)
    if job.wait(timeout) is None:  # torchrun stops the other ranks: SIGTERM, then SIGKILL after 30 s
        job.kill()
        return f"the job did not end within {timeout:.0f} s of the kill"
    return None


def aimed_at(trial: Trial, setup: Setup) -> int:
    """The step a kill at the trial's moment must leave the newest complete (docs/faults.md's table): the save
    before, until `.metadata` is there; at `metadata` and `manifest` this save when the victim is another rank
    than rank 0 (rank 0, DCP's coordinator, has every rank's files and goes on to write `.metadata`)."""
    before = max([0, *(s for s in setup.saves() if s < trial.step)])
    if trial.moment in ("start", "write"):
        return before
    if trial.moment in ("metadata", "manifest"):
        return before if trial.victim in (None, trial.paused) else trial.step
    return trial.step


def complete(step: Path) -> bool:
    """Whether a step folder is a whole checkpoint: `.metadata` there, and every file of the save with the size and
    hash its `checksums.json` records. Read from the files alone, not by the code under test's verify."""
    if not (step / ".metadata").is_file():
        return False
    try:
        files = read_manifest(step)
    except ValueError:
        return False
    return bool(files) and all(
        (step / name).is_file() and file_digest(step / name) == (f["size"], f["hash"]) for name, f in files.items()
    )


def newest_complete(folder: Path) -> int:
    """The newest step in `folder`, published or `.partial` (published at the next start), that is `complete`; 0
    when none is."""
    steps = [0]
    for child in folder.iterdir() if folder.is_dir() else ():
        if (match := re.fullmatch(r"step-(\d+)(\.partial)?", child.name)) and complete(child):
            steps.append(int(match.group(1)))
    return max(steps)


def resumed_from(output: str, *, steps: int) -> int:
    """The step a rerun continued from, read from what it printed; 0: it started from scratch."""
    if match := re.search(r"^\[checkpoint\] resumed from \S*step-(\d+)$", output, re.M):
        return int(match.group(1))
    if re.search(rf"^step {steps} is saved in .*: nothing to train", output, re.M):
        return steps
    return 0


def logged_losses(jsonl: Path) -> dict[int, list[float]]:
    """step -> every training loss metrics.jsonl holds for it (one, when nothing was logged twice)."""
    losses: dict[int, list[float]] = {}
    for row in (json.loads(line) for line in jsonl.read_text().splitlines()):
        if "loss" in row:
            losses.setdefault(row["step"], []).append(row["loss"])
    return losses


def leftovers(folder: Path) -> list[str]:
    """What the checkpoint folder holds beside complete step folders and the run's config.toml."""
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.name != "config.toml" and not (re.fullmatch(r"step-\d+", p.name) and complete(p))
    )


# -------------------------------------------------------------------------------------------------- the trials


def straight_run(mode: str, setup: Setup, work: Path, *, launch: Launch) -> float:
    """The last loss of a run of `mode` that nothing kills: what every trial of that mode must end on."""
    dump = work / f"straight-{mode}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop(PAUSE_AT, None)
    job = launch(setup.args(mode, dump), env, work / f"straight-{mode}.log")
    if (code := job.wait(600)) != 0:
        job.kill()
        raise SystemExit(f"error: the straight {mode} run exited {code}; see {job.log}")
    return logged_losses(dump / "metrics.jsonl")[setup.steps][-1]


def run_trials(
    seeds: list[int], setup: Setup, work: Path, *, launch: Launch, out: Callable[[str], None] = print
) -> list[Outcome]:
    """One trial per seed, the straight runs first (one per mode the trials draw); a row of the table per trial
    as it ends, through `out`."""
    trials = [draw(seed, setup) for seed in seeds]
    straight = {mode: straight_run(mode, setup, work, launch=launch) for mode in sorted({t.mode for t in trials})}
    out(HEADER)
    outcomes = []
    for number, trial in enumerate(trials, start=1):
        outcome = run_trial(trial, setup, work, straight=straight[trial.mode], launch=launch)
        out(row(number, outcome, straight[trial.mode]))
        outcomes.append(outcome)
    return outcomes


HEADER = f"{'trial':>5}  {'seed':>6}  {'mode':5}  {'victim':6}  {'moment':28}  {'resumed':>7}  {'last loss vs straight':25}  ok"


def row(number: int, outcome: Outcome, straight: float) -> str:
    t = outcome.trial
    moment = f"{t.moment} of step {t.step} (rank {t.paused})"
    resumed = "-" if outcome.resumed is None else str(outcome.resumed)
    if outcome.loss is None:
        loss = "-"
    else:
        loss = f"{outcome.loss:.6f} {'=' if outcome.loss == straight else '!='} {straight:.6f}"
    verdict = "ok" if outcome.ok else "FAILED: " + "; ".join(outcome.problems or [])
    return f"{number:>5}  {t.seed:>6}  {t.mode:5}  {t.victim_name:6}  {moment:28}  {resumed:>7}  {loss:25}  {verdict}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=20, help="how many trials (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="trial k draws from seed + k (default 0)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the job (default 2)")
    parser.add_argument("--steps", type=int, default=Setup.steps, help=f"training.steps (default {Setup.steps})")
    parser.add_argument(
        "--interval", type=int, default=Setup.interval, help=f"checkpoint.interval (default {Setup.interval})"
    )
    parser.add_argument("--keep", type=int, default=Setup.keep, help=f"checkpoint.keep_latest_k (default {Setup.keep})")
    parser.add_argument(
        "--pause",
        type=float,
        default=Setup.pause,
        help=f"seconds a rank holds still at the moment (default {Setup.pause:g})",
    )
    parser.add_argument("--work", help="folder for the runs and their logs (default: a new temporary folder)")
    a = parser.parse_args(argv)
    if a.trials < 1 or a.ranks < 2 or a.steps < a.interval or a.keep < 1:
        parser.error("--trials >= 1, --ranks >= 2, --steps >= --interval and --keep >= 1")
    setup = Setup(ranks=a.ranks, steps=a.steps, interval=a.interval, keep=a.keep, pause=a.pause)
    work = Path(a.work or tempfile.mkdtemp(prefix="chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"{a.trials} trials, {a.ranks} ranks, {a.steps} steps, a save every {a.interval}, the newest {a.keep} kept; runs and logs in {work}",
        flush=True,
    )
    begin = time.perf_counter()
    outcomes = run_trials(
        [a.seed + k for k in range(a.trials)],
        setup,
        work,
        launch=Torchrun(a.ranks),
        out=lambda line: print(line, flush=True),
    )
    good = sum(o.ok for o in outcomes)
    print(
        f"{good} of {len(outcomes)} trials resumed from the newest complete step and ended on the straight run's loss, nothing lost ({time.perf_counter() - begin:.0f} s)"
    )
    return 0 if good == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
