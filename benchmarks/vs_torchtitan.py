"""This recipe and torchtitan 0.2.2's own Trainer, side by side: tokens/s and peak memory per device.

    python -m benchmarks.vs_torchtitan --out outputs/bench/vs_torchtitan.json [--rounds 3] [--steps 8]

Both trainers read one TOML, torchtitan's own debug_model.toml (tests/torchtitan/), in a working
folder laid out as torchtitan's repository expects (tests/assets/tokenizer: the shipped tokenizer;
tests/assets/c4_test: the shipped corpus), with the same command-line overrides: the model shape,
optimizer, schedule, batch shapes, settings and data source are one file's. torchtitan runs
unchanged through tests/torchtitan_trainer.py (what it needs on CPU is said there). Layouts:

    fsdp2                  FSDP 2 (AC on every 2nd block, as the TOML has it)
    tp2                    TP 2 with loss parallel
    fsdp2_compile_op_sac   FSDP 2 + compile + op SAC

On CPU: 2 ranks, float32, seq_len 256, local batch 8. With CUDA the TOML's own bf16 and seq_len
2048, on 2 GPUs, or on 1 where the machine has one (`--nproc 1`, TP 2 left out: this recipe then
shards over one rank, torchtitan applies no FSDP and trains under autocast, so the two do not run
the same thing). A round runs both trainers once per layout, which goes first alternating from round to round (a busy machine slows both alike); a run's tokens/s per device
is the median of its steps after the first two (lazy initialization, compilation), its memory the
peak. A row: the median over rounds of each side, and the median and spread (min - max) of the
per-round ratio ours / torchtitan's. Both trainers start through benchmarks/count_kernels.py, which
counts the kernels of one untimed step, GPU launches on a GPU (the same in every round): the ops an eager
step dispatches, or the launches of a compiled one. The two trainers do not read their documents in the same
order (torchtitan packs a streamed dataset, this recipe reads windows of one token stream), so their
losses are close, not equal; both are printed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.count_kernels import COUNTED_STEP
from benchmarks.harness import Row
from tests.torchtitan_trainer import user_folder

PROBLEM = "vs torchtitan"
LAYOUTS = {
    "fsdp2": [],
    "tp2": ["--parallelism.tensor_parallel_degree=2"],
    "fsdp2_compile_op_sac": ["--compile.enable", "--activation_checkpoint.selective_ac_option=op"],
}
LABELS = {"fsdp2": "FSDP {n}", "tp2": "TP 2", "fsdp2_compile_op_sac": "FSDP {n} + compile + op SAC"}  # n: ranks
NEEDS_RANKS = {"tp2": 2}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TITAN_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")


def dump_folder(folder: Path, trainer: str, layout: str) -> Path:
    return folder / "outputs" / f"{trainer}-{layout}"


def trainer_args(trainer: str, layout: str, *, folder: Path, steps: int, cuda: bool) -> list[str]:
    """The command-line arguments both trainers get in `folder` (user_folder): the TOML and the same overrides."""
    dump = dump_folder(folder, trainer, layout)
    shutil.rmtree(dump, ignore_errors=True)
    shape = [] if cuda else ["--training.seq_len=256", "--training.mixed_precision_param=float32"]
    args = ["--job.config_file", "debug_model.toml", f"--training.steps={steps}", "--metrics.log_freq=1",
            f"--job.dump_folder={dump}", *shape, *LAYOUTS[layout]]  # fmt: skip
    if trainer == "recipe":
        args.append(f"--data.cache_folder={folder / 'token-cache'}")  # this recipe's key: raw data prepared once
    return args


def compiled(layout: str) -> bool:
    return "--compile.enable" in LAYOUTS[layout]


def step_kind(layout: str) -> str:
    return "compiled" if compiled(layout) else "eager"


def label(layout: str, nproc: int) -> str:
    return LABELS[layout].format(n=nproc)


def run(trainer: str, layout: str, *, folder: Path, steps: int, cuda: bool, nproc: int) -> dict[str, Any]:
    """One run of `trainer` ("recipe" or "torchtitan"): tokens/s per device, peak memory, losses by step."""
    args = trainer_args(trainer, layout, folder=folder, steps=steps, cuda=cuda)
    dump = dump_folder(folder, trainer, layout)
    kernels = folder / f"kernels-{trainer}-{layout}.json"
    entry = ["-m", "benchmarks.count_kernels", trainer, str(kernels)]  # one step's kernels, outside the timed steps
    proc = harness.run_python(*entry, *args, nproc=nproc, capture=True, cwd=folder)
    if proc.returncode != 0:
        raise SystemExit(f"{trainer} ({layout}) exited with status {proc.returncode}:\n{proc.stderr[-4000:]}")
    if trainer == "recipe":
        rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
        steps_ = {r["step"]: (r["loss"], r["tps"], r["memory_gib"]) for r in rows if "tps" in r}
    else:  # every rank logs; the first line of each step is kept
        steps_ = {}
        for m in _TITAN_STEP.finditer(_ANSI.sub("", proc.stdout + proc.stderr)):
            steps_.setdefault(int(m[1]), (float(m[2]), float(m[4].replace(",", "")), float(m[3])))
    if sorted(steps_) != list(range(1, steps + 1)):
        raise SystemExit(f"{trainer} ({layout}): expected steps 1..{steps} in its log, found {sorted(steps_)}")
    warm = [steps_[s] for s in range(3, steps + 1)]
    return {
        "tps": statistics.median(t for _, t, _ in warm),
        "memory_gib": max(m for _, _, m in warm),
        "losses": [steps_[s][0] for s in range(1, steps + 1)],
        "kernels": json.loads(kernels.read_text()) if kernels.exists() else None,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    nproc = args.nproc or (min(2, torch.cuda.device_count()) if cuda else 2)
    layouts = [layout for layout in args.layouts if NEEDS_RANKS.get(layout, 1) <= nproc]
    for layout in sorted(set(args.layouts) - set(layouts)):
        print(f"{layout}: left out, it needs {NEEDS_RANKS[layout]} ranks and this run has {nproc}", flush=True)
    with tempfile.TemporaryDirectory(prefix="vs-torchtitan-") as tmp:
        folder = user_folder(Path(tmp))
        runs: dict[str, dict[str, list]] = {layout: {"recipe": [], "torchtitan": []} for layout in layouts}
        for round_ in range(args.rounds):
            for layout in layouts:
                order = ["recipe", "torchtitan"] if round_ % 2 == 0 else ["torchtitan", "recipe"]
                for trainer in order:
                    runs[layout][trainer].append(
                        run(trainer, layout, folder=folder, steps=args.steps, cuda=cuda, nproc=nproc)
                    )
                    print(
                        f"round {round_ + 1} {layout} {trainer}: {runs[layout][trainer][-1]['tps']:,.0f} tokens/s",
                        flush=True,
                    )
    results: dict[str, Any] = {
        "device": "cuda" if cuda else "cpu", "nproc": nproc, "rounds": args.rounds, "steps": args.steps,
    }  # fmt: skip
    for layout, sides in runs.items():
        ratios = [
            ours["tps"] / theirs["tps"] for ours, theirs in zip(sides["recipe"], sides["torchtitan"], strict=True)
        ]
        results[layout] = {
            **{f"{side}_tps": statistics.median(r["tps"] for r in rs) for side, rs in sides.items()},
            **{f"{side}_memory_gib": statistics.median(r["memory_gib"] for r in rs) for side, rs in sides.items()},
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            **{f"{side}_losses": rs[0]["losses"] for side, rs in sides.items()},
        }  # fmt: skip
        ours, theirs = sides["recipe"][0]["kernels"], sides["torchtitan"][0]["kernels"]
        if ours and theirs:  # the same in every round
            mine, peer = Counter(ours["by_op"]), Counter(theirs["by_op"])
            results[layout] |= {
                "recipe_kernels": ours["kernels"], "torchtitan_kernels": theirs["kernels"],
                "kernels_more_here": dict((mine - peer).most_common()), "kernels_fewer_here": dict((peer - mine).most_common()),
            }  # fmt: skip
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    def row(metric: str, unit: str, key: str) -> Row:
        return Row(PROBLEM, metric, unit, "torchtitan 0.2.2", r[f"torchtitan_{key}"], "this recipe", r[f"recipe_{key}"])

    out = []
    for layout in LABELS:
        if (r := results.get(layout)) is None:
            continue
        name = label(layout, results["nproc"])
        # The ratio column divides the two medians; the per-round ratios (each run against the one beside it)
        # are the comparison, and the metric carries their median and spread.
        paired = f"per round {r['ratio']:.3f}x ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})"
        out.append(row(f"tokens/s per device, {name}; {paired}", "tok/s", "tps"))
        if "recipe_kernels" in r:
            what = "launches but views" if compiled(layout) else "ops dispatched but views"
            out.append(
                row(f"kernels per {step_kind(layout)} step ({what}, step {COUNTED_STEP}), {name}", "ops", "kernels")
            )
        out.append(row(f"peak memory per device, {name}", "GiB", "memory_gib"))
    return out


def table(results: dict[str, Any]) -> str:
    lines = [
        f"this recipe vs torchtitan 0.2.2 ({results['device']}, {results['nproc']} ranks, {results['rounds']} rounds, "
        "alternated):"
    ]
    for layout in LABELS:
        if (r := results.get(layout)) is None:
            continue
        name = label(layout, results["nproc"])
        lines.append(
            f"  {name:<26} tokens/s {r['recipe_tps']:>9,.0f} vs {r['torchtitan_tps']:>9,.0f}  ratio {r['ratio']:.3f}x "
            f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f})  memory {r['recipe_memory_gib']:.2f} vs "
            f"{r['torchtitan_memory_gib']:.2f} GiB  losses {r['recipe_losses'][-1]:.4f} vs {r['torchtitan_losses'][-1]:.4f}"
        )
        if "recipe_kernels" in r:
            more = ", ".join(f"{op} +{n}" for op, n in r["kernels_more_here"].items())
            fewer = ", ".join(f"{op} -{n}" for op, n in r["kernels_fewer_here"].items())
            lines.append(
                f"  {'':<26} kernels per {step_kind(layout)} step {r['recipe_kernels']} vs {r['torchtitan_kernels']}: "
                f"{'; '.join(part for part in (more, fewer) if part) or 'the same ops'}"
            )
    return "\n".join(lines)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="runs of each trainer per layout, alternated")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (the first two are not timed)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument(
        "--nproc", type=int, choices=(1, 2), help="ranks per run (default: 2, or 1 on a machine with one GPU)"
    )


def main(argv: list[str] | None = None) -> int:
    return harness.main("vs_torchtitan", argv, doc=__doc__ or "", add_args=add_args, measure=measure, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
