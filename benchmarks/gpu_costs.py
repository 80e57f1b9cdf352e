"""What decides GPU speed, counted on CPU ranks: host reads of a training step, graphs compiled after
the first step, graph breaks.

    python -m benchmarks.gpu_costs --out outputs/bench/gpu_costs.json   # starts torchrun (2 CPU ranks) itself

FSDP 2 on the debug model (as train.py builds it, build_model). Host reads (`tests.instruments.count_host_reads`:
`.item()`, `.tolist()`, `bool()`, `.cpu()`, ... of device tensors, each a host sync on a GPU) of one
warm training step with fused AdamW, which skips a bad step on the device (optimizer.SkipStepOptimizer), and
with for-each AdamW, which cannot (on CPU its count also holds torch's reads of each parameter's step
counter, which live on the CPU with a GPU too: there only the recipe's one read is a sync); then the same model compiled (compile + op SAC): the graphs dynamo
compiles in the first step, in the next `--steps` - 1 with a no-grad validation forward among them
(its own graphs, once), and the graph breaks. The same counts are tests on every parity layout
(tests/test_parallelisms.py) and through train.py (tests/test_parallel_configs.py).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import harness
from benchmarks.harness import Row
from config import ActivationCheckpoint, Compile, JobConfig, Optimizer, Parallelism, Training
from data.loader import Batch
from forward import ForwardBackward
from loss import Loss, build_loss_fn
from models.llama3 import FLAVORS
from optimizer import build_optimizer
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import build_model, init_model
from tests.instruments import count_host_reads
from train import train_step

PROBLEM = "GPU costs"


def _counters() -> tuple[int, int]:
    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with harness.process_group() as device:
        world = dist.get_world_size()
        parallelism = Parallelism(data_parallel_shard_degree=world)
        dims = ParallelDims.from_config(parallelism, world_size=world)
        mesh = dims.build_mesh(device.type)
        model_args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=args.n_layers)
        training = Training(seq_len=args.seq_len, local_batch_size=args.batch_size, mixed_precision_param="float32")
        tokens = torch.randint(0, model_args.vocab_size, (args.batch_size, args.seq_len + 1)).to(device)
        batch = [Batch(tokens[:, :-1], tokens[:, 1:], None, 1)]

        def build(compile_: bool, ac: ActivationCheckpoint) -> torch.nn.Module:
            cfg = JobConfig(
                training=training, parallelism=parallelism, activation_checkpoint=ac, compile=Compile(enable=compile_)
            )
            model, _ = build_model(
                cfg, model_args, dims=dims, mesh=mesh, loss_fn=build_loss_fn(Compile()), device=device
            )
            init_model(model, None, device=device)
            return model

        def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
            forward_backward = ForwardBackward(model, Loss(), device=device)
            train_step(1, batch, forward_backward, optimizer, max_norm=1.0, stop_request=None)

        reads = {}
        model = build(False, ActivationCheckpoint())
        for implementation in ("fused", "foreach"):
            optimizer = build_optimizer(Optimizer(implementation=implementation), model)
            step(model, optimizer)  # warm-up: lazy initialization, optimizer state
            with count_host_reads(device) as found:
                step(model, optimizer)
            reads[implementation] = sum(found.values())

        model = build(True, ActivationCheckpoint(mode="selective", selective_ac_option="op"))
        optimizer = build_optimizer(Optimizer(), model)
        graphs0, breaks0 = _counters()
        step(model, optimizer)
        graphs1, _ = _counters()
        for i in range(1, args.steps):
            step(model, optimizer)
            if i == args.steps // 2:  # a validation: the no-grad graphs, compiled once
                with torch.no_grad():
                    model(tokens[:, :-1], head=lambda h: h)
        graphs2, breaks2 = _counters()
        steps_only = graphs2 - graphs1
    return {
        "world": world, "device": device.type, "n_layers": args.n_layers, "steps": args.steps,
        "host_reads": reads, "graphs_first_step": graphs1 - graphs0, "graphs_after": steps_only,
        "graph_breaks": breaks2 - breaks0,
    }  # fmt: skip


def rows(results: dict[str, Any]) -> list[Row]:
    return [
        Row(problem=PROBLEM, metric="host reads per training step (FSDP 2)", unit="reads",
            broken="for-each AdamW", broken_value=results["host_reads"]["foreach"],
            fixed="fused AdamW", fixed_value=results["host_reads"]["fused"]),
        Row(problem=PROBLEM, metric=f"graphs compiled (compile + op SAC, {results['steps']} steps, 1 validation)",
            unit="graphs", broken="first step", broken_value=results["graphs_first_step"],
            fixed="the other steps + validation", fixed_value=results["graphs_after"]),
    ]  # fmt: skip


def table(results: dict[str, Any]) -> str:
    r = results
    return (
        f"FSDP({r['world']}) on {r['device']}, debug model with {r['n_layers']} blocks\n"
        f"host reads per step: fused AdamW {r['host_reads']['fused']}, for-each AdamW {r['host_reads']['foreach']}\n"
        f"compiled graphs: {r['graphs_first_step']} in the first step, {r['graphs_after']} in the next {r['steps'] - 1} "
        f"and a no-grad validation; graph breaks {r['graph_breaks']}"
    )


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-layers", type=int, default=2, help="blocks of the debug model to keep (smaller, faster)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="compiled training steps")


def main(argv: list[str] | None = None) -> int:
    return harness.main("gpu_costs", argv, doc=__doc__ or "", add_args=add_args, measure=measure, table=table, world=2)


if __name__ == "__main__":
    raise SystemExit(main())
