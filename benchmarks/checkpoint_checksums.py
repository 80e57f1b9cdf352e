"""What checkpoint checksums cost: save and load time with and without them, and an async save's blocking time.

    python -m benchmarks.checkpoint_checksums --out outputs/bench/checkpoint_checksums.json    # one process

Measured here, in one run, the two sides alternating (--repeats times each, medians):
  save     dcp.save of a state dict through DCP's FileSystemWriter (what checkpoint/ wrote before) against
           checksums.ChecksumWriter (hashing each file as it is written, checksums.json beside .metadata);
           both fsync their files, as CheckpointManager's saves do.
  load     dcp.load of it against checkpoint.verify_contents (every file re-hashed, one process) + dcp.load.
           The files were just written, so both read from the page cache: the hashing's CPU cost, not a
           disk's.
  async    dcp.async_save's blocking time (staging, the training thread's share) with DCP's default writer
           against ChecksumWriter with the stager DCP would pick for it (what CheckpointManager does).
Two state dicts: the debug model's weights and AdamW moments (12 bytes per parameter, as a checkpoint holds
them), and --gib GiB of big float32 tensors (a plain state dict).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from benchmarks import harness
from benchmarks.harness import Row
from checkpoint import verify_contents
from checkpoint.checksums import ChecksumWriter
from models.llama3 import FLAVORS, Transformer

PROBLEM = "checkpoint checksums"
SIDES = ("plain", "checksums")


def model_state(flavor: str) -> dict[str, Any]:
    """The flavor's weights and two AdamW moments per weight, float32."""
    with torch.device("meta"):
        model = Transformer(FLAVORS[flavor])
    weights = {name: torch.randn(p.shape) for name, p in model.named_parameters()}
    moments = {
        name: {"exp_avg": torch.randn(t.shape), "exp_avg_sq": torch.rand(t.shape)} for name, t in weights.items()
    }
    return {"model": weights, "optimizer": moments}


def big_state(gib: float, *, tensor_mib: int = 128) -> dict[str, Any]:
    count = max(1, round(gib * 1024 / tensor_mib))
    numel = min(tensor_mib, round(gib * 1024)) * 2**20 // 4 or 1024
    return {f"tensor_{i}": torch.randn(numel) for i in range(count)}


def _bytes(state: dict[str, Any]) -> int:
    return sum(
        t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(state) if isinstance(t, torch.Tensor)
    )


def save(state: dict[str, Any], path: Path, side: str) -> float:
    begin = time.perf_counter()
    if side == "plain":
        dcp.save(state, checkpoint_id=str(path))
    else:
        dcp.save(state, storage_writer=ChecksumWriter(path))
    return time.perf_counter() - begin


def load(state: dict[str, Any], path: Path, side: str) -> float:
    target = torch.utils._pytree.tree_map_only(torch.Tensor, torch.empty_like, state)
    begin = time.perf_counter()
    if side == "checksums":
        verify_contents(path)
    dcp.load(target, checkpoint_id=str(path))
    return time.perf_counter() - begin


def async_blocking(state: dict[str, Any], path: Path, side: str) -> float:
    """Seconds until async_save returns (the upload then runs in a thread, which this waits for, untimed)."""
    begin = time.perf_counter()
    if side == "plain":
        future = dcp.async_save(state, checkpoint_id=str(path))
        blocked = time.perf_counter() - begin
    else:
        stager = DefaultStager(StagingOptions(False, False, False, False))
        future = dcp.async_save(state, storage_writer=ChecksumWriter(path), async_stager=stager)
        blocked = time.perf_counter() - begin
        future.add_done_callback(lambda _: stager.close())
    future.result()
    return blocked


def compare(state: dict[str, Any], folder: Path, *, repeats: int, with_async: bool) -> dict[str, Any]:
    kinds = ("save", "load", "async") if with_async else ("save", "load")
    times: dict[str, dict[str, list[float]]] = {kind: {side: [] for side in SIDES} for kind in kinds}
    for i in range(repeats + 1):  # the first round warms up
        for side in SIDES if i % 2 == 0 else reversed(SIDES):  # alternating which goes first
            path = folder / f"{side}-{i}"
            measured = {"save": save(state, path, side), "load": load(state, path, side)}
            shutil.rmtree(path)
            if with_async:
                measured["async"] = async_blocking(state, path, side)
                shutil.rmtree(path)
            for kind, seconds in measured.items() if i else ():
                times[kind][side].append(seconds)
    median = {kind: {side: statistics.median(t) for side, t in by_side.items()} for kind, by_side in times.items()}
    return {"bytes": _bytes(state), "seconds": median, "runs": times}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="ckpt_sums_", dir=args.folder) as tmp:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        folder = Path(tmp)
        model = compare(model_state(args.flavor), folder, repeats=args.repeats, with_async=True)
        big = compare(big_state(args.gib), folder, repeats=args.repeats, with_async=False)
    return {"flavor": args.flavor, "model": model, "big": big, "repeats": args.repeats}


def _overhead(seconds: dict[str, float]) -> float:
    return 100 * (seconds["checksums"] / seconds["plain"] - 1)


def rows(results: dict[str, Any]) -> list[Row]:
    """Save and load of the big state dict, save of the debug model and its async save's blocking time."""
    big, model = results["big"], results["model"]
    gib = big["bytes"] / 2**30

    def row(metric: str, seconds: dict[str, float], fixed: str) -> Row:
        return Row(problem=PROBLEM, metric=metric, unit="s", broken="no checksums", broken_value=seconds["plain"],
                   fixed=fixed, fixed_value=seconds["checksums"])  # fmt: skip

    return [
        row(f"save {gib:.2f} GiB", big["seconds"]["save"], "hashed while written"),
        row(f"load {gib:.2f} GiB", big["seconds"]["load"], "re-hashed, then loaded"),
        row(f"save, {results['flavor']} + AdamW", model["seconds"]["save"], "hashed while written"),
        row(f"async save's blocking time, {results['flavor']}", model["seconds"]["async"], "hashed while written"),
    ]


def table(results: dict[str, Any]) -> str:
    lines = []
    for name, label in (("model", f"{results['flavor']} + AdamW"), ("big", "big tensors")):
        r = results[name]
        for kind, seconds in r["seconds"].items():
            lines.append(
                f"{label} ({r['bytes'] / 2**20:,.0f} MiB) {kind}: plain {seconds['plain']:.3f} s, checksums "
                f"{seconds['checksums']:.3f} s ({_overhead(seconds):+.1f}%)"
            )
    return "\n".join(lines + [f"(medians of {results['repeats']}, the two sides alternating)"])


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gib", type=float, default=1.0, help="size of the plain state dict of big tensors, GiB")
    p.add_argument("--flavor", default="debugmodel", choices=sorted(FLAVORS), help="the model whose state is saved")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of each side (after one warm-up round)")
    p.add_argument("--folder", type=Path, default=None, help="where to write the checkpoints (default: the temp dir)")


def main(argv: list[str] | None = None) -> int:
    return harness.main("checkpoint_checksums", argv, doc=__doc__, add_args=add_args, measure=measure, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
