"""Expert parallel: each MoE block's routed experts split over the "ep" ranks, every token sent to the rank of its
expert and back by all-to-all (parallelism.expert_parallel_degree).

An experts module holds 3-D weights (experts, out, in) and runs forward(x, tokens_per_expert) over rows sorted by
expert (models/qwen3_moe/model.py GroupedExperts). `apply_ep` shards those weights over the ep ranks on dim 0, so
that rank r holds experts [r * local, (r + 1) * local) with local = experts / ep, as DTensors: checkpoints see the
full (experts, out, in) shapes, and FSDP can shard each rank's slice again over the data-parallel ranks left over.
It then puts the token exchange around the module's own forward, which runs on the local slices:

  * dispatch: the ranks swap their counts per expert (one all_to_all_single of `experts` int64), then every rank
    sends each other rank the rows of that rank's experts (one all_to_all_single of the rows). Its rows are already
    sorted by global expert id, so the rows for rank r are one contiguous run. What arrives is ordered (source rank,
    local expert); the experts want (local expert, source rank): the blocks are regrouped.
  * the experts' forward on the local weights, counts per local expert summed over the sources.
  * combine: the blocks put back in (source rank, local expert) order and the rows sent home by the reverse
    all_to_all_single. Backward runs the two token all-to-alls again, reversed (their autograd).

No capacity factor and no padding: no token is dropped, however unbalanced the routing, at the price of split sizes
that change every step. An all-to-all needs its split sizes on the host, so each MoE layer reads the exchanged counts
into Python once (`.tolist()`): on a GPU that is one device-to-host sync per MoE layer and forward (again in an
activation-checkpointed block's recomputation), as torchtitan 0.2.2's ExpertParallel has. The regrouping uses those
same host numbers and reads nothing more.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from errors import ConfigError

COUNT_BYTES = 8  # the exchanged counts per expert are int64


def check_ep(*, ep: int, num_experts: int, compiled: bool) -> None:
    """What expert parallel of degree `ep` needs of the model and the run: every problem in one ConfigError. (That ep
    divides the ranks holding their own tokens is ParallelDims' rule.)"""
    problems = []
    if num_experts % ep:
        problems.append(
            f"parallelism.expert_parallel_degree: {ep} does not divide the model's {num_experts} experts (each rank "
            f"holds experts / {ep} of them); use a divisor of {num_experts}"
        )
    if compiled:
        problems.append(
            f"compile.enable: with parallelism.expert_parallel_degree {ep} each MoE block reads its all-to-all's split "
            "sizes to the host mid-block, which a whole-block compiled graph cannot hold (not supported yet); turn "
            "compile off or set expert_parallel_degree = 1"
        )
    if problems:
        raise ConfigError(*problems)


def apply_ep(model: nn.Module, mesh: DeviceMesh, *, experts: str) -> None:
    """Split the experts of every block of `model` (`experts`: their name inside a block, the family's
    experts_module) over the 1-D "ep" `mesh` (shard_experts). On the meta device, after TP and before FSDP."""
    for block in model.layers.values():
        shard_experts(block.get_submodule(experts), mesh)


def shard_experts(experts: nn.Module, mesh: DeviceMesh) -> None:
    """Split `experts` (3-D weights (experts, ...) and forward(x, tokens_per_expert) over rows sorted by expert) over
    the 1-D `mesh`: each weight becomes a DTensor sharded on dim 0 (Shard(0)), and the module's forward dispatches its
    rows to their experts' ranks, runs the local experts and combines (the module docstring). Works on the meta
    device, before FSDP; the caller (its rows and counts, the module's output) is unchanged."""
    ep = mesh.size()
    for name, param in list(experts.named_parameters(recurse=False)):
        assert param.shape[0] % ep == 0, f"{name}: {param.shape[0]} experts over {ep} ranks (check_ep)"
        sharded = nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        experts.register_parameter(name, sharded)
    experts.forward = functools.partial(_expert_parallel_forward, experts, experts.forward, mesh)


def _expert_parallel_forward(
    experts: nn.Module, local_forward: Callable[..., torch.Tensor], mesh: DeviceMesh, x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """x (rows, dim) sorted by global expert id, tokens_per_expert (experts,) -> (rows, dim) in x's order."""
    routed, local_counts, exchange = dispatch(x, tokens_per_expert, mesh=mesh)
    if exchange.received_rows == 0:
        # Nothing came: the experts run on one zero row all the same (its output dropped), since the grouped matmul
        # refuses zero rows (PyTorch 2.13 CPU: "Invalid strides/sizes"). Appended to the empty rows, not in their
        # place: backward must still reach dispatch's all-to-all, which the other ranks run too, and every rank's
        # local weights get a gradient (zeros), so that FSDP reduces the same set everywhere.
        routed = torch.cat([routed, routed.new_zeros(1, routed.shape[1])])
        local_counts = torch.zeros_like(local_counts)
        local_counts[0] = 1
    with _local_weights(experts):
        out = local_forward(routed, local_counts)
    return combine(out[: exchange.received_rows], exchange)


@contextlib.contextmanager
def _local_weights(module: nn.Module) -> Iterator[None]:
    """The module's DTensor parameters replaced, while its forward runs, by their local shards (`to_local`, which
    sends the gradients back to the DTensors): the experts' rows are a different number on every rank, which no
    DTensor placement describes, so the module computes on plain tensors and knows nothing of meshes. Writes
    `_parameters` in place (what torch.func.functional_call does inside, PyTorch 2.13), keeping the order of the
    names; FSDP has swapped in its gathered parameters before this runs and swaps them out after."""
    params = module._parameters
    held = {name: p for name, p in params.items() if isinstance(p, DTensor)}
    try:
        for name, p in held.items():
            params[name] = p.to_local()
        yield
    finally:
        params.update(held)


@dataclass(frozen=True)
class Exchange:
    """What combine needs of one dispatch: the row counts, read to the host once."""

    mesh: DeviceMesh
    sent: list[int]  # rows this rank sends to each rank (its own included), in rank order
    received: list[int]  # rows each rank sends this one
    blocks: list[int]  # rows received per (source rank, local expert), source-major: the order they arrive in

    @property
    def received_rows(self) -> int:
        return sum(self.received)


def dispatch(
    x: torch.Tensor, tokens_per_expert: torch.Tensor, *, mesh: DeviceMesh
) -> tuple[torch.Tensor, torch.Tensor, Exchange]:
    """x (rows, dim) sorted by global expert id, tokens_per_expert (experts,) -> (the rows of this rank's experts
    from every rank (received rows, dim), sorted by local expert; their counts per local expert (experts / ep,); the
    Exchange for `combine`)."""
    ep, experts = mesh.size(), tokens_per_expert.shape[0]
    local = experts // ep
    with torch.no_grad():
        # (experts,): for each source rank, its counts for this rank's local experts
        theirs = funcol.all_to_all_single(tokens_per_expert, None, None, mesh)
        # The one device-to-host read of the layer: all_to_all_single takes its split sizes as Python ints.
        counts = torch.cat([tokens_per_expert, theirs]).tolist()
    mine, blocks = counts[:experts], counts[experts:]
    exchange = Exchange(
        mesh=mesh,
        sent=[sum(mine[r * local : (r + 1) * local]) for r in range(ep)],
        received=[sum(blocks[r * local : (r + 1) * local]) for r in range(ep)],
        blocks=blocks,
    )
    routed = funcol.all_to_all_single_autograd(x, exchange.received, exchange.sent, mesh)  # (source, local expert)
    local_counts = theirs.view(ep, local).sum(dim=0)  # (local,), on x's device: no second host read
    return _regroup(routed, blocks, outer=ep, inner=local), local_counts, exchange


def combine(out: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """The local experts' output (received rows, dim) in dispatch's order -> this rank's rows (rows, dim) in the
    order they were dispatched: the blocks back in arrival order, then the rows home (the reverse all-to-all)."""
    ep = exchange.mesh.size()
    local = len(exchange.blocks) // ep
    by_expert = [exchange.blocks[s * local + e] for e in range(local) for s in range(ep)]
    arrived = _regroup(out, by_expert, outer=local, inner=ep)
    return funcol.all_to_all_single_autograd(arrived, exchange.sent, exchange.received, exchange.mesh)


def _regroup(x: torch.Tensor, sizes: list[int], *, outer: int, inner: int) -> torch.Tensor:
    """x's rows in outer x inner consecutive blocks of `sizes` (outer-major) -> the same blocks inner-major: a
    transpose of the block grid, by host sizes (no index tensor, and its backward is the transpose back)."""
    blocks = x.split(sizes)
    return torch.cat([blocks[o * inner + i] for i in range(inner) for o in range(outer)])


def all_to_all_bytes(
    *, sent_rows: int, received_rows: int, dim: int, element_size: int, num_experts: int, ep: int,
    backward: bool = True,
) -> int:  # fmt: skip
    """Bytes one rank sends to the other ranks of its ep group in one MoE layer's dispatch and combine.

    sent_rows: this rank's rows (token, choice pairs) routed to experts on other ranks; received_rows: the other
    ranks' rows routed to this rank's experts. Forward, dispatch sends sent_rows rows of dim elements and combine
    sends received_rows back; backward sends the gradients of the same rows the other way (combine's backward
    sent_rows, dispatch's received_rows). The counts exchange, forward only, sends num_experts / ep int64 counts to
    each other rank. Without the routing (a plan) balanced experts give sent_rows = received_rows = tokens * top_k *
    (ep - 1) / ep. An activation-checkpointed block recomputes its forward up to the last tensor backward needs:
    through combine (once more with backward=False) where later ops keep the experts' output, as the routing
    weights' product of models/qwen3_moe/model.py `combine` does; only the counts and dispatch's sent_rows where
    nothing after the experts is kept (a checkpointed experts module alone).
    """
    rows = (sent_rows + received_rows) * (2 if backward else 1)
    return rows * dim * element_size + (ep - 1) * (num_experts // ep) * COUNT_BYTES
