"""LoRA ([lora], lora.py) against full fine-tuning on the README's chat fine-tune: per rank the peak memory, the step
time, what trains and what the optimizer and a checkpoint hold, and whether the adapters learn.

    python -m benchmarks.lora --out outputs/bench/lora.json     # after make train (its step-100 is the base)
    python -m benchmarks.run --only lora                         # the same, a part make bench leaves out (OPT_IN)

The README's "Fine-tune on chat data" (configs/debug.toml from make train's outputs/debug/checkpoint/step-100 on
assets/corpus/chat.jsonl, chat template, block-causal attention, warm-up 4) on `--nproc` CPU ranks (gloo), `--steps`
steps each, validation and lm-eval off (neither is measured), three sides:

    full       every weight trains (optimizer.lr --lr, the config's 3e-3)
    lora_all   [lora] r 8, lora_alpha 16, target_modules ["all-linear"] (optimizer.lr --lora-lr)
    lora_qv    the same on q_proj and v_proj only (PEFT's default targets for Llama)

LoRA's lr (1e-2) is about 3x full fine-tuning's: the adapters start at B = 0 (the base exactly) and move the weights
through a rank-8 product scaled by lora_alpha / r = 2, so they need a larger step than the weights themselves; at the
full run's 3e-3 they learn, slower, and at 10x (3e-2, PEFT users' usual ratio for large models) this small model's
answer loss climbs above where it started within 20 steps. Each side is its own launch (train.py's own `build` and
`train`, the process's peak RSS its own); `--rounds` rounds, the order reversed every other round so that a machine's
drift reaches every side alike.

Per rank, read from the tensors themselves as benchmarks/memory.py and benchmarks/distill_memory.py read them:
    weights     the local shards of the parameters and buffers (the frozen base included) before the last step
    optimizer   AdamW's state tensors (local shards) before the last step: 2 fp32 per trained parameter
    step peak   tests.instruments.LiveBytes over the last step: the most bytes of the tensors created in the step
                alive at once (gathered weights, activations, gradients, temporaries)
    peak        weights + optimizer + step peak: what a GPU would hold at its fullest (the allocator's slack aside)
    step time   the median of this rank's steps 2..N-1, pooled over the rounds (step 1 allocates FSDP's buffers;
                step N runs under LiveBytes' per-op hook and is not timed)
    peak RSS    the process's maximum resident set (getrusage): what make train's log shows as "mem" on CPU
and per run: the trained parameters, the step folder's bytes on disk (checkpoint/step-N, every rank's files and
each rank's own), and the answer loss at every step (the chat loss counts the assistant's tokens only).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from benchmarks import harness
from benchmarks.harness import MiB, Row

PROBLEM = "LoRA"
BASE = Path("outputs/debug/checkpoint/step-100")  # make train's last step
CHAT = [
    "--config", "configs/debug.toml", "--data.path=assets/corpus/chat.jsonl", "--data.chat",
    "--model.attn_mask_type=block_causal", "--validation.enable=false", "--eval.enable=false", "--metrics.log_freq=1",
]  # fmt: skip
LORA = ["--lora.enable", "--lora.r=8", "--lora.lora_alpha=16"]
SIDES = {  # broken (the baseline) first
    "full": [],
    "lora_all": [*LORA, "--lora.target_modules=all-linear"],
    "lora_qv": [*LORA, "--lora.target_modules=q_proj,v_proj"],
}
LABELS = {"full": "full fine-tune", "lora_all": "LoRA r 8 all-linear", "lora_qv": "LoRA r 8 q_proj,v_proj"}
WORKER = "--worker-out"  # the first argument of a rank's launch: where it writes rank<k>.json; train.py's args follow


# ------------------------------------------------------------------ one side, on every rank


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(tensors: Any) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


class Probe:
    """Two entries of train.py's work after a step: `ended` first (right after train_step), `starts` last (the next
    step starts): each step's seconds on this rank, and the last step under LiveBytes with what existed before it."""

    def __init__(self, run: Any, *, steps: int) -> None:
        from tests.instruments import LiveBytes

        self.run, self.steps, self.seconds = run, steps, {}
        self.live_bytes, self.tracking, self.before = LiveBytes, None, {}
        self.step_peak = 0
        self.begin = time.perf_counter()

    def model(self) -> torch.nn.Module:
        return self.run.forward_backward.model

    def state(self) -> list[torch.Tensor]:
        return [v for s in self.run.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]

    def starts(self, step: int, result: object) -> bool:
        self.begin = time.perf_counter()
        if step + 1 == self.steps:
            weights = [*self.model().parameters(), *self.model().buffers()]
            self.before = {"weights": tensor_bytes(weights), "optimizer": tensor_bytes(self.state())}
            # In-place ops (the optimizer's update, the weights' copy) return what existed: not new bytes.
            self.tracking = self.live_bytes([local(t) for t in [*weights, *self.state()]]).track()
            self.live = self.tracking.__enter__()
        return False

    def ended(self, step: int, result: object) -> bool:
        self.seconds[step] = time.perf_counter() - self.begin
        if self.tracking is not None:
            self.tracking.__exit__(None, None, None)
            self.step_peak, self.tracking = self.live.peak, None
        return False

    def report(self) -> dict[str, Any]:
        model, trained = self.model(), [p for g in self.run.optimizer.param_groups for p in g["params"]]
        return {
            "rank": torch.distributed.get_rank(),
            "weights_bytes": self.before["weights"],
            "optimizer_bytes": self.before["optimizer"],
            "step_peak_bytes": self.step_peak,
            "peak_bytes": self.before["weights"] + self.before["optimizer"] + self.step_peak,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
            "step_seconds": [self.seconds[s] for s in sorted(self.seconds)],
            "parameters": sum(p.numel() for p in model.parameters()),
            "trained": sum(p.numel() for p in trained),
            "trained_local": sum(local(p).numel() for p in trained),
        }


