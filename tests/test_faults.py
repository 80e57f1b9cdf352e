"""Nothing lost: non-finite steps, crashes, stop requests, crafted checkpoints, settings on resume,
a shared dump folder, full disks, and one-line errors for every bad input.

End-to-end cases run train.py (one process unless the case needs ranks); the rest call the very
functions train.py calls. Cases that need a small or read-only filesystem mount a tmpfs and skip,
saying so, where this machine does not allow it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from checkpoint import CheckpointManager, DumpFolderLock, prepare_dump_folder, verify
from config import Checkpoint, Comm, Data, LRScheduler, Optimizer, Training, load_config
from data.corpus import TokenCorpus, open_corpus
from data.tokenizers import build_tokenizer
from distributed import init_distributed, set_collective_timeout
from errors import ConfigError
from metrics import StepResult
from models import family
from muon import build_muon
from optimizer import APPLIED, NONFINITE, SPIKE, SkipStepOptimizer, SpikeWindow, build_optimizer, lr_factor
from tests.conftest import TINY, losses
from tests.launch import REPO, free_port, python, torchrun, two_at_a_time
from tests.parity_worker import GLOBAL_BATCH, SEQ_LEN, build_tiny, micro_batches, one_process, random_batch
from tests.parity_worker import TINY as TINY_ARGS
from train import train_step

CKPT = ["--checkpoint.enable", "--checkpoint.interval=2"]


def train_py(dump: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return python("train.py", *TINY, f"--job.dump_folder={dump}", *args, env=env)


def one_error(proc: subprocess.CompletedProcess[str], *, code: int = 2) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    return line


def rows(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def folders(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "checkpoint").iterdir() if p.name != "config.toml")  # (generate.py's)


@contextlib.contextmanager
def tmpfs(path: Path, *, size: str, read_only: bool = False) -> Iterator[Path]:
    """A small (or read-only) filesystem at `path`; skips the test where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"needs permission to mount a tmpfs: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# --------------------------------------------------------------- 1. non-finite steps


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_a_nonfinite_step_changes_neither_weights_nor_optimizer_state(implementation: str) -> None:
    model = build_tiny()
    optimizer = build_optimizer(Optimizer(implementation=implementation), model)
    batch, forward_backward = micro_batches(random_batch()), one_process(model)
    step = dict(max_norm=1.0, stop_request=None)
    train_step(1, batch, forward_backward, optimizer, **step)
    assert optimizer.skip_code.item() == APPLIED
    with torch.no_grad():
        model.layers["0"].attention.wq.weight[0, 0] = float("nan")  # what a corrupted shard would do
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: {n: t.clone() for n, t in s.items()} for k, s in optimizer.state.items()}
    result = train_step(2, batch, forward_backward, optimizer, **step)
    assert optimizer.skip_code.item() == NONFINITE and not torch.isfinite(result.loss.total)
    for name, value in model.state_dict().items():
        assert torch.allclose(value, before[name], rtol=0, atol=0, equal_nan=True), name
    for param, saved in state.items():
        for name, value in optimizer.state[param].items():
            assert torch.equal(value, saved[name]), name  # moments and the step count: untouched


