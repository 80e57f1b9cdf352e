"""`make bench`: one table with a row per documented problem, all measured in this run.

Each benchmark module runs in its own process (they launch torchrun themselves) and writes
a JSON file; this script turns those files into rows of (broken setting, fixed setting,
measured numbers, ratio), prints them, and writes `<out>/bench.json` and `<out>/bench.png`.

    python -m benchmarks.run                      # every benchmark (CPU: ~10 minutes on 2 cores)
    python -m benchmarks.run --only memory comm_volume
    python -m benchmarks.run --train-rows         # also tokens/s of FSDP vs + compile vs + SAC

On a machine with CUDA the train rows run by default, on the largest flavor that fits one
GPU; on CPU they use the debug model and are off unless asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    problem: str
    metric: str
    broken: str
    broken_value: float
    fixed: str
    fixed_value: float
    unit: str

    @property
    def ratio(self) -> float:
        return self.fixed_value / self.broken_value if self.broken_value else float("nan")


# ------------------------------------------------------------- summarizers


def recompute_rows(data: dict) -> list[Row]:
    v = data["results"]["variants"]
    nested, single = v["nested"], v["single"]
    problem, broken, fixed = "#1 nested AC", "HF GC + block AC", "apply_ac only"
    return [
        Row(problem, "attention forwards per layer per step", broken, nested["attention_forwards_per_layer"],
            fixed, single["attention_forwards_per_layer"], "calls"),
        Row(problem, "backward FLOPs per step, recompute included", broken, nested["backward_flops"] / 1e9,
            fixed, single["backward_flops"] / 1e9, "GFLOP"),
        Row(problem, "step time (CPU fp32, median)", broken, nested["step_seconds_median"] * 1e3,
            fixed, single["step_seconds_median"] * 1e3, "ms"),
    ]  # fmt: skip


def metadata_rows(data: dict) -> list[Row]:
    a = data["results"]["attention"]
    fa2, sdpa = a["fa2_semantics_cpu"], a["sdpa"]
    problem, fixed = "#2 KV cache + AC", "no cache + apply_ac"
    return [
        Row(problem, "backward raises CheckpointError (FA2 semantics)", "cache + block AC",
            float(fa2["non_reentrant"]["error"] is not None), fixed, float(fa2["fix"]["error"] is not None), "1=yes"),
        Row(problem, "grad error ||g - g_noAC|| / ||g_noAC|| (sdpa)", "cache + reentrant AC",
            sdpa["reentrant"]["rel_grad_norm_error"], fixed, sdpa["fix"]["rel_grad_norm_error"], ""),
        Row(problem, "KV tokens cached per layer after a step (sdpa)", "cache + block AC",
            sdpa["non_reentrant"]["cached_tokens"], fixed, sdpa["fix"]["cached_tokens"], "tokens"),
    ]  # fmt: skip


def compile_cache_rows(data: dict) -> list[Row]:
    hits = data["cross_recipe_hits"]
    problem = "#4 compile cache"
    return [
        Row(problem, "graphs served from the other recipe's compile", "shared dir, pre-2.8 key",
            hits["shared_dir_pre28_key"], "dir keyed on recipe", hits["keyed_dirs"], "graphs"),
        Row(problem, "compile time of a block (cold vs warm cache)", "cold", data["compile_s"]["cold"],
            "warm, same recipe", data["compile_s"]["warm"], "s"),
    ]  # fmt: skip


def comm_volume_rows(data: dict) -> list[Row]:
    r = data["results"]
    mib = 2**20
    full, hsdp, rep = (r[k]["cross_node_bytes"] / mib for k in ("full_shard", "hsdp", "replicate"))
    problem = "#3 HSDP across nodes"
    metric = "bytes crossing nodes per step (2 nodes x 2 ranks)"
    return [
        Row(problem, metric, "FULL_SHARD over 4", full, "HSDP 2 x 2", hsdp, "MiB"),
        Row(problem, metric, "pure replication 4", rep, "HSDP 2 x 2", hsdp, "MiB"),
    ]


def memory_rows(data: dict) -> list[Row]:
    r = data["results"]
    mib = 2**20
    steps = [
        ("no_shard_fp32", "fsdp2_fp32", "FSDP(2)"),
        ("fsdp2_fp32", "fsdp2_bf16", "+ bf16 params"),
        ("fsdp2_bf16", "fsdp2_bf16_ac_op", "+ selective op AC"),
        ("fsdp2_bf16_ac_op", "fsdp2_bf16_ac_full", "+ full AC"),
        ("fsdp2_bf16_ac_full", "fsdp2_bf16_ac_full_offload", "+ CPU offload"),
    ]
    rows = []
    for before, after, label in steps:
        rows.append(
            Row(
                "#5 memory",
                "device MiB per rank: state + saved activations",
                before,
                r[before]["device_total_bytes"] / mib,
                label,
                r[after]["device_total_bytes"] / mib,
                "MiB",
            )
        )
    return rows


def train_rows(data: dict) -> list[Row]:
    runs = data["results"]
    base = runs["fsdp"]["tps"]
    rows = [Row("throughput", "tokens/s per device", "FSDP", base, label, runs[key]["tps"], "tok/s")
            for key, label in (("fsdp_compile", "+ compile"), ("fsdp_compile_sac", "+ compile + op SAC"))]  # fmt: skip
    if all(runs[k].get("memory_gib") for k in runs):
        before, after = runs["fsdp"]["memory_gib"], runs["fsdp_compile_sac"]["memory_gib"]
        rows.append(Row("throughput", "peak memory", "FSDP", before, "+ compile + op SAC", after, "GiB"))
    return rows


BENCHMARKS: dict[str, Callable[[dict], list[Row]]] = {
    "recompute": recompute_rows,
    "metadata": metadata_rows,
    "comm_volume": comm_volume_rows,
    "compile_cache": compile_cache_rows,
    "memory": memory_rows,
}


# --------------------------------------------------------------- train rows


def run_train_rows(out: Path, *, cuda: bool) -> dict:
    """tokens/s, MFU and peak memory of FSDP vs + compile vs + op SAC through train.py."""
    if cuda:
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
    results = {}
    for name, extra in variants.items():
        dump = out / "train" / name
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "train.py",
            "--config", "configs/debug.toml", f"--model.flavor={flavor}", f"--training.seq_len={seq_len}",
            "--training.steps=20", "--metrics.log_freq=1", f"--job.dump_folder={dump}", *common, *extra,
        ]  # fmt: skip
        (dump / "metrics.jsonl").unlink(missing_ok=True)  # metrics.jsonl appends
        subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()][5:]  # warm
        results[name] = {
            "tps": statistics.median(r["tps"] for r in rows),
            "mfu": statistics.median(r["mfu"] for r in rows) if rows[0]["mfu"] is not None else None,
            "memory_gib": max(r["memory_gib"] for r in rows),
            "flavor": flavor,
        }
    return {"benchmark": "train", "device": "cuda" if cuda else "cpu", "results": results}


# ------------------------------------------------------------------- output


def format_table(rows: list[Row]) -> str:
    header = f"{'problem':<22} {'metric':<52} {'broken':<20} {'value':>10} {'fixed':<20} {'value':>10} {'ratio':>7}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.problem:<22} {r.metric[:52]:<52} {r.broken[:20]:<20} {r.broken_value:>10.4g} "
            f"{r.fixed[:20]:<20} {r.fixed_value:>10.4g} {r.ratio:>6.3f}x"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.problem}: {r.fixed} vs {r.broken}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    ax.barh(range(len(rows)), [r.ratio for r in rows], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("fixed / broken (measured in one run)")
    ax.set_title("What each fix buys")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "outputs" / "bench")
    p.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run only these benchmarks")
    p.add_argument("--train-rows", action=argparse.BooleanOptionalAction, default=None,
                   help="tokens/s rows through train.py (default: on with CUDA)")  # fmt: skip
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    rows: list[Row] = []
    raw: dict[str, dict] = {}
    for name in args.only or BENCHMARKS:
        json_path = args.out / f"{name}.json"
        print(f"== {name}", flush=True)
        subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--out", str(json_path)], cwd=REPO, check=True)
        raw[name] = json.loads(json_path.read_text())
        rows += BENCHMARKS[name](raw[name])
    cuda = torch.cuda.is_available()
    if args.train_rows if args.train_rows is not None else cuda:
        print("== train", flush=True)
        raw["train"] = run_train_rows(args.out, cuda=cuda)
        rows += train_rows(raw["train"])

    table = format_table(rows)
    print("\n" + table)
    (args.out / "bench.json").write_text(
        json.dumps({"rows": [asdict(r) | {"ratio": r.ratio} for r in rows], "raw": raw}, indent=1) + "\n"
    )
    plot(rows, args.out / "bench.png")
    print(f"\nwrote {args.out / 'bench.json'} and {args.out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
