"""Network preflight: all_reduce bus bandwidth inside each node, between nodes and over all ranks.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HEAD:29500 \\
        --rdzv_id=preflight scripts/net_preflight.py               # real nodes (scripts/run_multinode.sh)
    torchrun --nproc_per_node=4 scripts/net_preflight.py --ranks-per-node 2   # one machine, 2 pretend nodes

Run it before a multi-node job (docs/failures.md #3: HYBRID_SHARD at 26 s per step instead of
~0.7 s): a slow link between nodes (TCP over Ethernet where InfiniBand/EFA was expected, a
wrong NCCL_SOCKET_IFNAME, a missing EFA/IB plugin) shows here in a minute, not after hours of
slow training. NCCL on CUDA, gloo on CPU; float32 tensors.

A node is `--ranks-per-node` consecutive ranks (default LOCAL_WORLD_SIZE: torchrun numbers the
ranks of one node consecutively). Rows, one per process group, each measured separately:

    intra node k       the ranks of node k; all nodes at once (NVLink / shared memory)
    inter 1/node       local rank 0 of every node, alone: one cross-node path
    inter lr j         local rank j of every node, all j at once: HSDP's gradient all-reduce
    world              all ranks: FULL_SHARD's all-gathers and reduce-scatters, DDP's all-reduce

Bus bandwidth follows nccl-tests: busbw = 2(n-1)/n x bytes / time, the rate each rank's link
must sustain, comparable across group sizes. The time of a group is the slowest member's mean
over --iters calls after --warmup calls. A warning is printed when the world group's busbw at
the largest size is below --warn-ratio (default 1/10) of the slowest node's intra-node busbw,
or when one node is much slower inside than the others; --strict turns a warning into exit 3.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """'4K', '1M', '256M', '1G' or plain bytes -> bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def format_size(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


def format_ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    parts, start = [], ranks[0]
    for prev, cur in zip(ranks, [*ranks[1:], None], strict=True):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(parts)


def busbw_gbps(nbytes: int, n: int, seconds: float) -> float:
    return 2 * (n - 1) / n * nbytes / seconds / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_all_reduce(nbytes: int, group: dist.ProcessGroup, *, device: torch.device, iters: int, warmup: int) -> float:
    """Mean seconds per all_reduce of nbytes over `group`, as seen by this rank."""
    tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(tensor, group=group)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor, group=group)
    _sync(device)
    return (time.perf_counter() - start) / iters


def build_phases(world_size: int, ranks_per_node: int) -> list[list[tuple[str, list[int]]]]:
    """Groups measured together, phase by phase: [(row name, ranks), ...]."""
    nodes = world_size // ranks_per_node
    node_ranks = [list(range(k * ranks_per_node, (k + 1) * ranks_per_node)) for k in range(nodes)]
    across = [[k * ranks_per_node + j for k in range(nodes)] for j in range(ranks_per_node)]
    phases = []
    if ranks_per_node > 1:
        phases.append([(f"intra node {k}", ranks) for k, ranks in enumerate(node_ranks)])
    if nodes > 1:
        phases.append([("inter 1/node", across[0])])
        if ranks_per_node > 1:
            phases.append([(f"inter lr {j}", ranks) for j, ranks in enumerate(across)])
    phases.append([("world", list(range(world_size)))])
    return phases