def test_a_loss_spike_is_skipped_and_the_run_goes_on_as_if_it_had_never_come(capsys: pytest.CaptureFixture) -> None:
    """training.skip_spike_sigma: a batch of random tokens after a window of a learned pattern is a spike
    (loss and gradient norm far above the window's); its update is not applied, a warning names it, and
    the steps after it are bit for bit those of a run that never took that step."""
    pattern = (
        torch.arange(SEQ_LEN + 1) + torch.arange(GLOBAL_BATCH)[:, None] * 7
    ) % TINY_ARGS.vocab_size  # next = this + 1
    ordinary, garbage = micro_batches(pattern), micro_batches(random_batch())

    def run(
        *, guard: bool, spike_at: int | None, steps: int = 36, resume_at: int | None = None
    ) -> tuple[nn.Module, SkipStepOptimizer, list[tuple[StepResult, float]]]:
        """(model, optimizer, [(result, skip code)]); with resume_at, the optimizer's spike window goes through
        a checkpoint's state_dict into a new optimizer at that step, as a resumed run's does."""
        model = build_tiny()
        training = Training(skip_spike_sigma=6 if guard else 0, skip_spike_window=8)
        optimizer = build_optimizer(Optimizer(lr=1e-2), model, training=training)
        results = []
        for i in range(steps):
            if i == resume_at:
                saved = {k: v.clone() for k, v in optimizer.window.state_dict().items()}
                state = optimizer.state_dict()
                optimizer = build_optimizer(Optimizer(lr=1e-2), model, training=training)
                optimizer.load_state_dict(state)
                optimizer.window.load_state_dict(saved)
            if i != spike_at or guard:  # the reference run never takes the spike's step
                batch = garbage if i == spike_at else ordinary
                result = train_step(i + 1, batch, one_process(model), optimizer, max_norm=1.0, stop_request=None)
                results.append((result, optimizer.skip_code.item()))
        return model, optimizer, results

    init_distributed(Comm(), dump_folder="unused")  # the guard's all-reduce of the loss
    try:
        guarded, guarded_opt, results = run(guard=True, spike_at=30)
        reference, reference_opt, _ = run(guard=False, spike_at=30)
        resumed_model, _, resumed = run(guard=True, spike_at=30, resume_at=25)
    finally:
        dist.destroy_process_group()
    assert [i for i, (_, code) in enumerate(results) if code != APPLIED] == [30]  # and none of the learned pattern's
    assert results[30][1] == SPIKE and results[30][0].loss.total > 3 * results[29][0].loss.total  # finite: a spike
    for name, value in guarded.state_dict().items():
        assert torch.equal(value, reference.state_dict()[name]), name
        assert torch.equal(value, resumed_model.state_dict()[name]), name  # the window came through the resume
    assert [code for _, code in resumed] == [code for _, code in results]
    for param, ref in zip(guarded_opt.param_groups[0]["params"], reference_opt.param_groups[0]["params"], strict=True):
        for name, value in guarded_opt.state[param].items():
            assert torch.equal(value, reference_opt.state[ref][name]), name  # moments and step counts too
    guarded_opt.read_reports()  # (train.py's loop reads them after each step)
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: training: step")]
    assert len(warned) == 1 and warned[0].startswith("warning: training: step 31 had loss ") and "a spike" in warned[0]
    assert guarded_opt.spikes == 1 and not guarded_opt.too_many_nonfinite()


def test_a_resumed_run_without_the_spike_window_would_skip_other_steps() -> None:
    """What the saved window buys: a fresh window after a resume judges nothing until it is full, so
    a spike within its first skip_spike_window steps would be applied. With the window restored (the
    test above) the resumed run skips exactly the straight run's steps."""
    window = SpikeWindow(4, sigma=6, device=torch.device("cpu"))
    for loss in (1.0, 1.01, 0.99, 1.0, 1.02):
        assert not window.is_spike(torch.tensor([loss, 0.5]))
    fresh = SpikeWindow(4, sigma=6, device=torch.device("cpu"))
    restored = SpikeWindow(4, sigma=6, device=torch.device("cpu"))
    restored.load_state_dict({k: v.clone() for k, v in window.state_dict().items()})
    assert restored.is_spike(torch.tensor([9.0, 0.5])) and not fresh.is_spike(torch.tensor([9.0, 0.5]))


class _StopAt:
    """A stop request that the ranks agree on at its `at`-th question (train_step asks between micro-batches)."""

    def __init__(self, at: int):
        self.at, self.asked, self.reason = at, 0, None

    def requested(self) -> str | None:
        self.asked += 1
        self.reason = "SIGTERM" if self.asked >= self.at else None
        return self.reason


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_a_step_abandoned_between_micro_batches_changes_neither_weights_nor_optimizer_state(name: str) -> None:
    model = build_tiny()
    if name == "Muon":  # its momentum too (muon.py)
        optimizer = build_muon(Optimizer(name="Muon"), model, family("llama3"))
    else:
        optimizer = build_optimizer(Optimizer(), model)
    tokens, forward_backward = random_batch(), one_process(model)
    micro = micro_batches(tokens, len(tokens))
    train_step(1, micro, forward_backward, optimizer, max_norm=1.0, stop_request=None)  # optimizer state exists
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: {n: t.clone() for n, t in s.items()} for k, s in optimizer.state.items()}
    stop = _StopAt(2)  # asked before micro-batches 2, 3, ...: agreed before the third
    assert train_step(2, iter(micro), forward_backward, optimizer, max_norm=1.0, stop_request=stop) is None
    assert stop.asked == 2 and all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert any("momentum_buffer" in s for s in state.values()) == (name == "Muon")
    for param, saved in state.items():
        for key, value in optimizer.state[param].items():
            assert torch.equal(value, saved[key]), key
    # (The loader's half, giving the abandoned step's samples again: tests/test_data.py.)


