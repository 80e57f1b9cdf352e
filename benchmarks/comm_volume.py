"""Communication per training step, by collective and by mesh dimension, and what crosses nodes.

    python -m benchmarks.comm_volume --out outputs/bench/comm_volume.json   # starts torchrun (4 CPU ranks) itself
    torchrun --nproc_per_node=4 -m benchmarks.comm_volume --out ...          # the same, launched by hand

docs/failures.md #3: HYBRID_SHARD across two nodes ran at 26 s per step instead of ~0.7 s. Before
blaming the model, look at how many bytes each layout puts on the links between nodes. The
world is cut into "nodes" of `--ranks-per-node` consecutive ranks (default: the real nodes when
torchrun runs on several, otherwise two pretend ones: 4 CPU ranks = nodes {0,1} and {2,3}), and
one step of the recipe's model is measured under three data-parallel layouts built with the
recipe's own ParallelDims and apply_fsdp:

    full_shard  FSDP over all ranks          mesh dp_shard = world
    hsdp        replicate x shard            dp_replicate = nodes, dp_shard = ranks per node
    replicate   DDP-like, no sharding        dp_replicate = world, dp_shard = 1

With gradient accumulation (`hsdp_accum4`: the hsdp layout, 4 micro-batches a step) the replicas still all-reduce
once per step: train.py defers it to the last micro-batch (parallelisms/fsdp.py sync_gradients_on).
`hsdp_accum4_every` is the same step with that call taken out, FSDP2's default: an all-reduce per micro-batch, 4
times the bytes over the slowest links (torchtitan 0.2.2's loop does the same). `hsdp_accum4_defer` also defers
the reduce-scatters inside a node to the last micro-batch (parallelism.fsdp_defer_reduce_scatter): the bytes of
one micro-batch in every collective but the all-gathers, for unsharded gradients held through the step.

"replicate" is fully_shard on a (world, 1) HSDP mesh, exactly what ParallelDims builds for
data_parallel_replicate_degree = world: every rank keeps whole parameters (the all-gathers and
reduce-scatters run over one-rank groups and move nothing) and each gradient is all-reduced
over all ranks, which is the traffic of DDP. torch DDP would move the same bytes in other
bucket sizes; fully_shard keeps all three layouts on one code path with the same counter.

How bytes are counted: `planning.trace.observe_ops` (a TorchDispatchMode) around one step of the
recipe's own `train.train_step` (AdamW, grad norm clipped to 1.0) sees every collective as the
dispatcher op that really runs it. FSDP2 calls c10d directly (all_gather_into_tensor ->
`c10d::_allgather_base_`, reduce_scatter_tensor -> `c10d::_reduce_scatter_base_`, HSDP's
all_reduce -> `c10d::allreduce_`); DTensor (the gradient norm) lowers itself to functional
collectives (`_c10d_functional::all_reduce`, ...). Both kinds go through the dispatcher, with the real
tensors and the real process group as arguments, so sizes are read off the tensors that are
sent, not derived from the model. Any other collective op is recorded as "other:<name>"
rather than skipped. (CommDebugMode sees the same ops but only counts calls.)

For each collective: op, the group's ranks, its mesh dimension, and the payload S: the
full-size buffer (the gathered output of an all-gather, the input of a reduce-scatter, the
tensor of an all-reduce). Bytes sent per rank follow the ring algorithm over a group of n
ranks: (n-1)/n * S for all-gather and reduce-scatter, 2(n-1)/n * S for all-reduce (a
reduce-scatter then an all-gather). Cross-node model: the ring visits the group's ranks in
rank order and closes back to the first; each of its n directed links carries what one rank
sends; a link crosses nodes when its two ranks sit on different nodes. With nodes of
consecutive ranks, a group spanning two nodes has exactly 2 such links (4 ranks 0-1-2-3-0:
1->2 and 3->0; the pair 0,2: 0->2 and 2->0). Cross-node bytes per step = sum over every group
of the job (counted once, not once per member) of crossing links x per-link bytes. Real NCCL
picks rings, trees or several channels; the model is a simple, explicit yardstick that ranks
layouts, not a prediction of one NIC's load.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import time
from collections import defaultdict
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from benchmarks import harness
from benchmarks.harness import MiB, Row
from config import Optimizer
from data.loader import Batch
from forward import ForwardBackward
from loss import Loss
from models import with_seq_len
from models.llama3 import FLAVORS, ModelArgs, Transformer
from optimizer import build_optimizer
from parallelisms.fsdp import DTYPES, apply_fsdp
from parallelisms.parallel_dims import ParallelDims
from tests.instruments import Collective, CollectiveLog, mesh_group_dims, observe_ops
from train import train_step

PROBLEM = "#3 HSDP across nodes"
LAYOUTS = ("full_shard", "hsdp", "replicate", "hsdp_accum4", "hsdp_accum4_every", "hsdp_accum4_defer")
ACCUM = 4  # micro-batches per step of the hsdp_accum4 layouts


# ------------------------------------------------------------------ one layout


def layout_dims(layout: str, *, world_size: int, ranks_per_node: int) -> ParallelDims:
    nodes = world_size // ranks_per_node
    match layout.removesuffix("_every").removesuffix("_defer").removesuffix("_accum4"):
        case "full_shard":
            replicate, shard = 1, world_size
        case "hsdp":
            replicate, shard = nodes, ranks_per_node
        case "replicate":
            replicate, shard = world_size, 1
        case _:
            raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    return ParallelDims(dp_replicate=replicate, dp_shard=shard, tp=1, world_size=world_size)


def unit_params(args: ModelArgs) -> dict[str, int]:
    """Parameters of each FSDP unit apply_fsdp creates (counted on the meta device)."""
    with torch.device("meta"):
        model = Transformer(args)
    count = lambda *mods: sum(p.numel() for m in mods if m is not None for p in m.parameters())  # noqa: E731
    return {
        "tok_embeddings": count(model.tok_embeddings),
        "layers": count(*model.layers.values()),
        "norm_output": count(model.norm, model.output),
    }


def measure(
    layout: str,
    *,
    model_args: ModelArgs,
    ranks_per_node: int,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: str = "default",
    batch_size: int = 2,
    seq_len: int = 64,
    device: torch.device,
) -> dict[str, Any]:
    """Count the collectives of one training step (after a warm-up step) under `layout`.

    Called on every rank of an initialized process group; returns the same job-wide summary
    on every rank.
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size % ranks_per_node or world_size // ranks_per_node < 2:
        raise ValueError(f"ranks_per_node={ranks_per_node} must split the {world_size} ranks into 2 or more nodes")
    dims = layout_dims(layout, world_size=world_size, ranks_per_node=ranks_per_node)
    mesh = dims.build_mesh(device.type)
    # As parallelize_model does: a 2-D mesh for HSDP, the shard dimension alone for FSDP.
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.hsdp_enabled else mesh["dp_shard"]
    group_dims = mesh_group_dims(mesh)

    with torch.device("meta"):
        model = Transformer(model_args)
    apply_fsdp(
        model,
        dp_mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward,
    )
    model.to_empty(device=device)
    model.init_weights()
    optimizer = build_optimizer(Optimizer(lr=1e-4), model)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, model_args.vocab_size, (batch_size, seq_len + 1), generator=generator).to(device)

    grad_accum = ACCUM if "_accum4" in layout else 1
    # FSDP2's default, an all-reduce per micro-batch: train.py's deferral taken out.
    every = mock.patch("forward.sync_gradients_on") if layout.endswith("_every") else contextlib.nullcontext()

    def step() -> None:
        microbatches = [Batch(tokens[:, :-1], tokens[:, 1:], None, grad_accum)] * grad_accum
        defer = layout.endswith("_defer")  # parallelism.fsdp_defer_reduce_scatter
        forward_backward = ForwardBackward(model, Loss(), device=device, defer_reduce_scatter=defer)
        with every:
            train_step(1, microbatches, forward_backward, optimizer, max_norm=1.0, stop_request=None)

    step()  # warm-up: lazy init, optimizer state
    log = CollectiveLog(group_dims)
    dist.barrier()
    start = time.perf_counter()
    with observe_ops(log):
        step()
    seconds = time.perf_counter() - start

    everyone: list[list[Collective]] = [[] for _ in range(world_size)]
    dist.all_gather_object(everyone, log.records)
    return summarize(
        layout,
        everyone,
        dims=dims,
        ranks_per_node=ranks_per_node,
        seconds=seconds,
        meta={
            "param_dtype": str(param_dtype).removeprefix("torch."),
            "reduce_dtype": str(reduce_dtype).removeprefix("torch."),
            "reshard_after_forward": reshard_after_forward,
            "grad_accum": grad_accum,
            "unit_params": unit_params(model_args),
            "model_args": dataclasses.asdict(model_args),
        },
    )