def worker(out: Path, argv: list[str]) -> int:
    """train.py's main for `argv` with a Probe in its work after a step; each rank writes out/rank<k>.json."""
    import torch.distributed as dist

    import train
    from config import load_config_and_keys
    from data.inputs import input_problems
    from distributed import init_distributed
    from parallelisms.parallel_dims import layout_checks

    cfg, changed = load_config_and_keys(argv, input_checks=input_problems, extra_checks=layout_checks(
        int(os.environ["WORLD_SIZE"])))  # fmt: skip
    device, rank, world_size = init_distributed(cfg.comm, dump_folder=cfg.job.dump_folder)
    try:
        run = train.build(cfg, device=device, rank=rank, world_size=world_size, changed=changed)
        if run is None:  # a fresh dump folder trains: a seed checkpoint or a finished run is no measurement
            raise SystemExit(f"benchmarks.lora: {cfg.job.dump_folder} had nothing to train")
        work, probe = train.after_step_work(run), Probe(run, steps=cfg.training.steps)
        work.timed.insert(0, probe.ended)
        work.untimed.append(probe.starts)
        probe.begin = time.perf_counter()
        train.train(run, work)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps(probe.report()) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------ the sides, from the parent


def folder_bytes(folder: Path) -> dict[str, Any]:
    """A step folder's bytes on disk: every file, and each rank's own DCP file (__<rank>_0.distcp)."""
    files = [f for f in folder.rglob("*") if f.is_file()]
    ranks = sorted((f for f in files if f.suffix == ".distcp"), key=lambda f: int(f.name.split("_")[2]))
    return {"bytes": sum(f.stat().st_size for f in files), "rank_bytes": [f.stat().st_size for f in ranks]}


