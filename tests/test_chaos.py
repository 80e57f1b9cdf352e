"""Kills inside a checkpoint save (scripts/chaos.py): a few trials, sync and async, one rank and the whole job, each
checked as the script checks it; the checks and the pause points themselves; and a step saved twice, replaced
without a moment where neither copy is whole.

The script launches torchrun; here the ranks are forked from warm interpreters (tests/launch.py) and stopped as
torchrun stops them when one dies (SIGTERM to the others, SIGKILL after a grace period): a torchrun start costs
seconds of these two cores that the suite cannot spare.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoint import CheckpointManager
from checkpoint.checksums import MANIFEST, file_digest, write_manifest
from checkpoint.folder import recover_partial_checkpoints
from config import Checkpoint
from fleet.faults import FLEET_FAULT, PAUSE_AT, POINTS, RANK0_POINTS
from scripts.chaos import (
    Setup,
    Trial,
    aimed_at,
    complete,
    draw,
    leftovers,
    newest_complete,
    row,
    run_trial,
    straight_run,
)
from tests.launch import REPO, free_port, python, start
from tests.parity_worker import build_tiny

GRACE = 5.0  # seconds between the SIGTERM to the ranks left and their SIGKILL (torchrun's --shutdown-timeout)


class ForkedJob:
    """The ranks of one job, forked (tests/launch.py `start`), their output in one log; scripts/chaos.py's Job."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path, *, nproc: int = 2):
        self.log = log
        port = str(free_port())
        world = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
        }
        with open(log, "a") as out:
            self.procs = [
                start(
                    [sys.executable, "train.py", *args],
                    env={**env, **world, "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0"},
                    cwd=REPO,
                    stdout=out,
                    stderr=out,
                )
                for r in range(nproc)
            ]
        self.terminated: float | None = None  # when the ranks left were sent SIGTERM

    def ranks(self) -> dict[int, int]:
        return {r: p.pid for r, p in enumerate(self.procs) if p.poll() is None}

    def kill(self) -> None:
        for p in self.procs:
            p.kill()

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in self.procs]
            if None not in codes:
                return 0 if not any(codes) else 1
            if any(code not in (None, 0) for code in codes):  # one died: torchrun stops the others
                if self.terminated is None:
                    self.terminated = time.monotonic()
                    for p in self.procs:
                        if p.poll() is None:
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(p.pid, signal.SIGTERM)
                elif time.monotonic() > self.terminated + GRACE:
                    self.kill()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)


def forked(args: list[str], env: dict[str, str], log: Path) -> ForkedJob:
    return ForkedJob(args, env, log)


SETUP = Setup(ranks=2, steps=6, interval=2, keep=1, pause=3.0)
# (seed, mode, step, moment, paused rank, victim; None: the whole job), and the step each must resume from.
TRIALS = [
    (Trial(101, "sync", 4, "write", 1, 1), 2),  # rank 1's shard half written: step 4 incomplete
    (Trial(102, "async", 4, "publish", 0, None), 4),  # complete, not yet renamed: published at the next start
    (Trial(103, "async", 4, "prune", 0, 0), 4),  # step 2 renamed step-2.pruned, not yet deleted
]


def test_kills_inside_a_save_resume_from_the_newest_complete_step_and_lose_nothing(tmp_path: Path) -> None:
    straight = straight_run("sync", SETUP, tmp_path, launch=forked)
    table = []
    for trial, expected in TRIALS:
        outcome = run_trial(trial, SETUP, tmp_path, straight=straight, launch=forked)
        table.append(row(len(table) + 1, outcome, straight))
        assert outcome.expected == expected, "\n".join(table)  # the kill landed where it was aimed
    assert all(line.endswith("  ok") for line in table), "\n".join(table)  # async trains as sync: one straight run
    killed = (tmp_path / "trial-103.killed.log").read_text()
    assert "paused at prune of step 4" in killed
    rerun = (tmp_path / "trial-103.rerun.log").read_text()
    assert f"removed {tmp_path / 'trial-103' / 'checkpoint' / 'step-2.pruned'}" in rerun


def test_the_checks_fail_on_what_they_look_for(tmp_path: Path) -> None:
    """The folder checks of a trial see a half-written step: a missing shard, a changed byte, no manifest."""
    folder = tmp_path / "checkpoint"
    step = folder / "step-2"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"weights")
    assert not complete(step) and newest_complete(folder) == 0 and leftovers(folder) == ["step-2"]
    size, digest = file_digest(step / "__0_0.distcp")
    write_manifest(step, {"__0_0.distcp": {"size": size, "hash": digest}, ".metadata": {"size": 1, "hash": "0"}})
    (step / ".metadata").write_bytes(b"m")
    assert not complete(step)  # .metadata's hash differs
    size, digest = file_digest(step / ".metadata")
    write_manifest(
        step,
        {
            "__0_0.distcp": {"size": 7, "hash": file_digest(step / "__0_0.distcp")[1]},
            ".metadata": {"size": size, "hash": digest},
        },
    )
    assert complete(step) and newest_complete(folder) == 2 and leftovers(folder) == []
    (step / "__0_0.distcp").write_bytes(b"weighTs")
    assert not complete(step)
    (folder / "step-4.partial").mkdir()
    assert leftovers(folder) == ["step-2", "step-4.partial"]


def test_trials_are_drawn_from_their_seed_alone() -> None:
    setup = Setup()
    drawn = [draw(seed, setup) for seed in range(200)]
    assert drawn == [draw(seed, setup) for seed in range(200)]
    assert {t.mode for t in drawn} == {"sync", "async"} and {t.moment for t in drawn} == set(POINTS)
    assert {t.victim for t in drawn} == {0, 1, None}
    for t in drawn:
        assert t.step in setup.saves() and (t.moment != "prune" or t.step > setup.interval)
        if t.moment in RANK0_POINTS:
            assert t.paused == 0
        elif t.victim is not None:
            assert t.paused == t.victim  # the rank killed is the one held still at its moment