def summarize(
    layout: str,
    everyone: list[list[Collective]],
    *,
    dims: ParallelDims,
    ranks_per_node: int,
    seconds: float,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """Per-rank bytes (rank 0's view) and job-wide bytes (each group counted once, by its first rank)."""

    def per_rank(records: list[Collective]) -> dict[str, Any]:
        by_op: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "payload_bytes": 0, "sent_bytes": 0})
        by_dim: dict[str, int] = defaultdict(int)
        for c in records:
            by_op[c.op]["calls"] += 1
            by_op[c.op]["payload_bytes"] += c.payload_bytes
            by_op[c.op]["sent_bytes"] += c.sent_per_rank
            by_dim[c.dim] += c.sent_per_rank
        return {"by_op": dict(by_op), "sent_bytes_by_dim": dict(by_dim), "sent_bytes": sum(by_dim.values())}

    groups: dict[tuple, dict[str, Any]] = {}
    cross = intra = 0
    for rank, records in enumerate(everyone):
        for c in records:
            if c.ranks[0] != rank:  # every member saw it; count it once
                continue
            links = c.crossing_links(ranks_per_node)
            row = groups.setdefault(
                (c.op, c.dim, c.ranks),
                {
                    "op": c.op,
                    "dim": c.dim,
                    "ranks": list(c.ranks),
                    "spans_nodes": links > 0,
                    "calls": 0,
                    "payload_bytes": 0,
                    "sent_bytes_per_rank": 0,
                    "cross_node_bytes": 0,
                },
            )
            row["calls"] += 1
            row["payload_bytes"] += c.payload_bytes
            row["sent_bytes_per_rank"] += c.sent_per_rank
            row["cross_node_bytes"] += links * c.sent_per_rank
            cross += links * c.sent_per_rank
            intra += (len(c.ranks) - links) * c.sent_per_rank
    return {
        "layout": layout,
        "mesh": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard},
        "world_size": dims.world_size,
        "ranks_per_node": ranks_per_node,
        "nodes": dims.world_size // ranks_per_node,
        **meta,
        "rank0": per_rank(everyone[0]),
        "sent_bytes_per_rank": [per_rank(records)["sent_bytes"] for records in everyone],
        "groups": list(groups.values()),
        "cross_node_bytes": cross,
        "intra_node_bytes": intra,
        "step_seconds": seconds,
    }


