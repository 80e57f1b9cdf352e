"""float8 (parallelisms/float8.py): FSDP's all-gather bytes in bf16 vs float8, and the step time.

    python -m benchmarks.float8 --out outputs/bench/float8.json   # starts torchrun (2 ranks) itself

One training step (after a warm-up step) of the debug model under FSDP over the ranks, bf16
parameters, built by the recipe's own parallelize_model, in three setups:

    bf16                 no converter
    float8               tensorwise float8 linears, bf16 all-gather
    float8_all_gather    + enable_fsdp_float8_all_gather + precompute_float8_dynamic_scale_for_fsdp
    float8_rowwise       rowwise float8 linears (torchao's rowwise recipe), bf16 all-gather

`make bench-gpu` (benchmarks/gpu_run.py) runs it on one GPU at the Llama 3 8B block shape with
`--setups bf16 float8 float8_rowwise --compile --steps 3`: step time and tokens/s of tensorwise and
rowwise against bf16 (float8's speed needs compile: eager, its casts are separate kernels).

Bytes are read off the tensors FSDP hands to its all-gather (`ALL_GATHERS`: the call that gathers
each unit's flat buffer): the block weights travel as 1-byte float8 instead of 2-byte bf16,
the embedding, norms and (filtered) output projection stay bf16. Without a float8-capable GPU the
linears run with `emulate = true` (torchao's casts, high-precision matmuls): the bytes are the
real ones, the step time is not a float8 speed (emulation is slower); on a GPU of compute
capability 8.9+ nothing is emulated and the step time is the one to read.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import harness
from benchmarks.harness import MiB, Row
from config import Compile, JobConfig, Optimizer, Parallelism, QuantizeLinearFloat8, Training
from data.loader import Batch
from forward import ForwardBackward
from loss import Loss
from models import with_seq_len
from models.llama3 import FLAVORS, Transformer
from optimizer import build_optimizer
from parallelisms.float8 import float8_problems
from parallelisms.fsdp import autocast_dtype
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize_model
from train import train_step

PROBLEM = "float8"
SETUPS = ("bf16", "float8", "float8_all_gather", "float8_rowwise")


# FSDP2's all-gather: torch 2.13 calls `all_gather_single`, torch 2.11 (and earlier) `all_gather_into_tensor`; neither
# calls the other, so counting both counts each gather once on either.
ALL_GATHERS = ("all_gather_single", "all_gather_into_tensor")


@contextmanager
def all_gather_bytes(counts: dict[str, int]) -> Iterator[None]:
    """Sum the output bytes of every FSDP all-gather (`ALL_GATHERS`) into counts["bytes"], their number in "calls"."""
    saved = {name: getattr(dist, name) for name in ALL_GATHERS if hasattr(dist, name)}

    def counting(original: Any) -> Any:
        def call(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts["bytes"] += output.numel() * output.element_size()
            counts["calls"] += 1
            return original(output, *args, **kwargs)

        return call

    try:
        for name, original in saved.items():
            setattr(dist, name, counting(original))
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def measure(setup: str, *, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    world = dist.get_world_size()
    parallelism = Parallelism(data_parallel_shard_degree=world)
    dims = ParallelDims.from_config(parallelism, world_size=world)
    mesh = dims.build_mesh(device.type)
    emulate = bool(float8_problems(QuantizeLinearFloat8(), device=device))
    float8 = None
    if setup == "float8_rowwise":
        float8 = QuantizeLinearFloat8(recipe_name="rowwise", emulate=emulate)
    elif setup != "bf16":
        gather = setup == "float8_all_gather"
        float8 = QuantizeLinearFloat8(
            enable_fsdp_float8_all_gather=gather, precompute_float8_dynamic_scale_for_fsdp=gather, emulate=emulate
        )
    model_args = dataclasses.replace(with_seq_len(FLAVORS[args.flavor], args.seq_len), n_layers=args.n_layers)
    with torch.device("meta"):
        model = Transformer(model_args)
    training = Training(seq_len=args.seq_len, mixed_precision_param="bfloat16")
    cfg = JobConfig(training=training, parallelism=parallelism, compile=Compile(enable=args.compile))
    if float8 is not None:
        cfg.model.converters, cfg.quantize.linear.float8 = ["quantize.linear.float8"], float8
    parallelize_model(model, cfg, dims=dims, mesh=mesh, device=device)
    model.to_empty(device=device)
    model.init_weights()
    optimizer = build_optimizer(Optimizer(lr=1e-4), model)
    if float8 is not None and float8.precompute_float8_dynamic_scale_for_fsdp:
        from parallelisms.float8 import precompute_scales_after_each_step

        precompute_scales_after_each_step(optimizer, model)
    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, model_args.vocab_size, (args.batch_size, args.seq_len + 1), generator=generator)

    def step() -> float:
        batch = [Batch(tokens[:, :-1], tokens[:, 1:], None, 1)]
        # One rank trains bf16 under autocast (parallelisms/fsdp.py autocast_dtype), as train.py does.
        forward_backward = ForwardBackward(model, Loss(), device=device, autocast_to=autocast_dtype(dims, training))
        result = train_step(1, batch, forward_backward, optimizer, max_norm=1.0, stop_request=None)
        return result.loss.total.item()

    first_loss = step()  # warm-up: lazy init, optimizer state
    counts = {"bytes": 0, "calls": 0}
    dist.barrier()
    start = time.perf_counter()
    with all_gather_bytes(counts):
        for _ in range(args.steps):
            step()  # .item(): each step ends synchronized
    seconds = (time.perf_counter() - start) / args.steps
    return {
        "setup": setup, "emulate": emulate, "all_gather_bytes": counts["bytes"] // args.steps,
        "all_gathers": counts["calls"] // args.steps, "step_seconds": seconds, "first_loss": first_loss,
        "tokens_per_s": args.batch_size * args.seq_len / seconds,
    }  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--flavor", default="debugmodel", choices=sorted(FLAVORS))
    p.add_argument("--n-layers", type=int, default=2, help="blocks of the flavor to keep (smaller, faster)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    p.add_argument("--steps", type=int, default=1, help="timed steps (after one warm-up step); their mean")
    p.add_argument("--compile", action="store_true", help="compile each block (compile.enable)")


def measure_args(args: argparse.Namespace) -> dict[str, Any]:
    with harness.process_group() as device:
        setups = {setup: measure(setup, args=args, device=device) for setup in args.setups}
        world = dist.get_world_size()
    return {"flavor": args.flavor, "n_layers": args.n_layers, "world": world, "device": device.type, "setups": setups}


def rows(results: dict[str, Any]) -> list[Row]:
    """The all-gather bytes (float8 vs float8_all_gather), and where float8 is not emulated the step time and
    tokens/s of each float8 setup measured against bf16's."""
    s = results["setups"]
    out = []
    if "float8" in s and "float8_all_gather" in s:
        out.append(
            Row(problem=PROBLEM, metric="FSDP all-gather bytes per step (rank 0)", unit="MiB",
                broken="bf16 all-gather", broken_value=s["float8"]["all_gather_bytes"] / MiB,
                fixed="float8 all-gather", fixed_value=s["float8_all_gather"]["all_gather_bytes"] / MiB)
        )  # fmt: skip
    emulated = any(r["emulate"] for r in s.values())
    if not emulated and "bf16" in s:
        labels = {"float8": "float8 tensorwise", "float8_all_gather": "float8 + float8 all-gather",
                  "float8_rowwise": "float8 rowwise"}  # fmt: skip
        out += [
            Row(problem=PROBLEM, metric=f"tokens/s, {results['flavor']} ({results['n_layers']} blocks)", unit="tok/s",
                broken="bf16", broken_value=s["bf16"]["tokens_per_s"], fixed=label,
                fixed_value=s[name]["tokens_per_s"])
            for name, label in labels.items() if name in s
        ]  # fmt: skip
    if not emulated and "bf16" in s and "float8_all_gather" in s:
        out.append(
            Row(
                problem=PROBLEM,
                metric="step time",
                unit="ms",
                broken="bf16",
                broken_value=1e3 * s["bf16"]["step_seconds"],
                fixed="float8 + float8 all-gather",
                fixed_value=1e3 * s["float8_all_gather"]["step_seconds"],
            )
        )
    return out


def table(results: dict[str, Any]) -> str:
    lines = [
        f"one step of {results['flavor']} ({results['n_layers']} blocks), "
        + (f"FSDP over {results['world']} ranks, bf16 params" if results["world"] > 1
           else "one rank: bf16 under autocast, no FSDP and no all-gather (parallelisms/fsdp.py)")
        + f", on {results['device']}" + (" (float8 emulated: step times are not float8 speed)" if results["device"] != "cuda" else ""),
        f"{'setup':<20} {'all-gather MiB':>14} {'calls':>6} {'step ms':>8} {'warm-up loss':>12}",
    ]  # fmt: skip
    for name, r in results["setups"].items():
        lines.append(
            f"{name:<20} {r['all_gather_bytes'] / MiB:>14.3f} {r['all_gathers']:>6} "
            f"{1e3 * r['step_seconds']:>8.1f} {r['first_loss']:>12.5f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return harness.main("float8", argv, doc=__doc__, add_args=add_args, measure=measure_args, table=table, world=2)


if __name__ == "__main__":
    raise SystemExit(main())