def run_side(name: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    dump = work / name
    shutil.rmtree(dump, ignore_errors=True)  # a fresh run, not a resume of the last one
    lr = args.lora_lr if name != "full" else args.lr
    train_args = [*CHAT, f"--job.dump_folder={dump}", f"--checkpoint.initial_load_path={args.base}",
                  f"--training.steps={args.steps}", f"--lr_scheduler.warmup_steps={args.warmup}",
                  f"--optimizer.lr={lr}", f"--data.cache_folder={work / 'cache'}", *SIDES[name]]  # fmt: skip
    proc = harness.run_python("-m", "benchmarks.lora", WORKER, str(dump / "probe"), *train_args, nproc=args.nproc)
    if proc.returncode != 0:
        raise SystemExit(f"benchmarks.lora: the {name} run exited with status {proc.returncode}")
    metrics = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {
        "ranks": [json.loads((dump / "probe" / f"rank{r}.json").read_text()) for r in range(args.nproc)],
        "loss": [m["loss"] for m in metrics if "loss" in m],
        "checkpoint": folder_bytes(dump / "checkpoint" / f"step-{args.steps}"),
    }


def summary(runs: list[dict[str, Any]], *, lr: float) -> dict[str, Any]:
    """A side's rounds as one: the first round's counts (every round's are the same), each rank's step time pooled."""
    first = runs[0]
    ranks = []
    for r, rank in enumerate(first["ranks"]):
        steady = [s for run in runs for s in run["ranks"][r]["step_seconds"][1:-1]]
        keep = ("weights_bytes", "optimizer_bytes", "step_peak_bytes", "peak_bytes", "max_rss_bytes", "trained_local")
        ranks.append({k: rank[k] for k in keep} | {"step_ms": 1000 * statistics.median(steady)})
    return {
        "lr": lr,
        "parameters": first["ranks"][0]["parameters"],
        "trained": first["ranks"][0]["trained"],
        "ranks": ranks,
        "loss": first["loss"],
        "checkpoint": first["checkpoint"],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if not (args.base / ".metadata").is_file():
        raise SystemExit(f"error: --base {args.base}: no checkpoint step folder there; run `make train` first (it "
                         f"writes {BASE}) or pass --base")  # fmt: skip
    if "full" not in args.sides:
        raise SystemExit("error: --sides: full is the baseline every row compares with; keep it")
    if args.steps < 3:
        raise SystemExit(f"error: --steps {args.steps}: at least 3 (step 1 is not timed, nor the last)")
    work = args.out.parent / "lora"
    begin = time.perf_counter()
    names = [n for n in SIDES if n in args.sides]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for i in range(args.rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            runs[name].append(run_side(name, work, args))
    return {
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "nproc": args.nproc,
            "rounds": args.rounds,
            "base": str(args.base),
            "r": 8,
            "lora_alpha": 16,
        },  # fmt: skip
        "sides": {n: summary(runs[n], lr=args.lora_lr if n != "full" else args.lr) for n in names},
        "seconds": time.perf_counter() - begin,
    }


def rows(results: dict[str, Any]) -> list[Row]:
    sides, steps = results["sides"], results["settings"]["steps"]
    full = sides["full"]

    def of(side: dict[str, Any], key: str) -> float:  # the largest rank's: the one a GPU's size must fit
        return max(rank[key] for rank in side["ranks"])

    metrics = [
        ("peak memory per rank (tensors: weights + optimizer + the step's peak)", "MiB", lambda s: of(s, "peak_bytes") / MiB),
        ("step time per rank (median of the steady steps)", "ms", lambda s: of(s, "step_ms")),
        ("trained parameters", "", lambda s: s["trained"]),
        ("optimizer state per rank", "MiB", lambda s: of(s, "optimizer_bytes") / MiB),
        ("checkpoint step folder on disk", "MiB", lambda s: s["checkpoint"]["bytes"] / MiB),
        (f"answer loss at step {steps} (step 1: {full['loss'][0]:.3f})", "", lambda s: s["loss"][-1]),
    ]  # fmt: skip
    return [
        Row(PROBLEM, metric, unit, LABELS["full"], value(full), LABELS[name], value(sides[name]))
        for name in sides if name != "full" for metric, unit, value in metrics
    ]  # fmt: skip


def table(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [f"chat fine-tune from {s['base']}: {s['steps']} steps on {s['nproc']} ranks, {s['rounds']} rounds; "
             f"{results['seconds']:.0f} s"]  # fmt: skip
    for name, side in results["sides"].items():
        ckpt = side["checkpoint"]
        lines.append(f"{name} (lr {side['lr']:g}): {side['trained']:,} of {side['parameters']:,} parameters train; "
                     f"answer loss {side['loss'][0]:.4f} at step 1, {side['loss'][-1]:.4f} at step {s['steps']}; "
                     f"checkpoint {ckpt['bytes'] / MiB:.2f} MiB")  # fmt: skip
        for r, rank in enumerate(side["ranks"]):
            lines.append(
                f"  rank {r}: peak {rank['peak_bytes'] / MiB:.1f} MiB (weights {rank['weights_bytes'] / MiB:.1f}, "
                f"optimizer {rank['optimizer_bytes'] / MiB:.2f}, step {rank['step_peak_bytes'] / MiB:.1f}), RSS "
                f"{rank['max_rss_bytes'] / MiB:.0f} MiB, step {rank['step_ms']:.0f} ms"
            )
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", type=Path, default=BASE, help="the step folder fine-tuned (make train's last step)")
    p.add_argument("--steps", type=int, default=20, help="steps of each run")
    p.add_argument("--warmup", type=int, default=4, help="lr_scheduler.warmup_steps (the README's)")
    p.add_argument("--lr", type=float, default=3e-3, help="full fine-tuning's optimizer.lr (configs/debug.toml's)")
    p.add_argument("--lora-lr", type=float, default=1e-2, help="LoRA's optimizer.lr")
    p.add_argument("--nproc", type=int, default=2, help="ranks of each run")
    p.add_argument("--rounds", type=int, default=2, help="runs of each side, the order reversed every other round")
    p.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES), help="the sides run (full first)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [WORKER]:  # a rank of one side's run
        return worker(Path(argv[1]), argv[2:])
    return harness.main("lora", argv, doc=__doc__, add_args=add_args, measure=measure, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