def test_a_kill_is_aimed_before_or_after_the_step_is_complete_as_docs_faults_md_says() -> None:
    """Until `.metadata` is there the save before is the newest complete; from `metadata` on, a kill of another rank
    than rank 0 leaves rank 0 to finish it; from `publish` on it is complete whoever dies."""
    setup = Setup()
    assert aimed_at(Trial(1, "sync", 2, "start", 0, None), setup) == 0
    assert aimed_at(Trial(1, "async", 4, "write", 1, 1), setup) == 2
    assert aimed_at(Trial(1, "sync", 8, "metadata", 0, 0), setup) == 6
    assert aimed_at(Trial(1, "sync", 8, "manifest", 0, None), setup) == 6
    assert aimed_at(Trial(1, "sync", 8, "manifest", 0, 1), setup) == 8
    assert aimed_at(Trial(1, "async", 4, "publish", 0, None), setup) == 4
    assert aimed_at(Trial(1, "sync", 6, "prune", 0, 1), setup) == 6


def test_a_pause_point_holds_only_where_and_when_it_is_named(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import time\nfrom fleet import pause_points\nat = pause_points()\nt = time.monotonic()\n"
        "for point, step in [('write', 3), ('write', 4), ('write', 4), ('start', 4)]:\n    at and at(point, step)\n"
        "print(round(time.monotonic() - t, 1))\n"
    )

    def run(spec: str, rank: int) -> subprocess.CompletedProcess[str]:
        return python(str(probe), env={PAUSE_AT: spec, "RANK": str(rank), "OMP_NUM_THREADS": "1"})

    paused = run("write,step=4,rank=1,seconds=0.5", 1)
    assert paused.stdout.strip() == "0.5"  # once, at step 4's write
    assert (
        paused.stderr.startswith(f"{PAUSE_AT}: rank 1 (pid ") and "paused at write of step 4 for 0.5 s" in paused.stderr
    )
    other = run("write,step=4,rank=1,seconds=0.5", 0)
    assert other.stdout.strip() == "0.0" and other.stderr == ""
    typo = run("writes,step=4", 0)
    assert (
        typo.returncode == 1
        and "ValueError: CHECKPOINT_PAUSE_AT='writes,step=4': expected one of start, write" in typo.stderr
    )
    # Unset, neither fault variable costs an import: train.py's hooks are None, fleet/faults.py never loaded. Set
    # (to another rank's faults: still None), each loads it.
    probe.write_text(
        "import sys, train\nfrom fleet import pause_points, step_faults\n"
        "print(pause_points(), step_faults(0), 'fleet.faults' in sys.modules)\n"
    )
    unset = python(str(probe), env={"OMP_NUM_THREADS": "1"})
    assert unset.stdout.strip() == "None None False", unset
    for variable, spec in ((FLEET_FAULT, "spin,rank=1,step=1"), (PAUSE_AT, "start,rank=1")):
        named = python(str(probe), env={"OMP_NUM_THREADS": "1", variable: spec})
        assert named.stdout.strip() == "None None True", (variable, named)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_save_calls_its_hook_at_each_point_in_order(tmp_path: Path) -> None:
    """CheckpointManager's on_point, the hook fleet/faults.py's pause is: each point of a save, with its step, in the
    order docs/faults.md gives (one process: it is rank 0 and DCP's coordinator; `write` at each file's first bytes)."""
    seen: list[tuple[str, int]] = []
    cfg = Checkpoint(enable=True, keep_latest_k=1)
    manager = CheckpointManager(
        cfg, dump_folder=str(tmp_path), model=build_tiny(), optimizer=None, stateful={},
        on_point=lambda point, step: seen.append((point, step)),
    )  # fmt: skip
    manager.save(1)
    manager.save(2)  # prunes step 1
    points = [point for point, _ in seen if point != "write"]
    assert points == [p for p in POINTS if p not in ("write", "prune")] + [p for p in POINTS if p != "write"], seen
    assert ("write", 1) in seen and ("write", 2) in seen and seen[-1] == ("prune", 2)
    assert [step for _, step in seen] == sorted(step for _, step in seen)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_step_saved_again_is_replaced_and_a_kill_between_leaves_the_new_one(tmp_path: Path) -> None:
    """A step saved a second time (a run resumed from an earlier checkpoint.load_step) sets the old folder aside as
    `.pruned` before the new one takes its name: a kill in between leaves the new save complete under `.partial`,
    which start-up publishes, and the old one, which it deletes; never a half-deleted step under the step's name."""
    model = build_tiny()
    manager = CheckpointManager(
        Checkpoint(enable=True), dump_folder=str(tmp_path), model=model, optimizer=None, stateful={}
    )
    folder = tmp_path / "checkpoint"
    manager.save(2)
    first = (folder / "step-2" / MANIFEST).read_text()
    with torch.no_grad():
        model.norm.weight.fill_(2.0)
    manager.save(2)
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]
    assert (folder / "step-2" / MANIFEST).read_text() != first and complete(folder / "step-2")
    # What a kill between the two renames leaves: the old step set aside, the new one complete, unpublished.
    os.replace(folder / "step-2", folder / "step-2.partial")
    (folder / "step-2.pruned").mkdir()
    (folder / "step-2.pruned" / "__0_0.distcp").write_bytes(b"old")
    recover_partial_checkpoints(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]
    assert (folder / "step-2" / MANIFEST).read_text() != first and complete(folder / "step-2")
