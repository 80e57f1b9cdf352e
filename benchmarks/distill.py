"""Distillation (distill.py, configs/debug_distill.toml): the held-out loss of a 2-block student trained with make
train's model as its teacher against the same student on labels alone, and what the teacher costs a step.

    python -m benchmarks.distill --out outputs/bench/distill.json
    python -m benchmarks.distill --teacher outputs/debug/checkpoint/step-100    # make train's model (else made here)

One run, on 2 CPU ranks (gloo), every model through train.py: the teacher (`--teacher`, or the debug model trained
here as make train trains it, `--teacher-steps` steps), then the 2-block student (flavor debugmodel_2layers) trained
`--steps` steps four times, in this order: from random init on labels alone (distill.enable = false) and with the
teacher (kd_ratio 0.5, the forward KL), then from the teacher's own blocks 0 and 5 (scripts/prune.py --layers 0,5) on
labels alone and with the teacher. The same data in the same order for all four, and the teacher's held-out loss on
the same validation data.

    held-out loss     validation at the last step (assets/corpus/stories_validation.jsonl, 40,960 tokens)
    step time         the median step of the logged steps after the first (each run's own log); the sides alternate
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import Row

PROBLEM = "distillation"
STARTS = ("random", "pruned")
SIDES = {"labels": ["--distill.enable=false"], "teacher": []}  # broken (no teacher), fixed


def train(dump: Path, extra: list[str], *, args: argparse.Namespace, config: str) -> list[dict[str, Any]]:
    """train.py on `args.nproc` ranks into `dump`; its metrics.jsonl rows."""
    (dump / "metrics.jsonl").unlink(missing_ok=True)  # metrics.jsonl appends
    proc = harness.run_python(
        "train.py", "--config", config, f"--job.dump_folder={dump}", f"--training.steps={args.steps}",
        f"--validation.freq={args.steps}", "--metrics.log_freq=1", f"--data.cache_folder={dump.parent / 'cache'}",
        *extra, nproc=args.nproc,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"train.py ({dump.name}) exited with status {proc.returncode}")
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def held_out(metrics: list[dict[str, Any]]) -> float:
    return [m["validation_loss"] for m in metrics if "validation_loss" in m][-1]


def step_ms(metrics: list[dict[str, Any]]) -> float:
    return 1000 * statistics.median(m["step_time_s"] for m in metrics if "loss" in m and m["step"] > 1)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    work = args.out.parent / "distill"
    work.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    teacher = args.teacher
    if teacher is None:  # make train's model, made here
        train(work / "teacher", [f"--training.steps={args.teacher_steps}"], args=args, config="configs/debug.toml")
        teacher = work / "teacher" / "checkpoint" / f"step-{args.teacher_steps}"
    shutil.rmtree(work / "student", ignore_errors=True)  # pruned anew from this teacher
    proc = harness.run_python("scripts/prune.py", "--from", str(teacher), "--to", str(work / "student"), "--layers",
                              "0,5", "--dtype", "float32")  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"scripts/prune.py exited with status {proc.returncode}")
    pruned = [f"--checkpoint.initial_load_path={work / 'student'}", "--checkpoint.initial_load_in_hf"]
    common = [f"--distill.teacher_path={teacher}", "--checkpoint.enable=false"]
    runs: dict[str, dict[str, Any]] = {}
    for start in STARTS:
        for side, extra in SIDES.items():
            metrics = train(work / f"{start}_{side}", [*common, *extra, *(pruned if start == "pruned" else [])],
                            args=args, config="configs/debug_distill.toml")  # fmt: skip
            runs[f"{start}_{side}"] = {"held_out": held_out(metrics), "step_ms": step_ms(metrics),
                                       "kd_loss": [m["kd_loss"] for m in metrics if "kd_loss" in m][-1:]}  # fmt: skip
    # The teacher's held-out loss on the same tokens: eval.py on as many ranks scores what validation did.
    scored = harness.run_python("eval.py", "--checkpoint", str(teacher), nproc=args.nproc, capture=True)
    if scored.returncode != 0:
        raise SystemExit(f"eval.py exited with status {scored.returncode}: {scored.stderr[-2000:]}")
    teacher_loss = float(scored.stdout.split("| loss ")[1].split()[0])
    return {
        "settings": {"steps": args.steps, "nproc": args.nproc, "teacher": str(teacher)},
        "teacher_held_out": teacher_loss,
        "runs": runs,
        "seconds": time.perf_counter() - begin,
    }


def rows(results: dict[str, Any]) -> list[Row]:
    r, steps = results["runs"], results["settings"]["steps"]

    def row(metric: str, key: str, start: str, unit: str = "") -> Row:
        return Row(PROBLEM, metric, unit, "labels alone", r[f"{start}_labels"][key], "with the teacher",
                   r[f"{start}_teacher"][key])  # fmt: skip

    return [
        row(f"held-out loss at step {steps}, 2-block student from random init", "held_out", "random"),
        row(f"held-out loss at step {steps}, 2-block student pruned from the teacher", "held_out", "pruned"),
        row("step time (2-block student, 6-block teacher)", "step_ms", "random", "ms"),
    ]


def table(results: dict[str, Any]) -> str:
    s, r = results["settings"], results["runs"]
    lines = [f"teacher {s['teacher']}: held-out loss {results['teacher_held_out']:.4f}; student {s['steps']} steps on "
             f"{s['nproc']} ranks; {results['seconds']:.0f} s"]  # fmt: skip
    for name, run in r.items():
        kd = f", kd_loss {run['kd_loss'][0]:.4f}" if run["kd_loss"] else ""
        lines.append(f"{name}: held-out loss {run['held_out']:.4f}, step {run['step_ms']:.0f} ms{kd}")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--teacher", type=Path, help="the teacher's step folder (default: the debug model trained here)")
    p.add_argument("--teacher-steps", type=int, default=100, help="steps of the teacher made here (make train's)")
    p.add_argument("--steps", type=int, default=100, help="steps of each student run")
    p.add_argument("--nproc", type=int, default=2, help="ranks of each train.py run")


def main(argv: list[str] | None = None) -> int:
    return harness.main("distill", argv, doc=__doc__, add_args=add_args, measure=measure, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
