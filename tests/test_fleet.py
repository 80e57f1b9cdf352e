"""fleet/monitor.py: a slow rank named, a hang ended with every rank's stacks; the lock of a dead run taken over is in
tests/test_faults.py. The multi-process checks share one launch per world size (plus one resume): each is a whole
run that ends in a hang, with a slow window before it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from config import load_config
from errors import ConfigError
from fleet.monitor import AUTO_FLOOR_S, Peer, Watchdog, deadline, hang_line, slow_rank_line
from tests.conftest import TINY, losses
from tests.launch import torchrun

PEERS = [Peer("node-a", 0, 100), Peer("node-a", 1, 101), Peer("node-b", 0, 100), Peer("node-b", 1, 101)]


def test_the_slowest_rank_is_named_against_the_median_of_the_others() -> None:
    even = slow_rank_line([0.20, 0.21], [0.0, 0.0], peers=PEERS, threshold=0.2, steps=(4, 6))
    assert even is None
    # With 2 ranks the median of all would be 0.35: 43% behind; against the other rank it is 100%.
    line = slow_rank_line([0.2, 0.4], [0.0, 0.0], peers=PEERS, threshold=0.5, steps=(7, 9))
    assert line is not None and line.startswith("slow rank, steps 7-9: rank 1 (host node-a, local rank 1) works 400")
    assert "100% more than the other ranks' median of 200 ms" in line
    # Time reading data counts: rank 2 computes as fast as the others but waits for its storage.
    line = slow_rank_line([0.2, 0.2, 0.2, 0.2], [0.01, 0.01, 0.15, 0.01], peers=PEERS, threshold=0.2, steps=(8, 8))
    assert line is not None and "step 8: rank 2 (host node-b, local rank 0) works 350 ms" in line
    assert "reading data 150 ms of it" in line
    assert slow_rank_line([0.2, 0.2, 0.23, 0.2], [0.0] * 4, peers=PEERS, threshold=0.2, steps=(1, 2)) is None
    assert slow_rank_line([0.9], [0.0], peers=PEERS, threshold=0.2, steps=(1, 2)) is None  # one rank: no fleet


def test_the_hang_deadline_is_the_setting_or_a_multiple_of_the_median_step() -> None:
    assert deadline(30, []) == 30 and deadline(0, [1.0] * 10) is None  # a number arms from the second step on; 0: off
    assert deadline("auto", [0.5, 0.5]) is None  # not before AUTO_AFTER steps are timed
    assert deadline("auto", [0.5, 0.5, 0.6]) == AUTO_FLOOR_S
    assert deadline("auto", [20.0, 20.0, 400.0, 21.0]) == 5 * 20.5  # one long step (a recompile) moves nothing


def test_the_watchdog_fires_for_a_step_not_disarmed_in_time_only() -> None:
    fired: list[tuple[int, float]] = []
    done = threading.Event()
    watchdog = Watchdog(lambda step, seconds, main: (fired.append((step, seconds)), done.set()))
    try:
        watchdog.arm(3, 0.2)
        time.sleep(0.05)
        watchdog.disarm()  # step 3 ended in time
        watchdog.arm(4, 0.1)  # step 4 does not end
        assert done.wait(5)
        time.sleep(0.3)
    finally:
        watchdog.close()
    assert fired == [(4, 0.1)]


def test_the_hang_line_names_the_ranks_that_did_not_arrive() -> None:
    folder = Path("/run/hang")
    inside = "rank 0 (host node-a, local rank 0), pid 9: step 9 not done after 6 s; in a collective: ..."
    outside = "rank 3 (host node-b, local rank 1), pid 7: step 9 not done after 6 s; not in a collective: at x.py:1 f"
    line = hang_line(9, 6.0, {0: inside, 1: inside, 3: outside}, PEERS, folder)
    assert line.startswith(
        "step 9 did not finish within 6 s (comm.hang_timeout_seconds): rank 2 (host node-b, local rank 0) wrote no "
        "stacks (frozen or dead); rank 3 (host node-b, local rank 1) is busy outside any collective (see "
        "/run/hang/rank3.txt); ranks 0, 1 waited for it; stacks in /run/hang;"
    ), line
    everyone = hang_line(9, 6.0, dict.fromkeys(range(4), inside), PEERS, folder)
    assert "every rank waits in a collective that does not complete" in everyone


def test_the_fleet_keys_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert load_config(["--comm.hang_timeout_seconds=auto"]).comm.hang_timeout_seconds == "auto"
    assert load_config(["--comm.hang_timeout_seconds=0"]).comm.hang_timeout_seconds == 0
    with pytest.raises(ConfigError) as info:
        load_config(["--comm.hang_timeout_seconds=-5", "--metrics.straggler_threshold=0"])
    assert info.value.problems == [
        'comm.hang_timeout_seconds: must be "auto", 0 (off) or a number of seconds > 0, got -5.0',
        "metrics.straggler_threshold: must be > 0 (a fraction of the median, e.g. 0.2), got 0.0",
    ]
    load_config(["--comm.hang_timeout_seconds=300", "--comm.train_timeout_seconds=100"])
    assert "warning: comm.hang_timeout_seconds = 300 is not below comm.train_timeout_seconds = 100" in (
        capsys.readouterr().err
    )


# ------------------------------------------------------------------ whole runs

# Rank 1 of 2 (rank 2 of 4) works 0.6 s more per step from step 5 on, then stops answering at step 9: a sleep outside
# any collective on 2 ranks, a SIGSTOP on 4. Logged every 2 steps, saved every 4.
RUN = [*TINY, "--metrics.log_freq=2", "--checkpoint.enable", "--checkpoint.interval=4",
       "--comm.hang_timeout_seconds=6", "--metrics.straggler_threshold=1.0"]  # fmt: skip


def slow_then_stuck(dump: Path, *, nproc: int, slow: int, stuck: str) -> tuple[str, str, float]:
    fault = f"spin,rank={slow},step=5,seconds=0.6;{stuck},rank={slow},step=9"
    began = time.monotonic()
    proc = torchrun(
        "train.py", *RUN, "--training.steps=10", f"--job.dump_folder={dump}", nproc=nproc, env={"FLEET_FAULT": fault},
        check=False, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout[-3000:]
    return proc.stdout, proc.stderr, time.monotonic() - began


def slow_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("slow rank")]


def test_a_slow_rank_is_named_and_a_stuck_one_ends_the_job_with_every_ranks_stacks_on_2_ranks(tmp_path: Path) -> None:
    dump = tmp_path / "run"
    out, err, seconds = slow_then_stuck(dump, nproc=2, slow=1, stuck="sleep")
    # Steps 3-4 even (step 1-2 hold start-up), 5-6 and 7-8 with rank 1 slowed: named in those two windows only.
    assert [line.split(":")[0] for line in slow_lines(out)] == ["slow rank, steps 5-6", "slow rank, steps 7-8"], out
    assert all("rank 1 (host " in line for line in slow_lines(out))
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    busy = {row["step"]: row["rank_busy_s"] for row in rows if "rank_busy_s" in row}
    assert sorted(busy) == [2, 4, 6, 8] and all(len(b) == 2 for b in busy.values())
    assert busy[8][1] - busy[8][0] > 0.4  # the 0.6 s of work, less the noise of a shared machine
    # Rank 1 sleeps outside any collective; rank 0 waits in one: both write their stacks, one line names rank 1.
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: step 9 did not finish within 6 s (comm.hang_timeout_seconds): rank 1 (host "), line
    assert "is busy outside any collective" in line and "rank 0 waited for it" in line
    assert "Traceback" not in err, err[-3000:]
    rank0, rank1 = ((dump / "hang" / f"rank{r}.txt").read_text() for r in (0, 1))
    assert "step 9 not done after 6 s; in a collective: torch/distributed/" in rank0.splitlines()[0]
    assert "not in a collective: at fleet/faults.py" in rank1.splitlines()[0] and "in train" in rank1  # all stacks
    assert seconds < 120
    # The same command resumes from the last checkpoint: the lock of the ended run is taken over, its stacks kept.
    again = torchrun("train.py", *RUN, "--training.steps=10", f"--job.dump_folder={dump}", nproc=2)
    assert f"resumed from {dump / 'checkpoint' / 'step-8'}" in again.stdout, again.stdout[-2000:]
    assert "took over" in again.stdout and sorted(losses(dump)) == [2, 4, 6, 8, 10]
    assert not (dump / "hang").exists() and len(list(dump.glob("hang-*/rank1.txt"))) == 1


def test_a_slow_rank_is_named_and_a_frozen_one_ends_the_job_on_4_ranks(tmp_path: Path) -> None:
    dump = tmp_path / "run"
    out, err, seconds = slow_then_stuck(dump, nproc=4, slow=2, stuck="stop")
    assert [line.split(":")[0] for line in slow_lines(out)] == ["slow rank, steps 5-6", "slow rank, steps 7-8"], out
    assert all("rank 2 (host " in line for line in slow_lines(out))
    # Rank 2 is frozen (SIGSTOP): it cannot write its stacks, and its missing file names it.
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "rank 2 (host " in line and "wrote no stacks (frozen or dead); ranks 0, 1, 3 waited for it" in line, line
    assert sorted(p.name for p in (dump / "hang").glob("rank*.txt")) == ["rank0.txt", "rank1.txt", "rank3.txt"]
    assert seconds < 150