def test_nonfinite_steps_stop_the_run_naming_the_step_and_the_last_checkpoint(tmp_path: Path) -> None:
    dump = tmp_path / "run"
    assert train_py(dump, "--training.steps=2", *CKPT).returncode == 0
    boom = ["--training.steps=10", "--optimizer.lr=1e9", "--lr_scheduler.warmup_steps=0", *CKPT]
    line = one_error(train_py(dump, *boom))
    # Step 3 applies lr 1e9 (its loss is still finite); step 4's loss is not: skipped, and the run stops.
    assert line.startswith("error: training.skip_nonfinite_steps: step 4 had loss nan and gradient norm nan")
    assert f"Last checkpoint: {dump / 'checkpoint' / 'step-2'}" in line and "Lower optimizer.lr" in line
    assert folders(dump) == ["step-2"]  # nothing non-finite was saved
    assert sorted(r["step"] for r in rows(dump)) == [1, 2, 3]

    # Tolerating two: steps 4 and 5 are skipped with a warning each, the third one stops it.
    proc = train_py(dump, *boom, "--training.skip_nonfinite_steps=2")
    assert one_error(proc).startswith("error: training.skip_nonfinite_steps: step 6 had loss nan")
    assert "(3 such steps, 2 tolerated)" in proc.stderr
    warned = [line for line in proc.stderr.splitlines() if line.startswith("warning: training: step")]
    assert [w.split()[3] for w in warned] == ["4", "5"], proc.stderr
    # Step 4's update was skipped, so its state is finite (if wrecked by step 3's lr): it was saved.
    assert folders(dump) == ["step-2", "step-4"] and f"Last checkpoint: {dump / 'checkpoint' / 'step-4'}" in proc.stderr


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_with_nonfinite_weights_is_refused_by_name(tmp_path: Path) -> None:
    model = build_tiny()
    with torch.no_grad():
        model.norm.weight[3] = float("inf")
    dcp.save({"model_and_optimizer": {"model": model.state_dict()}}, checkpoint_id=str(tmp_path / "bad"))
    manager = CheckpointManager(
        Checkpoint(initial_load_path=str(tmp_path / "bad")),
        dump_folder=str(tmp_path),
        model=build_tiny(),
        optimizer=None,
        stateful={},
    )
    with pytest.raises(ConfigError, match=r"bad holds non-finite weights \(1 tensors, e.g. norm.weight\)"):
        manager.load()


# ------------------------------------------- 2. async saves, crashes, resume, metrics