def check(rows: list[dict], *, warn_ratio: float) -> list[str]:
    """Warnings from the largest message size: slow inter-node links, one slow node."""
    size = list(rows[0]["busbw"])[-1]  # sizes are sorted: the largest message
    intra = {r["group"]: r["busbw"][size] for r in rows if r["group"].startswith("intra")}
    world = next(r["busbw"][size] for r in rows if r["group"] == "world")
    warnings = []
    if intra and any(r["group"].startswith("inter") for r in rows):
        slowest = min(intra.values())
        if world < warn_ratio * slowest:
            warnings.append(
                f"all-rank busbw {world:.2f} GB/s at {size} is below {warn_ratio:g} x the intra-node busbw "
                f"({slowest:.2f} GB/s): the link between nodes is the bottleneck. Check that NCCL uses "
                "InfiniBand/EFA (NCCL_DEBUG=INFO shows 'NET/IB' or 'NET/OFI', not 'NET/Socket'), "
                "NCCL_SOCKET_IFNAME and NCCL_IB_HCA / FI_PROVIDER=efa; prefer HSDP "
                "(data_parallel_replicate_degree = nodes) so only gradient shards cross nodes."
            )
    if len(intra) > 1:
        median = sorted(intra.values())[len(intra) // 2]
        for group, bw in intra.items():
            if bw < 0.5 * median:
                warnings.append(f"{group}: intra-node busbw {bw:.2f} GB/s is under half the median ({median:.2f} GB/s)")
    return warnings


def render(rows: list[dict], sizes: list[str], header: str) -> str:
    lines = [header, f"{'group':<14} {'ranks':<12}" + "".join(f"{s:>10}" for s in sizes)]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        lines.append(f"{r['group']:<14} {r['ranks']:<12}" + "".join(f"{r['busbw'][s]:>10.3f}" for s in sizes))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks-per-node", type=int, default=None, help="default: LOCAL_WORLD_SIZE (torchrun)")
    p.add_argument(
        "--sizes", default=None, help="message sizes, e.g. 1M,16M,256M (default: that on CUDA, 256K,1M,4M on CPU)"
    )
    p.add_argument("--iters", type=int, default=None, help="timed calls per size (default 20 CUDA, 5 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 5 CUDA, 1 CPU)")
    p.add_argument("--warn-ratio", type=float, default=0.1, help="warn when all-rank busbw < this x intra-node busbw")
    p.add_argument("--strict", action="store_true", help="exit 3 when a warning is printed")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    cuda = device.type == "cuda"
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ranks_per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % ranks_per_node:
        if rank == 0:
            print(
                f"error: --ranks-per-node {ranks_per_node} does not divide the world size {world_size}", file=sys.stderr
            )
        dist.destroy_process_group()
        return 2
    default_sizes = "1M,4M,16M,64M,256M" if cuda else "256K,1M,4M"
    sizes = sorted(parse_size(s) for s in (args.sizes or default_sizes).split(","))
    iters = args.iters or (20 if cuda else 5)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)

    hosts: list[str] = [""] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    phases = build_phases(world_size, ranks_per_node)
    # Every rank creates every group, in the same order (new_group is collective over the world).
    groups = [[(name, ranks, dist.new_group(ranks)) for name, ranks in phase] for phase in phases]

    mine: dict[tuple[str, int], float] = {}  # (row, size) -> this rank's seconds per call
    for phase in groups:
        for size in sizes:
            dist.barrier()
            for name, ranks, group in phase:
                if rank in ranks:
                    mine[name, size] = time_all_reduce(size, group, device=device, iters=iters, warmup=warmup)
    everyone: list[dict] = [{}] * world_size
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    if rank != 0:
        return 0

    labels = [format_size(s) for s in sizes]
    rows = []
    for phase in groups:
        for name, ranks, _ in phase:
            seconds = {s: max(everyone[r][name, s] for r in ranks) for s in sizes}  # the slowest member
            rows.append(
                {
                    "group": name,
                    "ranks": format_ranks(ranks),
                    "n": len(ranks),
                    "busbw": {
                        label: busbw_gbps(s, len(ranks), seconds[s]) for label, s in zip(labels, sizes, strict=True)
                    },
                    "seconds": {label: seconds[s] for label, s in zip(labels, sizes, strict=True)},
                }
            )
    nodes = world_size // ranks_per_node
    backend = "nccl" if cuda else "gloo"
    header = (
        f"all_reduce busbw GB/s = 2(n-1)/n x bytes / time | {backend}, float32, "
        f"{world_size} ranks = {nodes} node(s) x {ranks_per_node} | {iters} iters after {warmup} warm-up\n"
        f"nodes: " + ", ".join(f"{k}={hosts[k * ranks_per_node]}" for k in range(nodes))
    )
    print(render(rows, labels, header), flush=True)
    warnings = check(rows, warn_ratio=args.warn_ratio)
    for warning in warnings:
        print(f"WARNING: {warning}", flush=True)
    if not warnings:
        print("preflight ok", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"benchmark": "net_preflight", "world_size": world_size, "ranks_per_node": ranks_per_node,
                  "hosts": hosts, "rows": rows, "warnings": warnings}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 3 if warnings and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
