"""`make bench`: what each fix buys, every number measured in this run; one table and one chart.

    python -m benchmarks.run                      # every benchmark (on 2 CPU cores: docs/benchmarks.md#make-bench)
    python -m benchmarks.run --only memory comm_volume
    python -m benchmarks.run --only dpo_format    # a part make bench leaves out (OPT_IN; also distill, lora)
    python -m benchmarks.run --train-rows         # also tokens/s of FSDP vs + compile vs + op SAC
    python -m benchmarks.run --plot-only          # the table and chart again from <out>/bench.json

Each benchmark runs in a process of its own (`python -m benchmarks.<name> --out <out>/<name>.json`
and the FLAGS below; the multi-process ones start torchrun themselves) and its module's `rows()` turns
that JSON into `Row`s: a problem of docs/failures.md, a metric, its value on the broken setup and on the fix.
This script prints them as one table and writes `<out>/bench.json` (the rows and every
benchmark's results) and `<out>/bench.png`: one panel per problem, showing the headline metric
(the first one its rows() returns) for each setup of those rows, broken and fixed in two colors, and
under it the row's note where the bars alone would mislead (block-causal attention: the fix is the slower side
on CPU).

While it measures it prints one line as each part starts (`part 3/13 comm_volume: starting | elapsed 0m36s |
estimated rest 9m40s`) and one as it ends, nothing else: a part's own output goes to `<out>/<name>.log`, and
the end of that log is shown when the part fails.

On a machine with CUDA the train rows run by default, on the largest flavor that fits one GPU;
on CPU they use the debug model and are off unless asked for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import (
    async_tp_fusion,
    checkpoint_checksums,
    comm_volume,
    compile_cache,
    context_parallel,
    data_pipeline,
    distill,
    distill_memory,
    dpo_format,
    float8,
    generation,
    gpu_costs,
    harness,
    lora,
    memory,
    metadata,
    moe_balance,
    muon,
    recompute,
    vs_torchtitan,
)
from benchmarks.harness import Row
from config import REPO

BENCHMARKS = {
    m.__name__.removeprefix("benchmarks."): m
    for m in (
        recompute,
        metadata,
        comm_volume,
        compile_cache,
        async_tp_fusion,
        memory,
        distill_memory,
        muon,
        moe_balance,
        dpo_format,
        distill,
        lora,
        context_parallel,
        data_pipeline,
        float8,
        gpu_costs,
        generation,
        vs_torchtitan,
        checkpoint_checksums,
    )
}


# Each part's expected wall seconds on 2 idle CPU cores (a Python loop of 10^7 additions in about 0.7 s): the
# progress lines' estimate of the rest, scaled by how the run is going. "train" is --train-rows' part on CPU.
SECONDS = {
    "recompute": 20, "metadata": 12, "comm_volume": 28, "compile_cache": 66, "async_tp_fusion": 40, "memory": 30,
    "distill_memory": 34, "muon": 18, "moe_balance": 8, "dpo_format": 300, "distill": 720, "lora": 380, "context_parallel": 40, "data_pipeline": 30, "float8": 11,
    "gpu_costs": 18, "generation": 45, "vs_torchtitan": 300, "checkpoint_checksums": 20, "train": 150,
}  # fmt: skip
# Parts that run only when named with --only: together with the rest they would not fit make bench's 12 minutes.
# dpo_format makes its own chat model and trains it twice through train.py (about 5 minutes on 2 cores); distill
# trains a teacher (or takes --teacher) and four students (about 12 minutes); lora fine-tunes make train's model 6
# times (about 6 minutes).
OPT_IN = ("dpo_format", "distill", "lora")
# make bench's settings where they are not the benchmark's own defaults, so that the whole run stays within 12
# minutes on 2 cores (docs/benchmarks.md#make-bench): fewer tokens, rounds, steps or megabytes than a run of the
# benchmark alone. Every row stays, and each timed comparison still alternates its sides within the run.
FLAGS = {
    # Most of this part is the 126M model's no-cache decode: a forward over the whole sequence per new token.
    "generation": ["--new-tokens", "32", "--rounds", "2"],
    # A round is 10 launches of 2 ranks (5 layouts x 2 trainers, which go first in turn); steps 3 and 4 are timed.
    "vs_torchtitan": ["--rounds", "2", "--steps", "4"],
    # The corpus tokenized with 1 and with 2 workers; the timed steps of causal vs block-causal attention.
    "data_pipeline": ["--mb", "20", "--attn-steps", "3"],
    # The plain state dict saved and loaded with and without checksums.
    "checkpoint_checksums": ["--gib", "0.5"],
}


def run_benchmark(name: str, out: Path, *, log: Path | None = None) -> dict[str, Any]:
    """`python -m benchmarks.<name>` with make bench's FLAGS (its output appended to `log`, or passed through); the
    results it wrote."""
    path = out / f"{name}.json"
    proc = harness.run_python("-m", f"benchmarks.{name}", "--out", str(path), *FLAGS.get(name, []), log=log)
    if proc.returncode != 0:
        raise SystemExit(f"benchmarks.{name} exited with status {proc.returncode}")
    return harness.read_results(path)


# --------------------------------------------------------------------- train rows


def run_train(out: Path, *, cuda: bool, rehearse: bool = False, log: Path | None = None) -> dict[str, Any]:
    """tokens/s, MFU and peak memory of FSDP vs + compile vs + op SAC, 20 steps each through train.py.

    rehearse: the same runs at a tiny shape, 3 steps each, on one process and without compile (`make bench-gpu
    --rehearse`, benchmarks/gpu_run.py: compiling on CPU would cost ~30 s per variant and measure nothing).
    log: where train.py's output goes (appended), instead of passing through.
    """
    steps, warm = (3, 1) if rehearse else (20, 5)
    if rehearse:
        flavor, seq_len, nproc = "debugmodel", 32, 1
        common = ["--training.mixed_precision_param=float32", "--training.local_batch_size=2"]
        print("rehearsal: train rows run without --compile.enable (compile is not timed on CPU)", flush=True)
    elif cuda:
        # The largest flavor whose FSDP(1) state (16 bytes per parameter) leaves room on one GPU.
        flavor, seq_len, nproc = "llama3_1b", 2048, 1
        common = ["--training.mixed_precision_param=bfloat16", "--training.local_batch_size=4"]
    else:
        flavor, seq_len, nproc = "debugmodel", 256, 2
        common = ["--training.mixed_precision_param=float32", "--training.local_batch_size=8"]
    variants = {
        "fsdp": [],
        "fsdp_compile": ["--compile.enable"],
        "fsdp_compile_sac": ["--compile.enable", "--activation_checkpoint.mode=selective"],
    }
    if rehearse:
        variants = {name: [a for a in extra if a != "--compile.enable"] for name, extra in variants.items()}
    results = {}
    for name, extra in variants.items():
        dump = out / "train" / name
        (dump / "metrics.jsonl").unlink(missing_ok=True)  # metrics.jsonl appends
        proc = harness.run_python(
            "train.py",
            "--config",
            "configs/debug.toml",
            f"--model.flavor={flavor}",
            f"--training.seq_len={seq_len}",
            f"--training.steps={steps}",
            "--metrics.log_freq=1",
            "--validation.enable=false",
            "--eval.enable=false",
            "--checkpoint.enable=false",  # a 1B run's last-step save would write 12 GiB and time nothing
            f"--job.dump_folder={dump}",
            "--job.save_config_file=config.toml",  # what the run trained with, for the estimator (train_rows)
            *common,
            *extra,
            nproc=nproc,
            log=log,
        )
        if proc.returncode != 0:
            raise SystemExit(f"train.py ({name}) exited with status {proc.returncode}")
        rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
        timed = [row for row in rows if "tps" in row][warm:]  # training rows, warm
        results[name] = {
            "tps": statistics.median(s["tps"] for s in timed),
            "mfu": statistics.median(s["mfu"] for s in timed) if timed[0]["mfu"] is not None else None,
            "memory_gib": max(s["memory_gib"] for s in timed),
            "flavor": flavor,
            "seq_len": seq_len,
            "local_batch_size": int(common[1].rsplit("=", 1)[1]),
            "nproc": nproc,
            "param_dtype": common[0].rsplit("=", 1)[1],
            "ac": "selective-op" if "--activation_checkpoint.mode=selective" in extra else "none",
            "config": str(dump / "config.toml"),
        }
    return {"device": "cuda" if cuda else "cpu", "variants": results}


def train_rows(results: dict[str, Any]) -> list[Row]:
    runs = results["variants"]
    rows = [
        Row(problem="throughput", metric="tokens/s per device", unit="tok/s", broken="FSDP",
            broken_value=runs["fsdp"]["tps"], fixed=label, fixed_value=runs[key]["tps"])
        for key, label in (("fsdp_compile", "+ compile"), ("fsdp_compile_sac", "+ compile + op SAC"))
    ]  # fmt: skip
    if all(run["memory_gib"] for run in runs.values()):
        rows.append(
            Row(
                problem="throughput",
                metric="peak memory",
                unit="GiB",
                broken="FSDP",
                broken_value=runs["fsdp"]["memory_gib"],
                fixed="+ compile + op SAC",
                fixed_value=runs["fsdp_compile_sac"]["memory_gib"],
            )
        )
    return rows


# -------------------------------------------------------------------------- table


def format_table(rows: list[Row]) -> str:
    """One line per row, each column as wide as its longest cell; ratio = fixed / broken."""
    head = ("problem", "metric", "unit", "broken", "value", "fixed", "value", "ratio")
    cells = [head, *((r.problem, r.metric, r.unit, r.broken, f"{r.broken_value:.4g}", r.fixed, f"{r.fixed_value:.4g}",
                      f"{r.ratio:.3f}x") for r in rows)]  # fmt: skip
    widths = [max(map(len, column)) for column in zip(*cells, strict=True)]
    numbers = {4, 6, 7}  # right-aligned
    lines = [
        " ".join(c.rjust(w) if i in numbers else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        for line in cells
    ]
    notes = [f"note, {r.problem}: {' '.join(r.note.splitlines())}" for r in rows if r.note]
    return "\n".join([lines[0], "-" * len(lines[0]), *(line.rstrip() for line in lines[1:]), *notes])


# -------------------------------------------------------------------------- chart

BROKEN_COLOR, FIXED_COLOR = "#D55E00", "#0072B2"  # vermillion and blue: distinct for colour-blind readers too


@dataclass(frozen=True)
class Bar:
    label: str
    value: float
    broken: bool


@dataclass(frozen=True)
class Panel:
    problem: str
    metric: str
    unit: str
    bars: list[Bar]
    note: str = ""  # under the bars: what they alone would mislead about (harness.Row.note)


def panels(rows: list[Row]) -> list[Panel]:
    """Per problem, in order: its headline metric (its first row's) and the distinct setups of that metric.

    A setup that is never anyone's fix is broken (or the baseline); broken setups come first, then
    the fixes in the order the rows name them: #5's staircase, #3's FULL_SHARD, replication, HSDP.
    """
    out = []
    for problem in dict.fromkeys(r.problem for r in rows):
        headline = [r for r in rows if r.problem == problem]
        headline = [r for r in headline if r.metric == headline[0].metric]
        fixes = {r.fixed for r in headline}
        values: dict[str, float] = {}
        for r in headline:
            values.setdefault(r.broken, r.broken_value)
            values.setdefault(r.fixed, r.fixed_value)
        bars = [Bar(label, value, broken=label not in fixes) for label, value in values.items()]
        bars.sort(key=lambda bar: not bar.broken)  # stable: the order within each kind stays
        note = next((r.note for r in headline if r.note), "")
        out.append(Panel(problem, headline[0].metric, headline[0].unit, bars, note))
    return out


def _value_text(value: float, unit: str) -> str:
    if abs(value) >= 1000:
        number = f"{value:,.0f}"
    else:
        number = f"{value:.0f}" if float(value).is_integer() else f"{value:.3g}"
    return f"{number} {unit}" if unit else number


def draw_panel(ax: Any, panel: Panel) -> None:
    """One bar per setup, first on top, its label above it and its value after it (a 0 as a tick at the axis)."""
    top = max((bar.value for bar in panel.bars), default=0) or 1.0
    for y, bar in enumerate(panel.bars):
        color = BROKEN_COLOR if bar.broken else FIXED_COLOR
        ax.barh(y, bar.value, height=0.5, color=color)
        if bar.value == 0:  # no bar to see: a tick at the axis shows that it was measured
            ax.plot([0, 0], [y - 0.25, y + 0.25], color=color, linewidth=6, solid_capstyle="butt")
        ax.annotate(
            _value_text(bar.value, panel.unit),
            (bar.value, y),
            xytext=(6, 0),
            textcoords="offset points",
            va="center",
            fontsize=13,
            fontweight="bold",
        )
        ax.text(0, y - 0.3, bar.label, va="bottom", fontsize=12)
    ax.set_ylim(len(panel.bars) - 0.5, -0.95)  # inverted: the first setup on top, with room for its label
    ax.set_xlim(0, top * 1.6)  # room for the value after the longest bar
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    # The metric in up to two lines under the title; the title's pad keeps room for two.
    metric = textwrap.fill(f"{panel.metric} ({panel.unit})" if panel.unit else panel.metric, 40)
    ax.text(0, 1.02, metric, transform=ax.transAxes, va="bottom", fontsize=12, color="0.3")
    ax.set_title(panel.problem, loc="left", fontsize=15, fontweight="bold", pad=42)
    if panel.note:  # in the gap above the next row's title: two lines fit
        note = "\n".join(textwrap.fill(line, 48) for line in panel.note.splitlines())
        ax.text(0, -0.02, note, transform=ax.transAxes, va="top", fontsize=11, color="0.3")


def plot(rows: list[Row], path: Path) -> None:
    """A grid of `panels(rows)`, 3 per row, sized to be read at ~900 px wide (e.g. in the README)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    chart = panels(rows)
    ncols = 3
    nrows = -(-len(chart) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(12, 4.4 * nrows + 0.6), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < len(chart):
            draw_panel(ax, chart[i])
        else:
            ax.axis("off")
    legend = [Patch(color=BROKEN_COLOR, label="broken (or baseline)"), Patch(color=FIXED_COLOR, label="fixed")]
    fig.legend(handles=legend, loc="upper right", bbox_to_anchor=(0.985, 1.0), ncol=2, fontsize=13, frameon=False)
    fig.suptitle("What each fix buys (make bench, one run)", x=0.015, y=0.985, ha="left", fontsize=16)
    fig.subplots_adjust(
        left=0.015, right=0.985, bottom=0.01, top=1 - 1.25 / fig.get_figheight(), wspace=0.12, hspace=0.42
    )
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def run_part(name: str, out: Path, *, cuda: bool, log: Path) -> tuple[dict[str, Any], list[Row]]:
    """One part of `make bench` (a benchmark, or "train": the train rows), its output in `log`: results and rows."""
    if name == "train":
        results = run_train(out, cuda=cuda, log=log)
        return results, train_rows(results)
    results = run_benchmark(name, out, log=log)
    return results, BENCHMARKS[name].rows(results)


def tail(log: Path, lines: int = 40) -> str:
    """The last `lines` lines of a part's log: a failing part's error, shown without the minutes of its output."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    return "\n".join(text.splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "outputs" / "bench")
    p.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run only these benchmarks")
    p.add_argument(
        "--train-rows",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tokens/s rows through train.py (default: on with CUDA)",
    )
    p.add_argument("--plot-only", action="store_true", help="measure nothing: table and chart from <out>/bench.json")
    args = p.parse_args(argv)
    bench_json = args.out / "bench.json"
    if args.plot_only and not bench_json.is_file():
        print(f"error: --plot-only: {bench_json} not found; run `make bench` first (or pass --out)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)

    if args.plot_only:
        rows = [Row.from_json(r) for r in json.loads(bench_json.read_text())["rows"]]
    else:
        cuda = torch.cuda.is_available()
        names = list(args.only or (name for name in BENCHMARKS if name not in OPT_IN))
        if args.train_rows if args.train_rows is not None else cuda:
            names.append("train")
        progress = harness.Progress({name: SECONDS[name] for name in names})
        print(f"make bench: {len(names)} parts, about {harness.clock(sum(progress.expected.values()))} on 2 idle CPU "
              f"cores; each part's output goes to {args.out}/<part>.log", flush=True)  # fmt: skip
        rows, raw = [], {}
        for name in names:
            log = args.out / f"{name}.log"
            log.unlink(missing_ok=True)  # each of the part's processes appends to it
            progress.start(name)
            try:
                raw[name], part = run_part(name, args.out, cuda=cuda, log=log)
            except SystemExit:
                progress.say(name, f"FAILED after {progress.finish(name):.0f}s; the end of {log}:")
                print(tail(log), file=sys.stderr, flush=True)
                raise
            progress.say(name, f"done in {progress.finish(name):.0f}s, {len(part)} rows (estimate {SECONDS[name]}s)")
            rows += part
        bench_json.write_text(json.dumps({"rows": [r.to_json() for r in rows], "raw": raw}, indent=1) + "\n")

    print("\n" + format_table(rows))
    plot(rows, args.out / "bench.png")
    print(f"\nwrote {bench_json} and {args.out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