def test_crash_leftovers_are_published_or_removed_and_settings_given_on_resume_apply(tmp_path: Path) -> None:
    dump = tmp_path / "run"
    first = train_py(
        dump, "--training.steps=10", "--checkpoint.enable", "--checkpoint.interval=5", "--checkpoint.async_mode=async"
    )
    assert first.returncode == 0, first.stderr[-3000:]
    # The async save of step 5 is published while training goes on (polled every step), not at the next save.
    out = first.stdout
    assert out.index(f"saved checkpoint {dump / 'checkpoint' / 'step-5'}") < out.index("step  9/10"), out
    assert folders(dump) == ["step-10", "step-5"]

    # A crash after step 10 was written but before it was published, and debris of a save that died.
    ckpt = dump / "checkpoint"
    (ckpt / "step-10").rename(ckpt / "step-10.partial")
    (ckpt / "step-12.partial").mkdir()
    (ckpt / "step-12.partial" / "__0_0.distcp").write_bytes(b"half")

    again = train_py(dump, "--training.steps=12", *CKPT, "--optimizer.lr=0.001")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"published {ckpt / 'step-10'}" in again.stdout and f"removed {ckpt / 'step-12.partial'}" in again.stdout
    assert "resume: optimizer.lr 0.003 -> 0.001 (from step 11 on)" in again.stdout
    assert "resume: training.steps 10 -> 12 (from step 11 on)" in again.stdout
    assert folders(dump) == ["step-10", "step-12"]  # configs/debug.toml keeps the latest 2
    logged = rows(dump)
    assert [r["step"] for r in logged] == list(range(1, 13))  # each step once
    schedule = LRScheduler(warmup_steps=5, decay_type="cosine", min_lr_factor=0.1)  # TINY on configs/debug.toml
    assert logged[10]["lr"] == pytest.approx(0.001 * lr_factor(10, schedule, training_steps=12), rel=1e-9)

    # The newest checkpoint damaged after it was complete (a filesystem, not a crash): set aside, not
    # deleted, and the run resumes from the one before.
    shard = ckpt / "step-12" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    skip = train_py(dump, "--training.steps=13", *CKPT)
    assert skip.returncode == 0, skip.stderr[-3000:]
    (warning,) = [line for line in skip.stderr.splitlines() if "damaged" in line]
    assert warning.startswith("warning: checkpoint.folder: skipped step 12, it is damaged (") and "truncated" in warning
    assert f"resumed from {ckpt / 'step-10'}" in skip.stdout
    assert (ckpt / "step-12.damaged" / "__0_0.distcp").stat().st_size == 1000
    assert folders(dump) == ["step-12", "step-12.damaged", "step-13"]

    # Resuming into fewer steps than the checkpoint's: refused before anything is loaded.
    line = one_error(train_py(dump, "--training.steps=8", *CKPT))
    assert line.startswith("error: training.steps: 8 is below step 13 of the checkpoint in")


def test_metrics_keep_each_step_once_when_a_resume_redoes_steps(tmp_path: Path) -> None:
    dump = tmp_path / "run"
    assert train_py(dump, "--training.steps=4", *CKPT).returncode == 0
    shutil.rmtree(dump / "checkpoint" / "step-4")  # lost: the rerun redoes steps 3 and 4
    assert train_py(dump, "--training.steps=4", *CKPT).returncode == 0
    assert [r["step"] for r in rows(dump)] == [1, 2, 3, 4]


