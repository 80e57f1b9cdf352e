"""Muon on sharded parameters (docs/failures.md #6): the update of each shard vs the whole matrix's, and the bytes of
orthogonalizing whole matrices through DTensor vs the recipe's exchange (muon.py).

    python -m benchmarks.muon --out outputs/bench/muon.json       # starts torchrun (2 CPU ranks) itself

One matrix (256 x 128, as the issue measured it; a random gradient, lr 0.02, match_rms_adamw, one step of
torch.optim.Muon from zero momentum), its rows sharded over the ranks as FSDP shards them, updated four ways:

    whole      torch.optim.Muon on the whole matrix, on every rank (the reference)
    shard      torch.optim.Muon on each rank's row block alone (what any optimizer handed local tensors does)
    implicit   torch.optim.Muon on the DTensor parameter: exact, DTensor redistributes the iteration's operands
    recipe     muon.Muon: the blocks gathered to one owner, orthogonalized whole, sent back

Then the debug model under FSDP over the ranks, one optimizer step after a training step: the bytes each rank sends
in the optimizer step (tests.instruments.CollectiveLog: the dispatcher's collectives, with their tensors), for
torch.optim.Muon on the DTensor hidden matrices (+ AdamW) and for the recipe, beside the floor (one gather and one
scatter of the Muon parameters in bfloat16: 2 (n - 1) / n x M / n x 2 bytes per rank); and the time of a whole
training step with Muon over AdamW's, the two alternated over `--rounds` rounds (median ratio of pairs).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import muon
from benchmarks import harness
from benchmarks.harness import MiB, Row
from config import JobConfig, Optimizer, Parallelism, Training
from data.loader import Batch
from forward import ForwardBackward
from loss import Loss
from models import family, with_seq_len
from optimizer import build_optimizer
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import build_model, init_model
from tests.instruments import CollectiveLog, mesh_group_dims, observe_ops
from train import train_step

PROBLEM = "#6 Muon on shards"
LR = 0.02


def one_matrix(mesh: Any) -> dict[str, Any]:
    """The four updates of one 256 x 128 matrix; bytes of the implicit and the recipe's step."""
    torch.manual_seed(0)
    weight, grad = torch.randn(256, 128) * 0.02, torch.randn(256, 128)
    settings = dict(lr=LR, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")

    def update(param: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        before = param.detach().clone()
        optimizer.step()
        return param.detach() - before

    whole = torch.nn.Parameter(weight.clone())
    whole.grad = grad.clone()
    reference = update(whole, torch.optim.Muon([whole], **settings))
    rows = slice(dist.get_rank() * 256 // mesh.size(), (dist.get_rank() + 1) * 256 // mesh.size())

    shard = torch.nn.Parameter(weight[rows].clone())
    shard.grad = grad[rows].clone()
    per_shard = update(shard, torch.optim.Muon([shard], **settings))

    def sharded() -> torch.nn.Parameter:
        p = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
        p.grad = distribute_tensor(grad, mesh, [Shard(0)])
        return p

    implicit = sharded()
    log = CollectiveLog(mesh_group_dims(mesh))
    with observe_ops(log):
        implicit_update = update(implicit, torch.optim.Muon([implicit], **settings)).to_local()
    implicit_bytes = sum(c.sent_per_rank for c in log.records)

    recipe = sharded()
    group = {"params": [recipe], "muon": True, "momentum": 0.95, "nesterov": True, "ns_steps": 5,
             "adjust_lr_fn": "match_rms_adamw"}  # fmt: skip
    optimizer = muon.Muon([group], defaults={"lr": LR, "weight_decay": 0.0})
    log = CollectiveLog(mesh_group_dims(mesh))
    with observe_ops(log):
        recipe_update = update(recipe, optimizer).to_local()
    recipe_bytes = sum(c.sent_per_rank for c in log.records if c.op == "all_to_all")

    diff = lambda u: _max_over_ranks((u - reference[rows]).abs().max())  # noqa: E731
    return {
        "shape": [256, 128],
        "whole_max": reference.abs().max().item(),
        "whole_rms": reference.square().mean().sqrt().item(),
        "shard_diff": diff(per_shard),
        "implicit_diff": diff(implicit_update),
        "recipe_diff": diff(recipe_update),
        "implicit_bytes": implicit_bytes,
        "recipe_bytes": recipe_bytes,
    }


def _max_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def debug_model(rounds: int, seq_len: int) -> dict[str, Any]:
    """The debug model under FSDP: bytes of the optimizer step (implicit, recipe, floor) and Muon's step time over
    AdamW's."""
    world = dist.get_world_size()
    fam = family("llama3")
    parallelism = Parallelism()
    dims = ParallelDims.from_config(parallelism, world_size=world)
    mesh = dims.build_mesh("cpu")
    training = Training(seq_len=seq_len, local_batch_size=2, mixed_precision_param="float32")
    args = with_seq_len(fam.flavors["debugmodel"], seq_len)

    def build(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        cfg = JobConfig(training=training, parallelism=parallelism)
        model, _ = build_model(cfg, args, dims=dims, mesh=mesh, loss_fn=Loss(), device=torch.device("cpu"))
        init_model(model, None, device=torch.device("cpu"))
        if name == "implicit":  # torch.optim.Muon handed the DTensor hidden matrices, AdamW the rest
            hidden = set(muon.hidden_matrix_names(model, fam))
            named = dict(model.named_parameters())
            matrices = [p for n, p in named.items() if n in hidden]
            rest = [p for n, p in named.items() if n not in hidden]
            return model, _Both(
                torch.optim.Muon(matrices, lr=1e-3, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=1e-3),
            )
        if name == "Muon":
            return model, muon.build_muon(Optimizer(name="Muon", lr=1e-3), model, fam)
        return model, build_optimizer(Optimizer(lr=1e-3), model)

    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, args.vocab_size, (2, seq_len + 1), generator=generator)
    batch = [Batch(tokens[:, :-1], tokens[:, 1:], None, 1)]
    out: dict[str, Any] = {"world_size": world}
    steps: dict[str, Any] = {}
    for name in ("implicit", "Muon", "AdamW"):
        model, optimizer = build(name)
        forward_backward = ForwardBackward(model, Loss(), device=torch.device("cpu"))
        step = functools.partial(train_step, microbatches=batch, forward_backward=forward_backward,
                                 optimizer=optimizer, max_norm=1.0, stop_request=None)  # fmt: skip
        step(1)  # lazy init, optimizer state
        for p in model.parameters():
            p.grad = None
        forward_backward(batch[0], last=True)
        log = CollectiveLog(mesh_group_dims(mesh))
        with observe_ops(log):
            if isinstance(optimizer, _Both):
                optimizer.step()
            else:
                optimizer._step_unless(torch.zeros(()))
        out[f"{name}_optimizer_bytes"] = _max_over_ranks(torch.tensor(float(sum(c.sent_per_rank for c in log.records))))
        steps[name] = step
    hidden = muon.hidden_matrix_names(model, fam)
    elements = sum(dict(model.named_parameters())[n].numel() for n in hidden)
    out["muon_elements"] = elements
    out["floor_bytes"] = 2 * (world - 1) / world * elements / world * 2
    pairs = []
    for r in range(rounds):
        times = {}
        for name in ("Muon", "AdamW") if r % 2 == 0 else ("AdamW", "Muon"):
            dist.barrier()
            start = time.perf_counter()
            steps[name](2 + r)
            times[name] = time.perf_counter() - start
        pairs.append(times["Muon"] / times["AdamW"])
    out["step_time_ratio"] = statistics.median(pairs)
    out["step_time_ratios"] = pairs
    return out


class _Both:
    """Two torch optimizers stepped as one (the implicit path: torch.optim.Muon and AdamW side by side)."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step_unless_bad(self, step: int, *, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.step()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with harness.process_group():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
        return {"one_matrix": one_matrix(mesh), "debug_model": debug_model(args.rounds, args.seq_len)}


def rows(results: dict[str, Any]) -> list[Row]:
    m, d = results["one_matrix"], results["debug_model"]
    n = d["world_size"]
    return [
        Row(PROBLEM, f"max |update - the whole matrix's| (256 x 128, lr {LR}; its max {m['whole_max']:.4f})", "",
            "each shard alone", m["shard_diff"], "whole, on one owner", m["recipe_diff"]),
        Row(PROBLEM, f"bytes sent per rank in the optimizer step (debug model, FSDP {n}; floor "
            f"{d['floor_bytes'] / MiB:.2f} MiB)", "MiB", "torch.optim.Muon on DTensors",
            d["implicit_optimizer_bytes"] / MiB, "gather to owner", d["Muon_optimizer_bytes"] / MiB),
    ]  # fmt: skip


def table(results: dict[str, Any]) -> str:
    m, d = results["one_matrix"], results["debug_model"]
    lines = [
        f"one 256 x 128 matrix, lr {LR}, match_rms_adamw: whole update max {m['whole_max']:.4f}, RMS {m['whole_rms']:.4f}",
        f"  max |diff| from the whole matrix's update: each shard alone {m['shard_diff']:.5f}, torch.optim.Muon on the "
        f"DTensor {m['implicit_diff']:.5f}, the recipe {m['recipe_diff']:.5f}",
        f"  bytes sent per rank: DTensor {m['implicit_bytes']:,}, the recipe {m['recipe_bytes']:,}",
        f"debug model, FSDP {d['world_size']}, {d['muon_elements']:,} Muon parameters: optimizer-step bytes per rank "
        f"(max over ranks): DTensor-implicit {d['implicit_optimizer_bytes']:,.0f}, recipe {d['Muon_optimizer_bytes']:,.0f}, "
        f"floor {d['floor_bytes']:,.0f}; AdamW {d['AdamW_optimizer_bytes']:,.0f}",
        f"  training step time, Muon / AdamW: {d['step_time_ratio']:.3f} (median of {len(d['step_time_ratios'])} "
        "alternated pairs)",
    ]
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=6, help="alternated Muon / AdamW step pairs timed")
    p.add_argument("--seq-len", type=int, default=128)


def main(argv: list[str] | None = None) -> int:
    return harness.main("muon", argv, doc=__doc__, add_args=add_args, measure=measure, table=table, world=2)


if __name__ == "__main__":
    raise SystemExit(main())
