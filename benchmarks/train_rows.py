"""`make bench`'s train rows and the memory estimator against measured memory, as one benchmark (`make bench-gpu`).

    python -m benchmarks.train_rows --out outputs/bench-gpu/train_rows.json   # CUDA: llama3_1b on one GPU
    python -m benchmarks.train_rows --rehearse --out /tmp/train_rows.json      # any machine: tiny, on CPU

Through the code paths that exist:

    train     benchmarks/run.py's run_train: tokens/s, MFU and peak memory of FSDP vs + compile vs + op SAC,
              through train.py (on CUDA llama3_1b, seq 2048, batch 4, one process)
    estimate  estimate_memory.estimate_rank's reserved bytes for each train run's job, beside that run's measured
              peak (metrics.py: the CUDA allocator's peak reserved memory; on CPU the process's peak RSS, which
              also holds the interpreter and its libraries, so the CPU rows only show that the path runs)

--rehearse: the train runs at a tiny shape without compile (run_train's rehearse).

benchmarks/memory.py (the estimator's activation formulas against the tensors a step keeps) is not run here: it
shards over 2 ranks, and one GPU holds one NCCL rank; its rows are make bench's, on CPU.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks import harness, run
from benchmarks.harness import Row
from config import load_config
from parallelisms.parallel_dims import ParallelDims
from planning.job import Job, Machine
from planning.memory import estimate_rank

GiB = 2**30
PROBLEM = "memory estimate"


def estimate_gib(train: dict[str, Any], *, cuda: bool) -> float:
    """estimate_memory's reserved GiB per rank for one run_train variant: the job of the config it trained with (the
    config.toml it saved), so that every key the estimator reads (the loss's chunks, AC, dtypes) is the run's."""
    cfg = load_config(["--config", train["config"]])
    dims = ParallelDims.from_config(cfg.parallelism, world_size=train["nproc"])
    return float(estimate_rank(Job.of(cfg, Machine(cuda=cuda), world_size=dims.world_size))["reserved"]) / GiB


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available() and not args.rehearse
    work = args.out.parent / "train_rows"
    train = run.run_train(work, cuda=cuda, rehearse=args.rehearse)
    for variant in train["variants"].values():
        variant["estimate_gib"] = estimate_gib(variant, cuda=cuda)
    return {"device": "cuda" if cuda else "cpu", "train": train}


def rows(results: dict[str, Any]) -> list[Row]:
    """run.train_rows, then estimate_memory's peak beside each train run's measured one."""
    device, runs = results["device"], results["train"]["variants"]
    out = run.train_rows(results["train"])
    measured = "allocator peak reserved" if device == "cuda" else "peak RSS"
    out += [
        Row(problem=PROBLEM, metric=f"peak memory, {r['flavor']} train.py {name} ({device})", unit="GiB",
            broken="estimate_memory", broken_value=r["estimate_gib"], fixed=measured, fixed_value=r["memory_gib"])
        for name, r in runs.items()
    ]  # fmt: skip
    return out


def table(results: dict[str, Any]) -> str:
    return run.format_table(rows(results))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rehearse", action="store_true", help="tiny shapes on CPU, no compile (make bench-gpu's rehearsal)"
    )


def main(argv: list[str] | None = None) -> int:
    return harness.main("train_rows", argv, doc=__doc__, add_args=add_args, measure=measure, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
