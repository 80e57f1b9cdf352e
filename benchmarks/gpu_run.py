"""`make bench-gpu`: one prepared run on one GPU, about 10 minutes with its compiles, its parts in priority order.

    python -m benchmarks.gpu_run                          # every part, on the GPU of this machine
    python -m benchmarks.gpu_run --minutes 8              # skip (saying so) the parts that will not fit in 8 minutes
    python -m benchmarks.gpu_run --only train_rows decode # these parts
    python -m benchmarks.gpu_run --rehearse               # every part on CPU at tiny shapes, through the same code

Each part is a benchmark of its own, `python -m benchmarks.<module> --out <out>/<part>.json [flags]`
(benchmarks/harness.py), whose module's `rows()` turns its JSON into rows. After every part, finished, failed or
skipped, the runner rewrites `<out>/gpu_run.json` (the machine, the versions, every part so far and its rows) and
`<out>/gpu_run.md` (the same as markdown tables): a run cut short keeps what it measured. A part that fails is
reported with its exit status and the run goes on; the exit status is 1 if any part failed.

--rehearse runs each part with its own --rehearse (or tiny flags): tiny shapes, 1 round, 2-3 steps, on CPU, each
CUDA-only call replaced by its CPU counterpart or skipped with the reason printed, so that the GPU run works the
first time. Without CUDA and without --rehearse the runner refuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.harness import Progress, Row, clock
from config import REPO


@dataclasses.dataclass(frozen=True)
class Part:
    name: str  # the --only choice, and <out>/<name>.json
    module: str  # benchmarks.<module>
    gpu_s: int  # estimated wall seconds on one GPU, compiles included (--minutes, the progress lines)
    rehearse_s: int  # estimated wall seconds of the rehearsal on 2 idle CPU cores (a shared machine: several times)
    flags: Callable[[bool], list[str]]  # rehearse -> the module's flags after --out
    what: str  # one line for --help


# The Llama 3 8B block shape for float8: 4 blocks (~35 GB of one rank's state and activations at 4096 tokens) on one
# 80 GB GPU.
FLOAT8_GPU = ["--world", "1", "--flavor", "llama3_8b", "--n-layers", "4", "--seq-len", "4096", "--batch-size", "1",
              "--setups", "bf16", "float8", "float8_rowwise", "--compile", "--steps", "3"]  # fmt: skip
FLOAT8_REHEARSE = ["--world", "1", "--n-layers", "1", "--seq-len", "32", "--batch-size", "1"]

# Each part's GPU estimate is its wall time on one H100 (2026-11-27, docs/results/gpu.jsonl), rounded up; cuda_paths'
# includes the pinned async save that failed there on torch 2.11. What issue 62 measures comes first (vs_torchtitan,
# decode: about 7.5 minutes, one command of --minutes 9), the rest after (about 5 minutes, a second command).
PARTS = (
    # 2 rounds of 5 runs, each compiling, about 30 s a run (2 rounds give the ratio's spread): this recipe's auto AC
    # (run once a round, shared by its two layouts) against torchtitan's op SAC and its no AC; both with full AC.
    Part("vs_torchtitan", "vs_torchtitan", 300, 180,
         lambda r: ["--shape", "busy", "--nproc", "1", "--layouts", "fsdp2_compile_auto", "fsdp2_compile_auto_vs_no_ac",
                    "fsdp2_compile_full_ac", "--rounds", "2", *(["--rehearse"] if r else [])],
         "recipe vs torchtitan, busy shape, compiled: auto AC vs op SAC and no AC, full AC; kernel times"),
    # Two compiles and captures (1B's 16 layers, 8B's 32) and transformers' eager generate at 8B, 4 x 65 tokens
    # at 10-30 ms each: a guess until a GPU run times it (the 1b part alone took 94 s with a folder written).
    Part("decode", "generation", 150, 50,
         lambda r: ["--shapes", "tiny", "--in-memory", "--new-tokens", "3", "--rounds", "1"] if r
         else ["--shapes", "1b", "8b", "--dtype", "bfloat16", "--new-tokens", "64", "--rounds", "3"],
         "compiled decode in a CUDA graph at batch 1 vs transformers' generate, Llama 3.2 1B's and 3.1 8B's "
         "shapes, fraction of peak memory bandwidth"),
    Part("train_rows", "train_rows", 100, 45, lambda r: ["--rehearse"] if r else [],
         "make bench's train rows (llama3_1b) and estimate_memory against the measured peak"),
    Part("cuda_paths", "cuda_paths", 100, 30, lambda r: ["--rehearse"] if r else [],
         "FlexAttention vs SDPA, async save with pinned memory, profiler trace + memory snapshot"),
    Part("float8", "float8", 100, 25, lambda r: FLOAT8_REHEARSE if r else FLOAT8_GPU,
         "tensorwise and rowwise float8 against bf16 tokens/s, Llama 3 8B blocks"),
)  # fmt: skip
BY_NAME = {p.name: p for p in PARTS}


def environment(rehearse: bool) -> dict[str, Any]:
    """What a GPU run's rows in docs/results/gpu.jsonl record of its machine: the date, the device, torch and CUDA."""
    cuda = torch.cuda.is_available() and not rehearse
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "rehearse": rehearse,
    }