# ------------------------------------------------------------------- reporting


def rows(results: dict[str, dict[str, Any]]) -> list[Row]:
    """Bytes crossing nodes: FULL_SHARD and pure replication vs HSDP."""
    full, hsdp, rep = (results[k]["cross_node_bytes"] / MiB for k in ("full_shard", "hsdp", "replicate"))
    world, nodes, per_node = (results["hsdp"][k] for k in ("world_size", "nodes", "ranks_per_node"))
    metric = f"bytes crossing nodes per step ({nodes} nodes x {per_node} ranks)"
    row = functools.partial(
        Row, problem=PROBLEM, metric=metric, unit="MiB", fixed=f"HSDP {nodes} x {per_node}", fixed_value=hsdp
    )
    rows = [
        row(broken=f"FULL_SHARD over {world}", broken_value=full),
        row(broken=f"replication over {world}", broken_value=rep),
    ]
    accumulated = functools.partial(Row, problem=PROBLEM, unit="MiB")
    where = f"HSDP {nodes} x {per_node}, {ACCUM} micro-batches"
    if "hsdp_accum4" in results and "hsdp_accum4_every" in results:
        once, every = (results[k]["cross_node_bytes"] / MiB for k in ("hsdp_accum4", "hsdp_accum4_every"))
        rows.append(accumulated(metric=f"bytes crossing nodes per step, {where}", broken="all-reduce per micro-batch",
                                broken_value=every, fixed="once per step", fixed_value=once))  # fmt: skip
    if "hsdp_accum4" in results and "hsdp_accum4_defer" in results:
        per_mb, once = (_sent(results[k], "reduce_scatter") / MiB for k in ("hsdp_accum4", "hsdp_accum4_defer"))
        rows.append(accumulated(metric=f"reduce-scatter bytes per step inside a node, {where}", broken="per micro-batch",
                                broken_value=per_mb, fixed="fsdp_defer_reduce_scatter", fixed_value=once))  # fmt: skip
    return rows


