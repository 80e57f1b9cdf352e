"""train.py end to end on CPU ranks: falling loss, metrics, checkpoints, resume, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib
import torch

from checkpoint import SaveStep, is_model_only, verify
from config import load_config
from data.prepare import prepare
from data.sources import find_source
from errors import ConfigError
from loss import LossTerms
from tests.conftest import TINY, losses
from tests.launch import REPO, free_port, python, torchrun, two_at_a_time


def test_two_rank_run_loss_falls_and_metrics_are_logged(
    two_rank_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    dump, proc = two_rank_run
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]  # (a logged step also has a row of each rank's figures: fleet/monitor.py)
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30]
    for row in rows:
        assert {"step", "loss", "grad_norm", "lr", "tps", "mfu", "memory_gib"} <= row.keys()
        assert row["tps"] > 0 and row["memory_gib"] > 0 and row["mfu"] is None  # no MFU on CPU
        assert 0 < row["z_loss"] < 100  # logged on its own; `loss` is the cross-entropy
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0, [r["loss"] for r in rows]
    assert "world 2 = replicate 1 x shard 2 x tp 1" in proc.stdout
    assert proc.stdout.count("step 30/30 (100%)") == 1  # rank 0 only
    # Where the outputs go, before the first step; the first logged window includes start-up and says so;
    # a closing line.
    lines = proc.stdout.splitlines()
    assert lines.index(next(line for line in lines if line.startswith(f"outputs: {dump} | metrics "))) < next(
        i for i, line in enumerate(lines) if line.startswith("step ")
    )
    logged = [line for line in lines if line.startswith("step ")]
    assert "(warm-up)" in logged[0] and not any("(warm-up)" in line for line in logged[1:])
    assert lines[-1].startswith("end: trained steps 1..30 in ") and f"metrics: {dump / 'metrics.jsonl'}" in lines[-1]
    assert any((dump / "tb").iterdir())
    assert "a spike" not in proc.stderr, proc.stderr  # (tests/test_faults.py skips one)


def test_throughput_and_eta_leave_out_validations_and_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """train.py's work after each step (log, then validate and save) on a fake clock: 10 s per step, a 50 s
    validation after step 1, a 30 s save after step 10. The logged step time, tokens/s per rank and ETA are those of
    the steps alone (step 1's validation once made step 10's ETA 22m30s): the loop leaves the work after the log out,
    once, whatever it is."""
    from types import SimpleNamespace

    import metrics
    import train
    from config import JobConfig, Metrics, Training
    from evaluation.validation import ValidateStep

    clock = SimpleNamespace(now=0.0)
    fake_time = SimpleNamespace(perf_counter=lambda: clock.now)
    monkeypatch.setattr(metrics, "time", fake_time)
    monkeypatch.setattr(train, "time", fake_time)
    monkeypatch.setattr(metrics.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(metrics, "mean_over_loss_ranks", lambda value, pp_degree: value)

    def validate() -> tuple[float, int, float]:
        clock.now += 50
        return 2.5, 1000, 50.0

    def save(step: int, last: bool) -> None:
        clock.now += 30

    logger = metrics.MetricsLogger(Metrics(), dump_folder=str(tmp_path), total_steps=100, start_step=0, enabled=True)
    cfg = JobConfig(metrics=Metrics(log_freq=10), training=Training(steps=100, seq_len=100))
    loader = SimpleNamespace(global_batch_size=10, mixture=None)  # 1000 tokens per step
    log = metrics.LogStep(
        cfg, logger=logger, loader=loader, start_step=0, flops_per_token=1.0, device=torch.device("cpu"),
        lr=lambda: 1e-3,
    )  # fmt: skip
    validator = SimpleNamespace(validate=validate, seconds=50.0)
    ckpt = SimpleNamespace(poll=lambda: None, should_save=lambda step, last: step == 10, save=save)
    work = train.AfterStepWork(
        timed=[log],
        untimed=[
            ValidateStep(validator, freq=50, total_steps=100, logger=logger),
            SaveStep(ckpt, total_steps=100),
        ],
        clock=log,
    )
    result = metrics.StepResult(LossTerms(torch.tensor(2.0), torch.tensor(2.0), {}), grad_norm=torch.tensor(1.0))
    for step in range(1, 21):
        clock.now += 10
        assert not work(step, result)
    logged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(logged) == 2, logged
    assert "| tps/rank 100 (warm-up) |" in logged[0] and logged[0].endswith("| step 10000 ms | eta 15m00s"), logged
    assert "| tps/rank 100 |" in logged[1] and logged[1].endswith("| step 10000 ms | eta 13m20s"), logged


def run_args(dump: Path, *, steps: int, seed: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """train.py's arguments for a run of `steps` steps. The LR stays flat after warmup (min_lr_factor = 1), so that a
    10-step run is the first half of a 20-step run, as if the 20-step job was stopped."""
    return [
        *TINY,
        f"--training.steps={steps}",
        "--training.global_batch_size=8",
        "--debug.deterministic",
        "--lr_scheduler.min_lr_factor=1.0",
        f"--job.dump_folder={dump}",
        "--checkpoint.enable",
        "--checkpoint.interval=5",
        f"--checkpoint.initial_load_path={seed}",
        *extra,
    ]


def run(dump: Path, *, nproc: int, steps: int, seed: Path, extra: tuple[str, ...] = ()) -> None:
    """A run (`run_args`). One rank: `python train.py`, as a user starts it (torchrun's start-up would add seconds)."""
    args = ("train.py", *run_args(dump, steps=steps, seed=seed, extra=extra))
    if nproc > 1:
        torchrun(*args, nproc=nproc)
        return
    proc = python(*args)
    assert proc.returncode == 0, proc.stderr[-6000:]


def runs_in_one_launch(runs_json: Path, nproc: int, *runs: list[str]) -> subprocess.CompletedProcess[str]:
    """Several runs (`run_args`), one after another in one torchrun launch (tests/config_worker.py)."""
    runs_json.write_text(json.dumps(runs))
    return torchrun(REPO / "tests" / "config_worker.py", str(runs_json), nproc=nproc)


def test_resume_gives_the_losses_of_a_straight_run_and_skips_partial_checkpoints(tmp_path: Path, seed: Path) -> None:
    straight, resumed, resharded = tmp_path / "straight", tmp_path / "resumed", tmp_path / "resharded"
    # The straight run, then the first half of the same world size with async saves and pruning on the way, in one
    # launch (the async save last: the process waits for it at exit).
    async_first_half = ("--checkpoint.async_mode=async", "--checkpoint.keep_latest_k=1")
    runs_in_one_launch(
        tmp_path / "first.json",
        2,
        run_args(straight, steps=12, seed=seed),
        run_args(resumed, steps=6, seed=seed, extra=async_first_half),
    )
    assert sorted(p.name for p in (resumed / "checkpoint").iterdir()) == ["config.toml", "step-6"]
    # A save killed half way: a .partial folder, and a step folder without .metadata; never resumed (the losses
    # below are those of a resume from step 6).
    (resumed / "checkpoint" / "step-9.partial").mkdir()
    (resumed / "checkpoint" / "step-12").mkdir()
    # Saved on 4 ranks as 2 pipeline stages x FSDP 2, resumed on 2 without pipeline: DCP reshards
    # model and optimizer state (parameter names do not depend on the stages).
    run(resharded, nproc=4, steps=6, seed=seed, extra=("--parallelism.pipeline_parallel_degree=2",))
    runs_in_one_launch(
        tmp_path / "second.json", 2, run_args(resumed, steps=12, seed=seed), run_args(resharded, steps=12, seed=seed)
    )

    ref, same, other = losses(straight), losses(resumed), losses(resharded)
    assert sorted(same) == sorted(other) == list(range(1, 13))
    assert ref[12] < ref[1] - 0.5
    # Same world size, deterministic mode: bit-identical.
    assert same == ref
    # Another layout sums gradients in another order (pipeline micro-batches, other partial sums):
    # float32 rounding, nothing more (relative 1e-5, as in the next test).
    assert max(abs(other[s] - ref[s]) / ref[s] for s in ref) < 1e-5


def test_muon_resumes_on_another_layout_as_a_straight_run(tmp_path: Path, seed: Path) -> None:
    """Muon's momentum is a DTensor of its parameter's layout (muon.py): saved under FSDP 2 (row shards), resumed
    under TP 2 (row and column shards, matrices gathered over TP instead), it continues the straight FSDP run. Muon
    iterates in bfloat16, so another layout's gradient rounding can flip a bfloat16 value: close, not bit-identical."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"

    def muon(dump: Path, steps: int, *extra: str) -> list[str]:  # README: make train CONFIG=configs/debug_muon.toml
        args = run_args(dump, steps=steps, seed=seed, extra=extra)
        return [a if a != "configs/debug.toml" else "configs/debug_muon.toml" for a in args]

    runs_in_one_launch(tmp_path / "first.json", 2, muon(straight, 10), muon(resumed, 5))
    tp = ("--parallelism.tensor_parallel_degree=2",)
    runs_in_one_launch(tmp_path / "second.json", 2, muon(resumed, 10, *tp))
    ref, other = losses(straight), losses(resumed)
    assert sorted(other) == list(range(1, 11)) and ref[10] < ref[1] - 0.5
    assert [other[s] for s in range(1, 6)] == [ref[s] for s in range(1, 6)]  # the same first half
    assert max(abs(other[s] - ref[s]) / ref[s] for s in range(6, 11)) < 1e-3, (ref, other)
    # torchtitan 0.2.2 has no Muon: its checkpoint layout is refused in one line, nothing written.
    out = tmp_path / "torchtitan" / "step-10"
    step = straight / "checkpoint" / "step-10"
    proc = python(
        str(REPO / "scripts" / "convert_torchtitan.py"), str(step), str(out), "--config", "configs/debug.toml"
    )
    assert proc.returncode == 2 and not out.parent.exists(), proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "torchtitan 0.2.2 has no Muon to continue its state; start "
            "torchtitan from the weights (a step saved with "
            "checkpoint.last_save_model_only = true)"
        )
    ), proc.stderr


def test_auto_ac_trains_as_its_choice_written_out_by_hand(tmp_path: Path, seed: Path) -> None:
    """activation_checkpoint.mode = "auto" on 2 ranks (FSDP 2) with a budget a quarter of the way from the estimated
    peak of full AC everywhere to op SAC's: a mix. It trains bit for bit as the run of the same blocks written out
    (mode "per_block"), prints its choice once at start-up, and the run folder's config records what ran."""
    from planning.job import CPU, Job
    from planning.memory import GiB, estimate, resolve_auto_ac, with_ac

    auto, hand = tmp_path / "auto", tmp_path / "hand"
    job = Job.of(load_config(run_args(auto, steps=4, seed=seed)), CPU, world_size=2)
    op, full = (
        estimate(with_ac(job, **ac))["total"]
        for ac in ({"mode": "selective", "selective_ac_option": "op"}, {"mode": "full"})
    )
    budget = (
        "--activation_checkpoint.mode=auto",
        f"--activation_checkpoint.memory_budget_gib={(3 * full + op) / 4 / GiB}",
    )
    _, choice = resolve_auto_ac(
        load_config(run_args(auto, steps=4, seed=seed, extra=budget)), world_size=2, machine=CPU
    )
    assert choice is not None and len(set(choice.modes)) > 1, choice
    written = ("--activation_checkpoint.mode=per_block", f"--activation_checkpoint.per_block={','.join(choice.modes)}")
    proc = runs_in_one_launch(
        tmp_path / "runs.json",
        2,
        run_args(auto, steps=4, seed=seed, extra=budget),
        run_args(hand, steps=4, seed=seed, extra=written),
    )
    assert proc.stdout.count("activation_checkpoint.mode = auto: ") == 1
    assert f"activation_checkpoint.mode = auto: {choice.describe()}" in proc.stdout.splitlines()
    assert losses(auto) == losses(hand) and sorted(losses(auto)) == [1, 2, 3, 4]
    saved = load_config(["--config", str(auto / "checkpoint" / "config.toml")]).activation_checkpoint
    assert (saved.mode, saved.per_block) == ("per_block", list(choice.modes))


def test_a_shuffled_block_causal_mixture_trained_as_a_pipeline_resumes_on_one_rank_with_the_same_stream(
    tmp_path: Path, seed: Path
) -> None:
    """Two prepared corpora mixed 70/30, shuffled windows, block-causal attention: 2 pipeline stages for 5
    steps, then 1 rank on; against 1 rank straight through."""
    mixture = [tmp_path / "stories", tmp_path / "held_out"]
    for folder, source in zip(mixture, ("stories.jsonl", "stories_validation.jsonl"), strict=True):
        prepare(find_source(str(REPO / "assets/corpus" / source)), str(REPO / "assets/tokenizer"), folder, workers=0)
    extra = (
        f"--data.mixture={mixture[0]},{mixture[1]}",
        "--data.mixture_weights=0.7,0.3",
        "--data.shuffle",
        "--model.attn_mask_type=block_causal",
    )
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, nproc=1, steps=10, seed=seed, extra=extra)
    # A pipeline of 2 stages (each stage masks attention with the documents' segments), then one rank.
    run(resumed, nproc=2, steps=5, seed=seed, extra=(*extra, "--parallelism.pipeline_parallel_degree=2"))
    run(resumed, nproc=1, steps=10, seed=seed, extra=extra)
    ref, got = losses(straight), losses(resumed)
    assert sorted(got) == list(range(1, 11))
    # The same sequences at every step; the pipeline sums gradients in another order: rounding only
    # (relative 1e-5; another window at any step moves the loss by more than 1e-2).
    assert max(abs(got[s] - ref[s]) / ref[s] for s in ref) < 1e-5, (got, ref)
    # Tokens per source: 56 and 24 of the 80 sequences of 64 tokens, in both runs.
    for dump in (straight, resumed):
        last = json.loads((dump / "metrics.jsonl").read_text().splitlines()[-1])
        assert (last["step"], last["tokens_stories"], last["tokens_held_out"]) == (10, 56 * 64, 24 * 64)
    # Other data under the same checkpoint: refused, unless asked for.
    other = (f"--data.path={mixture[0]}", "--data.shuffle", "--model.attn_mask_type=block_causal")
    proc = python(
        "train.py",
        *TINY,
        "--training.steps=12",
        "--training.global_batch_size=8",
        f"--job.dump_folder={resumed}",
        "--checkpoint.enable",
        *other,
    )
    assert (
        proc.returncode == 2
        and "error: data.ignore_resume_mismatch: the checkpoint was trained on other data" in proc.stderr
    )