def markdown(record: dict[str, Any]) -> str:
    """gpu_run.json as markdown: the machine, one line per part, then every row."""
    env = record["environment"]
    lines = [
        f"# make bench-gpu{' --rehearse' if env['rehearse'] else ''}, {env['date']}",
        "",
        f"{env['device']}, torch {env['torch']}, CUDA {env['cuda']}, Python {env['python']}",
        "",
        "| part | status | seconds | estimate | note |",
        "|---|---|---:|---:|---|",
    ]
    for name, p in record["parts"].items():
        lines.append(f"| {name} | {p['status']} | {p['seconds']:.0f} | {p['estimate_s']} | {p.get('note', '')} |")
    lines += ["", "| part | problem | metric | unit | broken | value | fixed | value | ratio |",
              "|---|---|---|---|---|---:|---|---:|---:|"]  # fmt: skip
    for name, p in record["parts"].items():
        for r in map(Row.from_json, p["rows"]):
            lines.append(
                f"| {name} | {r.problem} | {r.metric} | {r.unit} | {r.broken} | {r.broken_value:.4g} | {r.fixed} "
                f"| {r.fixed_value:.4g} | {r.ratio:.3f}x |"
            )
    return "\n".join(lines) + "\n"


def write(record: dict[str, Any], out: Path) -> None:
    """<out>/gpu_run.json and <out>/gpu_run.md, each written whole to a temporary name, then renamed: a run killed
    while writing leaves the previous part's files."""
    for name, text in (("gpu_run.json", json.dumps(record, indent=1) + "\n"), ("gpu_run.md", markdown(record))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


def run_part(part: Part, out: Path, *, rehearse: bool) -> tuple[int, list[Row], str]:
    """The part's benchmark as a process of its own (output passes through); its exit status, rows and a note."""
    path = out / f"{part.name}.json"
    path.unlink(missing_ok=True)  # an earlier run's results are not this one's
    # A rehearsal on a machine with a GPU still rehearses on CPU.
    env = {"CUDA_VISIBLE_DEVICES": ""} if rehearse and torch.cuda.is_available() else None
    proc = harness.run_python("-m", f"benchmarks.{part.module}", "--out", str(path), *part.flags(rehearse), env=env)
    if proc.returncode != 0:
        return proc.returncode, [], f"exited with status {proc.returncode}"
    try:
        return 0, importlib.import_module(f"benchmarks.{part.module}").rows(harness.read_results(path)), ""
    except Exception as e:  # noqa: BLE001 - a part whose rows cannot be read is a failed part, not a failed run
        return 1, [], f"its rows: {type(e).__name__}: {e}"


def positive_minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--minutes: expected a positive number of minutes, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="parts, in priority order:\n"
        + "\n".join(f"  {p.name:<14} ~{p.gpu_s:>3}s on a GPU  {p.what}" for p in PARTS),
    )
    p.add_argument("--only", nargs="+", choices=list(BY_NAME), metavar="PART", help="run only these parts")
    p.add_argument(
        "--minutes", type=positive_minutes, help="skip the parts whose estimate will not fit in what is left"
    )
    p.add_argument(
        "--out", type=Path, default=REPO / "outputs" / "bench-gpu", help="folder (default outputs/bench-gpu)"
    )
    p.add_argument("--rehearse", action="store_true", help="every part on CPU at tiny shapes, through the same code")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.rehearse and not torch.cuda.is_available():
        raise SystemExit(
            "error: make bench-gpu measures a CUDA GPU and this machine has none; "
            "pass --rehearse to run every part on CPU at tiny shapes"
        )
    parts = [p for p in PARTS if args.only is None or p.name in args.only]
    estimate = {p.name: p.rehearse_s if args.rehearse else p.gpu_s for p in parts}
    args.out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"environment": environment(args.rehearse), "parts": {}}
    env = record["environment"]
    print(f"make bench-gpu{' --rehearse' if args.rehearse else ''}: {env['device']}, torch {env['torch']}, "
          f"CUDA {env['cuda']}, {env['date']}; {len(parts)} parts, ~{clock(sum(estimate.values()))}", flush=True)  # fmt: skip
    write(record, args.out)
    progress, failed = Progress(estimate), False
    for part in parts:
        elapsed = progress.elapsed()
        entry: dict[str, Any] = {"estimate_s": estimate[part.name], "seconds": 0.0, "rows": []}
        if not (
            REPO / "benchmarks" / f"{part.module}.py"
        ).is_file():  # a fork removed that part (docs/development.md's table)
            note = f"skipped: benchmarks/{part.module}.py is not here (removed)"
            progress.say(part.name, note)
            record["parts"][part.name] = entry | {"status": "skipped", "note": note}
            write(record, args.out)
            continue
        if args.minutes is not None and elapsed + estimate[part.name] > 60 * args.minutes:
            left = max(0.0, 60 * args.minutes - elapsed)
            note = f"skipped: its estimate {clock(estimate[part.name])} does not fit in the {clock(left)} left of --minutes {args.minutes:g}"
            progress.say(part.name, note)
            record["parts"][part.name] = entry | {"status": "skipped", "note": note}
            write(record, args.out)
            continue
        progress.start(part.name)
        returncode, rows, note = run_part(part, args.out, rehearse=args.rehearse)
        seconds = progress.finish(part.name)
        status = "ok" if returncode == 0 else "failed"
        failed |= returncode != 0
        record["parts"][part.name] = entry | {
            "status": status, "returncode": returncode, "seconds": seconds, "note": note,
            "rows": [r.to_json() for r in rows],
        }  # fmt: skip
        write(record, args.out)
        outcome = (
            f"done in {seconds:.0f}s, {len(rows)} rows" if returncode == 0 else f"FAILED after {seconds:.0f}s: {note}"
        )
        progress.say(part.name, f"{outcome} (estimate {estimate[part.name]}s)")

    from benchmarks.run import format_table

    rows = [Row.from_json(r) for p in record["parts"].values() for r in p["rows"]]
    print("\n" + format_table(rows), flush=True)
    summary = ", ".join(f"{name} {p['status']}" for name, p in record["parts"].items())
    print(f"\n{summary}; total {clock(progress.elapsed())}", flush=True)
    print(f"wrote {args.out / 'gpu_run.json'} and {args.out / 'gpu_run.md'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