def _sent(result: dict[str, Any], op: str) -> float:
    """Rank 0's bytes sent per step by one kind of collective."""
    return result["rank0"]["by_op"].get(op, {}).get("sent_bytes", 0)


def table(results: dict[str, dict[str, Any]]) -> str:
    """Bytes per step: sent by rank 0 by op and mesh dim (ring model), job-wide cross-node bytes."""
    base = results.get("full_shard", {}).get("cross_node_bytes")
    head = (
        f"{'layout':<17} {'rep x shard':>11} | {'all_gather':>10} {'red_scat':>10} {'all_reduce':>10} | "
        f"{'dp_shard':>10} {'dp_repl':>10} | {'cross-node':>10} {'vs full':>8}"
    )
    lines = [
        "MiB per step; op and dim columns: sent by rank 0; cross-node: whole job, ring model",
        head,
        "-" * len(head),
    ]
    for name, r in results.items():
        by_dim = r["rank0"]["sent_bytes_by_dim"]
        sent = {op: _sent(r, op) / MiB for op in ("all_gather", "reduce_scatter", "all_reduce")}
        ratio = f"{r['cross_node_bytes'] / base:.3f}x" if base else "n/a"
        lines.append(
            f"{name:<17} {r['mesh']['dp_replicate']:>5} x {r['mesh']['dp_shard']:<3} | "
            f"{sent['all_gather']:>10.2f} {sent['reduce_scatter']:>10.2f} {sent['all_reduce']:>10.2f} | "
            f"{by_dim.get('dp_shard', 0) / MiB:>10.2f} {by_dim.get('dp_replicate', 0) / MiB:>10.2f} | "
            f"{r['cross_node_bytes'] / MiB:>10.2f} {ratio:>8}"
        )
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--ranks-per-node", type=int, default=None, help="default: real nodes if several, else world // 2")
    p.add_argument("--flavor", default="debugmodel", choices=sorted(FLAVORS))
    p.add_argument("--n-layers", type=int, default=None, help="override the flavor's layer count (smaller, faster)")
    p.add_argument("--param-dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--reduce-dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--reshard-after-forward", default="default", choices=["default", "always", "never"])
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2)


def measure_args(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every layout of `args`, on every rank of this torchrun launch."""
    model_args = with_seq_len(FLAVORS[args.flavor], args.seq_len)
    if args.n_layers is not None:
        model_args = dataclasses.replace(model_args, n_layers=args.n_layers)
    with harness.process_group() as device:
        world_size = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        ranks_per_node = args.ranks_per_node or (local if local < world_size else world_size // 2)
        return {
            layout: measure(
                layout, model_args=model_args, ranks_per_node=ranks_per_node, param_dtype=DTYPES[args.param_dtype],
                reduce_dtype=DTYPES[args.reduce_dtype], reshard_after_forward=args.reshard_after_forward,
                batch_size=args.batch_size, seq_len=args.seq_len, device=device,
            )
            for layout in args.layouts
        }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return harness.main("comm_volume", argv, doc=__doc__, add_args=add_args, measure=measure_args, table=table, world=4)


if __name__ == "__main__":
    raise SystemExit(main())