def test_seed_checkpoints_are_never_pruned(tmp_path: Path) -> None:
    dump = tmp_path / "run"
    assert train_py(dump, "--checkpoint.create_seed_checkpoint").returncode == 0
    proc = train_py(
        dump, "--training.steps=4", "--checkpoint.enable", "--checkpoint.interval=1", "--checkpoint.keep_latest_k=1"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {dump / 'checkpoint' / 'step-0'}" in proc.stdout
    assert folders(dump) == ["step-0", "step-4"]


# ------------------------------------------------------------ 3. stop requests, locks


def stopped(run: subprocess.Popen, dump: Path, *, timeout: float = 120) -> tuple[str, str]:
    """The output of a run asked to stop; on a timeout, what it printed and whether a STOP file is there."""
    try:
        return run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out, err = (x.decode() if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        status = Path(f"/proc/{run.pid}/status").read_text() if Path(f"/proc/{run.pid}/status").exists() else ""
        signals = " ".join(line for line in status.splitlines() if line.startswith("Sig"))
        pytest.fail(
            f"no stop in {timeout} s (STOP file there: {(dump / 'STOP').exists()}; {signals})\n{out[-2000:]}\n"
            f"{err[-2000:]}"
        )


def kill(run: subprocess.Popen, dump: Path) -> None:
    """Whatever is left of a run: the launcher, and the ranks (torchrun's, or a launch script's own session)."""
    run.kill()
    subprocess.run(["pkill", "-KILL", "-f", f"job.dump_folder={dump}"], check=False)


def wait_for(path: Path, *, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.3)


def test_sigint_saves_and_exits_zero_and_a_second_run_in_the_folder_is_refused(tmp_path: Path) -> None:
    dump = tmp_path / "run"
    cmd = [sys.executable, "train.py", *TINY, "--training.steps=100000", f"--job.dump_folder={dump}",
           "--checkpoint.enable", "--checkpoint.interval=100000"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(dump / "metrics.jsonl")
        line = one_error(train_py(dump, "--training.steps=3"))
        host = socket.gethostname()
        assert f"job.dump_folder: {dump} is in use by the run with pid {run.pid} on host {host}" in line
        run.send_signal(signal.SIGINT)
        out, err = stopped(run, dump)
    finally:
        kill(run, dump)
    assert run.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert "SIGINT: saved step" in out
    (saved,) = folders(dump)
    assert (dump / "checkpoint" / saved / ".metadata").is_file()
    assert not (dump / ".lock").exists()


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def plain_torchrun(*args: str) -> list[str]:
    """The command line of torchrun itself, its launcher included (what these signal tests are about)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", *args]


def test_sigterm_to_plain_torchrun_abandons_a_long_step_and_saves_within_a_3_s_grace_period(tmp_path: Path) -> None:
    """torchrun forwards SIGTERM to the ranks and SIGKILLs them --shutdown-timeout seconds later (a
    scheduler's grace period does the same). A step of 40 micro-batches takes longer than that here: the
    ranks abandon it between two, save step 1, and a rerun resumes from it."""
    dump = tmp_path / "run"
    args = (
        *TINY,
        "--training.seq_len=32",
        "--training.local_batch_size=1",
        "--training.global_batch_size=80",
        f"--job.dump_folder={dump}",
        "--checkpoint.enable",
        "--checkpoint.interval=100000",
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(
        plain_torchrun("--shutdown-timeout=3", "train.py", *args, "--training.steps=100"),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(dump / "metrics.jsonl")  # step 1 is done, step 2 (40 micro-batches) is running
        time.sleep(1)
        run.send_signal(signal.SIGTERM)
        out, err = stopped(run, dump)
    finally:
        kill(run, dump)
    assert "SIGTERM: abandoned step 2 in flight, saved step 1 and stopped" in out, out[-2000:] + err[-3000:]
    assert "forcefully exiting" not in err and 'train.py", line' not in err, err[-3000:]  # no SIGKILL, no traceback
    assert folders(dump) == ["step-1"] and not (dump / ".lock").exists()
    # The rerun's launcher is not under test: its ranks are started as the other tests start theirs.
    again = torchrun("train.py", *args, "--training.steps=2", nproc=2)
    assert f"resumed from {dump / 'checkpoint' / 'step-1'}" in again.stdout and sorted(losses(dump)) == [1, 2]


def test_sigint_to_plain_torchrun_during_start_up_stops_cleanly_in_one_line(tmp_path: Path) -> None:
    """Ctrl-C while the ranks still import torch: recorded (fleet/stop.py), answered once start-up is done, one line
    from rank 0 and no KeyboardInterrupt traceback from any rank."""
    dump = tmp_path / "run"
    cmd = plain_torchrun("train.py", *TINY, f"--job.dump_folder={dump}", "--checkpoint.enable")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(children(run.pid)) < 2:  # torchrun has started both ranks
            assert time.monotonic() < deadline and run.poll() is None, "torchrun never started its ranks"
            time.sleep(0.05)
        time.sleep(0.5)  # they are importing torch
        run.send_signal(signal.SIGINT)
        out, err = stopped(run, dump)
    finally:
        kill(run, dump)
    assert out.count("SIGINT: stopped during start-up, before step 1; nothing new to save") == 1, out + err[-3000:]
    assert 'train.py", line' not in err and "KeyboardInterrupt" not in err and "forcefully" not in err, err[-3000:]
    assert not (dump / "metrics.jsonl").exists() and not (dump / "checkpoint" / "step-1").exists()


def test_a_dead_runs_lock_is_taken_over_on_any_host_a_live_runs_is_not(tmp_path: Path) -> None:
    lock_file, host = tmp_path / ".lock", socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock_file.write_text(f"{host} {dead.stdout.strip()}\n")  # this host, its process gone
    lock = DumpFolderLock(tmp_path, environ={}, renew_every=0.05)
    lock.acquire()
    assert lock_file.read_text().split() == [host, str(os.getpid())]
    os.utime(lock_file, (0, 0))
    time.sleep(0.5)
    assert time.time() - lock_file.stat().st_mtime < 5  # the living run renews its lease
    lock.release()
    assert not lock_file.exists()
    # Another host's live run (renewed now) is refused, whatever job this one is; once its lease expired, taken over.
    lock_file.write_text("some-other-host 1 job=slurm:7 attempt=0.0\n")
    with pytest.raises(ConfigError, match="in use by the run with pid 1 on host some-other-host .*renewed 0 s ago"):
        DumpFolderLock(tmp_path, environ={"SLURM_JOB_ID": "8"}).acquire()
    with pytest.raises(ConfigError, match="in use by the run with pid 1 on host some-other-host"):  # a live sibling
        DumpFolderLock(tmp_path, environ={"SLURM_JOB_ID": "7"}).acquire()
    requeued = DumpFolderLock(tmp_path, environ={"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"})
    requeued.acquire()  # the same job, requeued (onto another node): its earlier attempt is over
    assert lock_file.read_text().split() == [host, str(os.getpid()), "job=slurm:7", "attempt=1.0"]
    requeued.release()
    lock_file.write_text("some-other-host 1\n")
    os.utime(lock_file, (time.time() - 61, time.time() - 61))
    expired = DumpFolderLock(tmp_path, environ={})
    expired.acquire()  # not renewed for a minute: its host is gone
    assert lock_file.read_text().split() == [host, str(os.getpid())]
    expired.release()


def a_terminals_signals() -> None:
    """SIGINT and SIGTERM at their defaults and unblocked, as in a shell a user starts from a terminal. A
    shell cannot trap a signal that was ignored when it started, and a test suite started in the
    background (a CI job, `make test &`) passes SIGINT on ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def test_the_launch_script_turns_sigint_into_a_saved_stop_and_exit_zero(tmp_path: Path) -> None:
    """Ctrl-C on scripts/run_multinode.sh: STOP file, 2 ranks save the same step, the launch exits 0."""
    dump = tmp_path / "run"
    env = {**os.environ, "NNODES": "1", "NPROC_PER_NODE": "2", "HEAD_ADDR": "127.0.0.1",
           "RDZV_PORT": str(free_port()), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = ["bash", "scripts/run_multinode.sh", "train.py", *TINY, "--training.steps=100000",
           f"--job.dump_folder={dump}", "--checkpoint.enable", "--checkpoint.interval=100000"]  # fmt: skip
    launch = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=a_terminals_signals,
    )
    try:
        wait_for(dump / "metrics.jsonl")
        launch.send_signal(signal.SIGINT)
        out, err = stopped(launch, dump)
    finally:
        kill(launch, dump)
    assert launch.returncode == 0, err[-3000:]
    assert f"{dump / 'STOP'} found: saved step" in out and "stop requested" in err
    assert len(folders(dump)) == 1 and not (dump / "STOP").exists()


def test_a_rank_that_stops_answering_fails_the_job_after_train_timeout_seconds(tmp_path: Path) -> None:
    dump = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "train.py", *TINY, "--training.steps=100000", f"--job.dump_folder={dump}",
           "--comm.train_timeout_seconds=2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        wait_for(dump / "metrics.jsonl")
        worker = int(Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()[-1])
        os.kill(worker, signal.SIGSTOP)
        stopped = time.monotonic()
        assert launcher.stderr is not None
        for line in launcher.stderr:
            if line.startswith("error: rank 0: a collective timed out"):
                break
        waited = time.monotonic() - stopped
    finally:
        if worker is not None:
            os.kill(worker, signal.SIGKILL)
        launcher.kill()
        launcher.communicate()
    assert waited < 30, waited  # 2 s of timeout, plus the step in flight on a busy machine


def test_collective_timeouts_are_set_as_configured() -> None:
    # No test leaves a process group behind in the test process; one that did would hide this check.
    assert not dist.is_initialized()
    init_distributed(Comm(init_timeout_seconds=77), dump_folder="unused")
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        assert backend.options._timeout.total_seconds() == 77
        set_collective_timeout(5, groups=[None])
        assert backend.options._timeout.total_seconds() == 5
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------- 4. no foreign code runs


class _RunsAShellCommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_metadata_runs_nothing(tmp_path: Path) -> None:
    marker, fake = tmp_path / "PWNED", tmp_path / "step-1"
    fake.mkdir()
    (fake / ".metadata").write_bytes(pickle.dumps(_RunsAShellCommand(marker)))
    run, proc = two_at_a_time(
        lambda: train_py(tmp_path / "run", f"--checkpoint.initial_load_path={fake}"),
        lambda: python(
            "scripts/convert_hf.py",
            "to-hf",
            str(fake),
            str(tmp_path / "hf"),
            "--flavor",
            "debugmodel",
            "--tokenizer-path",
            "assets/tokenizer",
        ),
    )
    line = one_error(run)
    assert "refused unread (it names posix.system" in line and "nothing in the folder was run" in line
    assert proc.returncode == 2 and "refused unread" in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_crafted_non_tensor_item_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    dcp.save({"weights": torch.ones(3), "extra": _RunsAShellCommand(marker)}, checkpoint_id=str(tmp_path / "ck"))
    with pytest.raises(ConfigError, match=r"item extra was refused unread \(UnpicklingError\)"):
        verify(tmp_path / "ck")
    assert not marker.exists()


def test_missing_and_truncated_shard_files_are_named(seed: Path, tmp_path: Path) -> None:
    copy = tmp_path / "step-0"
    shutil.copytree(seed, copy)
    shard = copy / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ConfigError, match=r"__0_0.distcp is truncated \(1,000 bytes, needs"):
        verify(copy)
    # The run's own checkpoint may go; one the user points at is theirs: the advice says which.
    with pytest.raises(
        ConfigError, match=r"incomplete \(point checkpoint.initial_load_path at a complete checkpoint\)$"
    ):
        verify(copy, key="checkpoint.initial_load_path")
    with pytest.raises(ConfigError, match=rf"incomplete \(delete {copy}\)$"):
        verify(copy, key="checkpoint.folder")
    shard.unlink()
    with pytest.raises(ConfigError, match=r"__0_0.distcp is missing; the checkpoint is incomplete"):
        verify(copy)


# --------------------------------------------------- 5. the dump folder and the disk


def test_unusable_dump_folders_are_named_before_any_compute(tmp_path: Path) -> None:
    ckpt = Checkpoint(enable=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"job.dump_folder: .*file exists and is not a folder"):
        prepare_dump_folder(str(tmp_path / "file"), ckpt, checkpoint_bytes=1)
    with pytest.raises(ConfigError, match=r"its name is too long"):
        prepare_dump_folder(str(tmp_path / ("x" * 300)), ckpt, checkpoint_bytes=1)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint").write_text("x")
    with pytest.raises(ConfigError, match=r"checkpoint.folder: .*checkpoint exists and is not a folder"):
        prepare_dump_folder(str(tmp_path / "run"), ckpt, checkpoint_bytes=1)
    with tmpfs(tmp_path / "ro", size="1m", read_only=True) as ro, pytest.raises(ConfigError, match=r"read-only"):
        prepare_dump_folder(str(ro), ckpt, checkpoint_bytes=1)
    too_small = pytest.raises(ConfigError, match=r"has 0.00 GiB free, but a checkpoint .* takes about 0.06 GiB")
    with tmpfs(tmp_path / "small", size="1m") as small, too_small:
        prepare_dump_folder(str(small), ckpt, checkpoint_bytes=12 * 5_770_496)


def test_a_disk_that_fills_during_a_save_stops_in_one_line_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", size="100m") as disk:  # room for one checkpoint of the debug model (67 MiB)
        dump = disk / "run"
        line = one_error(train_py(dump, "--training.steps=3", "--checkpoint.enable", "--checkpoint.interval=1"))
        assert line.startswith("error: checkpoint.folder: no space left on the device while writing")
        assert "step-2.partial (removed)" in line
        assert folders(dump) == ["step-1"]


# ------------------------------------------------------ 6. one line for every bad input


def problems(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    return info.value.problems


def test_config_values_that_mean_nothing_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    toml = tmp_path / "latin1.toml"
    toml.write_bytes('[job]\ndescription = "caf\xe9"\n'.encode("latin-1"))
    assert problems(["--config", str(toml)]) == [
        f"--config: {toml} is not UTF-8 text (byte 0xe9 at offset 24); save it as UTF-8"
    ]
    (inf,) = problems(["--optimizer.lr=inf"])
    assert inf.startswith("optimizer.lr: expected finite float, got 'inf'")
    toml.write_text("[optimizer]\nlr = inf\n[training]\nmax_norm = nan\n")
    assert [p.split(":")[0] for p in problems(["--config", str(toml)])] == ["optimizer.lr", "training.max_norm"]
    assert problems(["--optimizer.eps=-1"])[0].startswith("optimizer.eps: must be > 0")
    load_config(["--config", "configs/debug.toml", "--training.steps=10"])  # warmup 20 > 10 steps
    assert "warning: lr_scheduler.warmup_steps = 20 exceeds the 10 steps of the schedule" in capsys.readouterr().err


def corpus(tmp_path: Path, content: bytes, suffix: str = ".jsonl") -> TokenCorpus:
    path = tmp_path / f"data{suffix}"
    path.write_bytes(content)
    return open_corpus(Data(path=str(path), cache_folder=str(tmp_path / "cache")), build_tokenizer("byte"), "byte")


def test_data_that_cannot_be_trained_on_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"data.path: .*data.jsonl holds no documents"):
        corpus(tmp_path, b"")
    with pytest.raises(ConfigError, match=r"data.path: .*data.txt is not UTF-8 text"):
        corpus(tmp_path, b"\xff\xfe caf\xe9\n", suffix=".txt")
    with pytest.raises(ConfigError, match=r"column 'text' of .* holds int values \(document 0 of .*data.jsonl\)"):
        corpus(tmp_path, b'{"text": 1}\n{"text": 2}\n')
    with pytest.raises(ConfigError, match=r"data.path: document 1 of .*data.jsonl is not valid JSON"):
        corpus(tmp_path, b'{"text": "a"}\n{"text": "b')  # a truncated download
    nulls = corpus(tmp_path, b'{"text": "abc"}\n{"text": null}\n{"text": "de"}\n')
    assert "warning: data.path: 1 of 3 documents of" in capsys.readouterr().err
    assert nulls.num_tokens == (3 + 2) + (2 + 2)  # two documents with BOS and EOS; the null one skipped


def test_damaged_data_files_are_named_in_one_line(tmp_path: Path) -> None:
    """Truncated or corrupt parquet and gzip files, through every reader: one line naming the file."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = b"".join(json.dumps({"text": f"document {i} " * 20}).encode() + b"\n" for i in range(500))
    packed = gzip.compress(lines)
    flipped = packed[:-100] + bytes(b ^ 0xFF for b in packed[-100:-90]) + packed[-90:]
    cases = {".jsonl.gz": packed[: len(packed) // 2], ".json.gz": flipped}
    pq.write_table(pa.table({"text": [f"document {i} " * 20 for i in range(500)]}), tmp_path / "whole.parquet")
    whole = (tmp_path / "whole.parquet").read_bytes()
    cases[".parquet"] = whole[: len(whole) // 2]
    for suffix, content in cases.items():
        with pytest.raises(ConfigError, match=rf"data.path: .*data{suffix} is damaged or unreadable \(\w+: "):
            corpus(tmp_path, content, suffix=suffix)
    # Through the CLI: a truncated parquet file in a dataset folder.
    folder = tmp_path / "dataset"
    folder.mkdir()
    (folder / "part-0.parquet").write_bytes(whole)
    (folder / "part-1.parquet").write_bytes(cases[".parquet"])
    line = one_error(train_py(tmp_path / "run", f"--data.path={folder}", "--training.steps=1"))
    assert f"error: data.path: {folder / 'part-1.parquet'} is damaged or unreadable (ArrowInvalid: " in line


def test_an_invalid_tokenizer_config_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "tok"
    shutil.copytree(REPO / "assets" / "tokenizer", folder)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"model.tokenizer_path: .*tokenizer_config.json is not valid JSON"):
        build_tokenizer(str(folder))


def test_async_with_pinned_memory_needs_cuda(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: async_with_pinned_mem runs")
    with pytest.raises(ConfigError, match=r'checkpoint.async_mode: async_with_pinned_mem .* needs CUDA; use "async"'):
        CheckpointManager(
            Checkpoint(async_mode="async_with_pinned_mem"),
            dump_folder=str(tmp_path),
            model=build_tiny(),
            optimizer=None,
            stateful={},
        )


def test_losses_are_unchanged_by_the_guards(tmp_path: Path, seed: Path) -> None:
    """The non-finite check and the stop machinery cost nothing in numbers: a plain run still trains."""
    dump = tmp_path / "run"
    proc = train_py(dump, "--training.steps=6", f"--checkpoint.initial_load_path={seed}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = losses(dump)
    assert sorted(got) == list(range(1, 7)) and got[6] < got[1]
