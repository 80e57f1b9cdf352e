"""Muon for a family's hidden matrices, AdamW for every other parameter, and each matrix orthogonalized whole
however FSDP, TP or HSDP shard it (docs/failures.md #6).

Muon's update is the Newton-Schulz orthogonalization of a matrix's (Nesterov) momentum: a function of the whole
matrix, not of its elements. Orthogonalizing each rank's shard alone, which is what any optimizer handed local
tensors does, is a different optimizer that trains without an error (optimizer.muon_orthogonalize = "shard"
reproduces it). Handing torch.optim.Muon the DTensor parameters is exact, but each of the iteration's matmuls
redistributes its operands; the bytes are in docs/benchmarks.md.

What this module does instead (the scheme of Moonlight's distributed Muon and Dion): the momentum stays sharded
like its parameter (it is elementwise); each step, the matrices of one shard group are dealt round-robin to its
ranks, every rank sends its block of matrix j to the rank that owns j (one all_to_all_single per n matrices, in
bfloat16, the precision the iteration runs in), the owner orthogonalizes the whole matrix with torch.optim.Muon's
own iteration, and a second all_to_all_single sends each block back. Per step that is one gather and one scatter
of the Muon parameters, the floor, and each rank runs the iteration on about 1/n of the matrices. Dimensions that
replicate a parameter (HSDP's replicas) each do the same work, with no bytes between them.

Which parameters are hidden matrices is the family's (ModelFamily.hidden_matrices); the update, lr adjustment and
weight decay are torch.optim.Muon's, step for step. The two halves are two optimizers, torch.optim.AdamW and `Muon`
here, behind optimizer.py's skip-step gate: it hands both the same 0/1 device tensor as GradScaler's found_inf
(fused AdamW's kernel reads it; `Muon` keeps its old momentum and weights through a `where`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

# torch.optim.Muon's iteration, its default coefficients and lr rule (module-private in PyTorch 2.13): the update is
# theirs, step for step.
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz

from config import Optimizer, Training
from errors import warn
from models import ModelFamily
from optimizer import SkipStepOptimizer, adamw_settings, skip_rules


def hidden_matrix_names(model: torch.nn.Module, fam: ModelFamily) -> list[str]:
    """The parameters Muon updates: the weights of the family's hidden_matrices in every block."""
    linears = "|".join(re.escape(name) for name in fam.hidden_matrices)
    pattern = re.compile(rf"layers\.\d+\.({linears})\.weight")
    return [name for name, p in model.named_parameters() if pattern.fullmatch(name) and p.ndim == 2]


def build_muon(
    o: Optimizer, model: torch.nn.Module, fam: ModelFamily, *, training: Training | None = None, pp_degree: int = 1
) -> SkipStepOptimizer:
    """optimizer.name = "Muon": Muon over the family's hidden matrices, AdamW over the rest, behind optimizer.py's
    skip-step gate (build_optimizer's `training` and `pp_degree`)."""
    others, hidden = param_groups(model, fam, o)
    adamw = torch.optim.AdamW([others], **adamw_settings(o))
    # Muon's group holds AdamW's settings too (betas, eps, the kernel's flags): the layout checkpoints have held
    # since both halves were one AdamW's two groups, and set_hyperparameters sets them in every group.
    muon = Muon([hidden], defaults=dict(adamw.defaults), whole=o.muon_orthogonalize == "matrix")
    return SkipStepOptimizer([adamw, muon], **skip_rules(model, training=training, pp_degree=pp_degree))


def param_groups(model: torch.nn.Module, fam: ModelFamily, o: Optimizer) -> list[dict[str, Any]]:
    """Two groups: AdamW's (everything else) and Muon's (the hidden matrices), each with its own settings."""
    hidden = set(hidden_matrix_names(model, fam))
    named = list(model.named_parameters())
    return [
        {"params": [p for name, p in named if name not in hidden], "muon": False},
        {
            "params": [p for name, p in named if name in hidden],
            "muon": True,
            "momentum": o.muon_momentum,
            "nesterov": o.muon_nesterov,
            "ns_steps": o.muon_ns_steps,
            "adjust_lr_fn": o.muon_adjust_lr_fn,
        },
    ]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _Matrix:
    """Where one matrix's blocks live: its shard group, and every group rank's rows and columns of it."""

    shape: torch.Size
    group: dist.ProcessGroup | None  # None: whole on this rank (one process, or replicated)
    rows: list[torch.Tensor]  # by group rank
    cols: list[torch.Tensor]

    def block_numel(self, rank: int) -> int:
        return len(self.rows[rank]) * len(self.cols[rank])


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}  # one process group per set of ranks, made once