def test_context_parallel_validates_and_resumes_without_it_and_back(tmp_path: Path, seed: Path) -> None:
    """Block-causal windows cut over CP 2 ranks for 4 steps, then 1 rank on to 6, then CP 2 again to 8, validating
    every 2 steps; against 1 rank straight through: the same training and validation losses (DCP reshards the
    parameters FSDP sharded over the CP ranks; the loader's state does not depend on CP)."""
    # (A warmup shorter than the shortest launch: a launch of fewer steps than warmup_steps warms up faster.)
    extra = (
        "--model.attn_mask_type=block_causal",
        "--lr_scheduler.warmup_steps=1",
        "--validation.enable",
        "--validation.freq=2",
        "--validation.steps=2",
        "--validation.seq_len=64",
        "--validation.local_batch_size=2",
    )
    cp = ("--parallelism.context_parallel_degree=2",)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, nproc=1, steps=8, seed=seed, extra=extra)
    run(resumed, nproc=2, steps=4, seed=seed, extra=(*extra, *cp, "--checkpoint.interval=2"))
    run(resumed, nproc=1, steps=6, seed=seed, extra=(*extra, "--checkpoint.interval=2"))
    run(resumed, nproc=2, steps=8, seed=seed, extra=(*extra, *cp))
    ref, got = losses(straight), losses(resumed)
    assert sorted(got) == list(range(1, 9))
    assert max(abs(got[s] - ref[s]) / ref[s] for s in ref) < 1e-5, (got, ref)

    def validation(dump: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
        return {row["step"]: row["validation_loss"] for row in rows if "validation_loss" in row}

    val_ref, val_got = validation(straight), validation(resumed)
    assert sorted(val_ref) == [1, 2, 4, 6, 8] and set(val_ref) <= set(val_got), (val_ref, val_got)
    # fp32 rounding of weights that differ by the training steps' rounding (1.3e-5 seen at step 8); a rank scoring
    # the wrong tokens or positions moves the held-out loss by more than 1e-2.
    assert max(abs(val_got[s] - val_ref[s]) / val_ref[s] for s in val_ref) < 5e-5, (val_got, val_ref)


def test_torchtitans_checkpoint_keys(tmp_path: Path, seed: Path) -> None:
    """enable_first_step_checkpoint, last_save_model_only + export_dtype, load_step, save_config_file,
    and a finished run started again."""
    dump = tmp_path / "run"
    # A flat lr after a warmup shorter than every run: the first steps of a longer run are those of a shorter one.
    base = (
        *TINY,
        "--training.global_batch_size=8",
        "--debug.deterministic",
        "--lr_scheduler.min_lr_factor=1.0",
        "--lr_scheduler.warmup_steps=2",
        f"--job.dump_folder={dump}",
        "--checkpoint.enable",
        "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=0",
        f"--checkpoint.initial_load_path={seed}",
    )
    straight = tmp_path / "straight"
    # Side by side (two_at_a_time): the run of this folder, and runs that read none of it.
    proc, straight_proc = two_at_a_time(
        lambda: python(
            "train.py",
            *base,
            "--training.steps=4",
            "--checkpoint.enable_first_step_checkpoint",
            "--checkpoint.last_save_model_only",
            "--checkpoint.export_dtype=bfloat16",
            "--job.save_config_file=configs/used.toml",
        ),
        lambda: python("train.py", *base, "--training.steps=6", f"--job.dump_folder={straight}"),
    )
    assert proc.returncode == 0, proc.stderr
    assert straight_proc.returncode == 0, straight_proc.stderr
    assert sorted(p.name for p in (dump / "checkpoint").glob("step-*")) == ["step-1", "step-2", "step-4"]
    saved = load_config(["--config", str(dump / "configs" / "used.toml")])  # its folder made as it was written
    assert (
        saved.checkpoint.last_save_model_only and saved.training.steps == 4 and saved.checkpoint.folder == "checkpoint"
    )
    last, earlier = verify(dump / "checkpoint" / "step-4"), verify(dump / "checkpoint" / "step-2")
    assert is_model_only(last) and not is_model_only(earlier)
    weights = [m for k, m in last.state_dict_metadata.items() if k.startswith("model_and_optimizer.model.")]
    assert weights and {m.properties.dtype for m in weights} == {torch.bfloat16}
    # Started again with the same steps: nothing to do. With more: the model-only save cannot resume. In a folder
    # with no checkpoint, or with checkpointing off, load_step has nothing to load: refused, not ignored.
    proc, new = two_at_a_time(
        lambda: python("train.py", *base, "--training.steps=4"),
        lambda: python(
            "train.py", *base, "--training.steps=8", "--checkpoint.load_step=3", f"--job.dump_folder={tmp_path}/new"
        ),
    )
    assert proc.returncode == 0 and "nothing to train" in proc.stdout, proc.stderr
    assert new.returncode == 2 and "has no step-3 (it has no checkpoint)" in new.stderr, new.stderr
    proc, off = two_at_a_time(
        lambda: python("train.py", *base, "--training.steps=6"),
        lambda: python("train.py", *TINY, "--checkpoint.load_step=3", f"--job.dump_folder={tmp_path}/off"),
    )
    assert proc.returncode == 2 and "holds the model weights only (checkpoint.last_save_model_only)" in proc.stderr
    assert (
        off.returncode == 2
        and "checkpoint.load_step: 3 resumes from a checkpoint, but checkpoint.enable is false" in off.stderr
    )
    # load_step picks the full checkpoint of step 2; the run goes on from there as a straight one would.
    proc = python("train.py", *base, "--training.steps=6", "--checkpoint.load_step=2")
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout and "step-2" in proc.stdout
    assert losses(dump) == losses(straight)
    proc = python("train.py", *base, "--training.steps=8", "--checkpoint.load_step=3")
    assert (
        proc.returncode == 2
        and "checkpoint.load_step: " in proc.stderr
        and "has no step-3 (it has steps 1, 2, 4, 6)" in proc.stderr
    )


def test_exclude_from_loading_restores_the_rest(tmp_path: Path, seed: Path) -> None:
    """exclude_from_loading = dataloader, train_state: the weights and optimizer of step 4, from step 1
    of the data again."""
    dump = tmp_path / "run"
    base = (
        *TINY,
        "--training.global_batch_size=8",
        f"--job.dump_folder={dump}",
        "--checkpoint.enable",
        f"--checkpoint.initial_load_path={seed}",
    )
    assert python("train.py", *base, "--training.steps=4").returncode == 0
    first = losses(dump)
    proc = python("train.py", *base, "--training.steps=2", "--checkpoint.exclude_from_loading=dataloader,train_state")
    assert proc.returncode == 0, proc.stderr
    assert "(not restored: dataloader, train_state)" in proc.stdout
    again = losses(dump)
    assert sorted(again) == [1, 2] and again[1] < first[1] - 0.1  # step 1's data, on trained weights


def test_sigterm_saves_a_checkpoint_and_exits_zero(tmp_path: Path, seed: Path) -> None:
    """SIGTERM to one rank only: all ranks agree to stop at the same step, save, exit 0."""
    dump = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        "train.py", *TINY, "--training.steps=100000", f"--job.dump_folder={dump}", "--checkpoint.enable",
        "--checkpoint.interval=100000",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (dump / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        workers = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        assert len(workers) == 2
        os.kill(int(workers[-1]), signal.SIGTERM)
        out, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    assert "SIGTERM: saved step" in out and "Traceback" not in err
    saved = [p.name for p in (dump / "checkpoint").glob("step-*")]
    assert len(saved) == 1 and saved[0].startswith("step-") and (dump / "checkpoint" / saved[0] / ".metadata").exists()


def test_ctrl_c_on_make_train_prints_the_ranks_line_only(tmp_path: Path) -> None:
    """Ctrl-C as a terminal sends it, to make's process group: the ranks save and stop, rank 0 says so, and neither
    the launcher (torchrun's SignalException) nor make ("*** [train] Interrupt") adds a line that reads as a crash."""
    dump = tmp_path / "run"
    args = " ".join([*TINY[2:], "--training.steps=100000", f"--job.dump_folder={dump}", "--checkpoint.enable"])
    cmd = ["make", "-o", "setup", "train", f"PY={sys.executable}", f"CONFIG={TINY[1]}", f"ARGS={args}"]
    make = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not (dump / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        os.killpg(make.pid, signal.SIGINT)
        out, err = make.communicate(timeout=120)
    finally:
        make.kill()
    # make ends on the signal after its child, as make does (a shell's 130); 0 where SIGINT was ignored from the start
    assert make.returncode in (0, -signal.SIGINT), err[-3000:]
    assert "SIGINT: saved step" in out, out[-3000:]
    assert "Traceback" not in err and "death signal" not in err and "make: ***" not in err, err[-3000:]


# ----------------------------------------------------------------- bad input


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--training.stepz=3"], "training.stepz: unknown key"),
        (["--training.steps=ten"], "training.steps: expected int"),
        (["--config", "configs/missing.toml"], "--config: one file only, got configs/debug.toml, configs/missing.toml"),
        (["--data.path=missing.jsonl"], "data.path: missing.jsonl not found"),
        (["--model.tokenizer_path=missing"], "model.tokenizer_path: missing not found"),
        (["--training.seq_len=4096"], "training.seq_len: 4096 exceeds the 2048 tokens"),
        (["--parallelism.data_parallel_shard_degree=2"], "but the world size is 1"),
        (["--model.flavor=llama3_9b"], "did you mean 'llama3_8b'"),
    ],
)
def test_bad_input_gets_one_line_and_exit_code_2(args: list[str], expected: str) -> None:
    """Refused by train.py's `main` before anything starts, with one problem: the CLI prints each problem as one
    `error: ` line and exits 2 (that path runs in a subprocess in the tests below; here, a launch per input would
    import torch again for each)."""
    from errors import ConfigError
    from train import main

    with pytest.raises(ConfigError) as e:
        main(["--config", "configs/debug.toml", *args])
    (problem,) = e.value.problems
    assert expected in f"error: {problem}"


def test_a_folder_that_is_not_a_checkpoint_gets_one_line_and_exit_code_2(tmp_path: Path) -> None:
    args = ("--config", "configs/debug.toml", "--checkpoint.initial_load_path=assets", f"--job.dump_folder={tmp_path}")
    line = one_line_error(python("train.py", *args))
    assert "checkpoint.initial_load_path: assets is not a DCP checkpoint" in line


def test_empty_dataset(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = one_line_error(
        python("train.py", "--config", "configs/debug.toml", f"--data.path={empty}", f"--job.dump_folder={tmp_path}")
    )
    assert "data.path" in line


def test_checkpoint_folder_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    fake = tmp_path / "step-3"
    fake.mkdir()
    (fake / ".metadata").write_text("not a checkpoint")
    line = one_line_error(
        python("train.py", *TINY, f"--checkpoint.initial_load_path={fake}", f"--job.dump_folder={tmp_path / 'run'}")
    )
    assert f"checkpoint.initial_load_path: {fake}/.metadata was refused unread" in line


def test_checkpoint_of_another_model_is_refused(seed: Path) -> None:
    from checkpoint import check_holds, verify
    from errors import ConfigError

    prefix, metadata = "model_and_optimizer.model.", verify(seed)
    check_holds(seed, metadata, {prefix + "norm.weight": torch.zeros(256)})
    with pytest.raises(ConfigError, match=r"1 weights missing, 0 of another shape, e.g. layers.99.ffn_norm.weight"):
        check_holds(seed, metadata, {prefix + "layers.99.ffn_norm.weight": torch.zeros(256)})
    with pytest.raises(ConfigError, match=r"0 weights missing, 1 of another shape, e.g. norm.weight"):
        check_holds(seed, metadata, {prefix + "norm.weight": torch.zeros(512)})


def test_error_under_torchrun_is_printed_once(tmp_path: Path) -> None:
    proc = torchrun(
        "train.py", "--config", "configs/debug.toml", "--data.path=missing.jsonl", nproc=2, check=False, launcher=True
    )
    assert proc.returncode != 0
    assert proc.stderr.count("error: data.path: missing.jsonl not found") == 1


def test_help_and_print_config(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from train import main

    assert main(["--help"]) == 0 and "--training.local_batch_size" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--config", "configs/debug.toml", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert 'flavor = "debugmodel"' in out
    # job.print_config says what a run does at start-up, not that nothing is printed; the TOML still loads
    assert "print_config = false  # at a run's start-up (--print-config prints it" in out
    assert tomllib.loads(out.partition("# derived")[0])["job"]["print_config"] is False
    assert "# parameters: 6,163,712" in out and "FLOPs per token" in out
    # local batch 8 x 2 data-parallel ranks x 256 tokens
    assert "# tokens per step: 4,096 (global batch 16 x seq_len 256; data-parallel degree 2, world size 2" in out
    # Without WORLD_SIZE the plan says which world it assumed: the smallest the degrees fit (TP 8 for 70B).
    monkeypatch.delenv("WORLD_SIZE")
    assert main(["--config", "configs/llama3_70b.toml", "--print-config"]) == 0
    assert "data-parallel degree 1, assuming world size 8, the smallest the parallel degrees fit" in (
        capsys.readouterr().out
    )
    # Mode "auto": its choice for this machine's ranks; without CUDA and without a budget, one line naming the key.
    auto = ["--config", "configs/debug.toml", "--activation_checkpoint.mode=auto", "--print-config"]
    assert main([*auto, "--activation_checkpoint.memory_budget_gib=4"]) == 0
    assert "# activation_checkpoint.mode = auto: blocks no AC 0-5; estimated peak" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"^activation_checkpoint.memory_budget_gib: mode = \"auto\" fits the job"):
        main(auto)


def test_the_banners_description_says_what_the_command_line_changed() -> None:
    """job.description is the TOML's; a key the command line sets may contradict it (a chat corpus for "shipped
    synthetic corpus"), so the banner says which. The job's own keys (its folder) contradict nothing."""
    from train import described

    text = "Llama 3 debug model, shipped synthetic corpus"
    assert described(text, ["data.path", "data.chat"]) == (
        f"{text} (the config's description; the command line changes data.path, data.chat)"
    )
    assert described(text, ["job.dump_folder"]) == described(text, []) == text
    assert described("mine", ["job.description", "data.path"]) == "mine"


def test_the_command_users_type_works_from_any_folder(tmp_path: Path) -> None:
    """`path/to/train.py --config llama3_8b.toml` from another folder finds configs/llama3_8b.toml and its assets."""
    assets = ["--model.tokenizer_path=assets/tokenizer", "--data.path=assets/corpus/stories.jsonl"]  # relative
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--config", "llama3_8b.toml", *assets, "--print-config"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert 'flavor = "llama3_8b"' in proc.stdout and "# parameters: 8,030,261,248" in proc.stdout
    assert f'path = "{REPO / "assets/corpus/stories.jsonl"}"' in proc.stdout