def _shard_group(p: DTensor) -> dist.ProcessGroup | None:
    """The ranks that hold different blocks of p: its mesh's sharded dimensions (one group over both under FSDP x TP,
    made among its own ranks: DeviceMesh._flatten would also change the groups DTensor reduces over elsewhere)."""
    mesh = p.device_mesh
    # FSDP over TP's column shards is a _StridedShard, which is no Shard (is_shard() is False in PyTorch 2.13).
    dims = [i for i, placement in enumerate(p.placements) if not (placement.is_replicate() or placement.is_partial())]
    if not dims:
        return None
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    index = tuple(slice(None) if i in dims else c for i, c in enumerate(coordinate))
    ranks = tuple(mesh.mesh[index].flatten().tolist())
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _GROUPS[ranks]


def _plan(p: torch.Tensor) -> _Matrix:
    """Every rank's block of p, as row and column indices: DTensor's own placement rules applied to index
    tensors (strided FSDP x TP shards included), exchanged once."""
    if not isinstance(p, DTensor) or (group := _shard_group(p)) is None:
        return _Matrix(p.shape, None, [torch.arange(p.shape[0])], [torch.arange(p.shape[1])])
    indices = []
    for dim in (0, 1):
        view = [1, 1]
        view[dim] = p.shape[dim]
        index = torch.arange(p.shape[dim], device=_local(p).device).view(view).expand(p.shape)
        local = distribute_tensor(index, p.device_mesh, p.placements, src_data_rank=None).to_local()
        indices.append((local[:, 0] if dim == 0 else local[0, :]) if local.numel() else local.new_empty(0))
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, [i.cpu() for i in indices], group=group)
    device = _local(p).device  # kept where the blocks are: no copy to the device per step
    return _Matrix(p.shape, group, [r.to(device) for r, _ in everyone], [c.to(device) for _, c in everyone])


class MatrixExchange:
    """The matrices of a Muon group, dealt round-robin to the ranks of their shard group: `orthogonalize` sends each
    block to its matrix's owner, applies a function to the whole matrix there, and sends the blocks back."""

    def __init__(self, params: list[torch.Tensor], *, whole: bool = True):
        self.matrices = [_plan(p) if whole else _Matrix(p.shape, None, [], []) for p in params]
        self.whole = whole
        # Buckets: up to n consecutive matrices of one group; the j-th of a bucket belongs to group rank j.
        by_group: dict[Any, list[int]] = {}
        for i, m in enumerate(self.matrices):
            by_group.setdefault(m.group, []).append(i)
        self.local_only = by_group.pop(None, [])
        self.buckets = [
            (group, members[k : k + group.size()])
            for group, members in by_group.items()
            for k in range(0, len(members), group.size())
        ]

    def orthogonalize(
        self, blocks: list[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> list[torch.Tensor]:
        """fn of each whole matrix, as this rank's blocks (bfloat16, fn's dtype). whole=False: fn of each block."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(blocks)
        for i in self.local_only if self.whole else range(len(blocks)):
            out[i] = fn(blocks[i])
        for group, bucket in self.buckets:
            self._exchange(group, bucket, blocks, out, fn)
        return out

    def _exchange(
        self,
        group: dist.ProcessGroup,
        bucket: list[int],
        blocks: list[torch.Tensor],
        out: list[torch.Tensor],
        fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        me, n = group.rank(), group.size()
        device = blocks[bucket[0]].device
        sent = [blocks[i].reshape(-1).bfloat16() for i in bucket]
        splits = [t.numel() for t in sent] + [0] * (n - len(bucket))
        mine = self.matrices[bucket[me]] if me < len(bucket) else None
        received = [mine.block_numel(k) for k in range(n)] if mine else [0] * n
        gathered = torch.empty(sum(received), dtype=torch.bfloat16, device=device)
        dist.all_to_all_single(gathered, torch.cat(sent), received, splits, group=group)
        back = torch.empty(0, dtype=torch.bfloat16, device=device)
        if mine:
            whole = torch.empty(mine.shape, dtype=torch.bfloat16, device=device)
            for k, piece in enumerate(gathered.split(received)):
                rows, cols = mine.rows[k], mine.cols[k]
                whole[rows[:, None], cols[None, :]] = piece.view(len(rows), len(cols))
            result = fn(whole)
            pieces = [result[mine.rows[k]][:, mine.cols[k]].reshape(-1) for k in range(n)]
            back = torch.cat(pieces)
        returned = torch.empty(sum(splits), dtype=torch.bfloat16, device=device)
        dist.all_to_all_single(returned, back, splits, received, group=group)
        for i, piece in zip(bucket, returned.split(splits), strict=False):  # pieces past the bucket are empty
            out[i] = piece.view(blocks[i].shape)


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update over groups of hidden matrices, each matrix whole (MatrixExchange; whole=False: each
    rank's shard alone). Its step reads GradScaler's `found_inf` as fused AdamW's does (a 0/1 device tensor: where it
    is 1, momentum, weights and step count stay as they were), which is how optimizer.py's gate skips a step."""

    _step_supports_amp_scaling = True  # reads found_inf; grad_scale must be None (no GradScaler unscales here)

    def __init__(self, groups: Iterable[dict[str, Any]], *, defaults: dict[str, Any], whole: bool = True):
        super().__init__(groups, defaults)
        if not whole:
            warn(
                'optimizer.muon_orthogonalize = "shard": each rank orthogonalizes its own shard of every matrix, a '
                'different optimizer from Muon (docs/failures.md #6); "matrix" orthogonalizes whole matrices'
            )
        self.exchanges = [MatrixExchange(g["params"], whole=whole) for g in self.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Muon's update of every group (unless found_inf is 1)."""
        assert getattr(self, "grad_scale", None) is None, "Muon does not unscale gradients (no GradScaler)"
        skip = getattr(self, "found_inf", None)
        for group, exchange in zip(self.param_groups, self.exchanges, strict=True):
            self._muon_step(group, exchange, skip)

    def _muon_step(self, group: dict[str, Any], exchange: MatrixExchange, skip: torch.Tensor | None) -> None:
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        params, updates = group["params"], []
        for p in params:
            grad = _local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))
            state = self.state[p]
            if "momentum_buffer" not in state:  # sharded like the parameter, so checkpoints reshard it
                state["momentum_buffer"] = torch.zeros_like(p)
                # The updates applied, as AdamW's state counts them (checkpoints hold a "step" for every parameter).
                state["step"] = torch.zeros((), dtype=torch.float32, device=grad.device)
            state["step"] += 1 if skip is None else 1 - skip
            buf = _local(state["momentum_buffer"])
            if skip is None:  # a step already known to apply (the host decided): in place
                moved = buf.lerp_(grad, 1 - momentum)
            else:  # the fused path's 0/1 tensor: the old momentum kept where it is 1
                moved = buf.lerp(grad, 1 - momentum)
                buf.copy_(torch.where(skip > 0, buf, moved))
            updates.append(grad.lerp(moved, momentum) if group["nesterov"] else moved.clone())
        steps = group["ns_steps"]
        orthogonal = exchange.orthogonalize(
            updates, lambda m: _zeropower_via_newtonschulz(m, (DEFAULT_A, DEFAULT_B, DEFAULT_C), steps, EPS)
        )
        for p, update in zip(params, orthogonal, strict=True):
            if p.grad is None:
                continue
            local = _local(p)
            shape = p.shape if exchange.whole else local.shape  # a shard's own shape, as Muon on it would use
            new = local.mul(1 - lr * wd).add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))
            local.copy_(new if skip is None else torch.where(skip > 0, local, new))
