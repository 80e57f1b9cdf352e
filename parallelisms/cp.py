"""Context parallel: each window's tokens split over the "cp" ranks, keys and values all-gathered per layer.

At seq_len 131,072 one 8B sequence's activations do not fit one GPU, whatever FSDP or TP do: TP
splits them only within a block's matmuls and FSDP not at all. CP splits the sequence itself. This is
the Llama 3 paper's design (section 3.3.2), not torch's ring attention:

  * Load balance ("headtail"): a window is cut into 2 x cp chunks and rank i holds chunks i and
    2cp-1-i. Under a causal mask the late chunks attend to more keys than the early ones; each rank
    gets one of each, so every rank does the same attention work. ("none": rank i holds chunk i.)
  * Every rank computes all the layers on its own tokens (its queries), and per layer all-gathers the
    keys and values of the whole window (one all-gather of k and v together, in the natural order of
    the window), then attends with its queries under whatever mask the documents need: causal, or
    causal within documents (block_causal) at the tokens' true window positions. Backward
    reduce-scatters the keys' and values' gradients (the all-gather's autograd).
  * The gathered keys and values cost (cp - 1) / cp of one layer's K/V per all-gather, small next to
    the queries' work because of grouped-query attention (8B: 8 KV heads of 32); ring attention sends
    as much but overlaps it with compute, and cannot combine with document masks under SDPA.

The same code runs SDPA with a dense mask on CPU and FlexAttention with a BlockMask on CUDA: the mask
comes from models/attention.py (`attention_mask` with positions). Torch's own
`torch.distributed.tensor.experimental.context_parallel` has no sharding strategy for the CPU SDPA
kernel and cannot mask documents under SDPA, so it is not used.

What the rest of the recipe does for it: FSDP shards over dp_shard x cp (ParallelDims.fsdp_mesh; the CP
ranks' gradients are averaged like data parallel's, correct because every rank holds as many tokens);
the loader is unchanged (the CP ranks of a group read the same micro-batch and `shard` keeps theirs);
losses and metrics are per-rank means over equal token counts, so their mean over ranks is the
window's mean and tokens are counted once per window.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from errors import ConfigError
from models.attention import ScaledDotProductAttention

if TYPE_CHECKING:
    from config import Parallelism


def check_cp(*, cp: int, tp: int, load_balancer: str | None, seq_lens: dict[str, int]) -> None:
    """What context parallel of degree `cp` (`load_balancer`: parallelism.context_parallel_load_balancer) needs of
    the sequence lengths (key -> length): every problem in one ConfigError."""
    chunks = 2 * cp if load_balancer == "headtail" else cp
    problems = []
    for key, seq_len in seq_lens.items():
        if seq_len % chunks:
            problems.append(
                f"{key}: {seq_len} is not divisible by {chunks} (context_parallel_degree {cp} cuts each window into "
                f"{chunks} equal chunks); use a multiple of {chunks}"
            )
        elif tp > 1 and (seq_len // cp) % tp:
            problems.append(
                f"{key}: each context-parallel rank holds {seq_len // cp} tokens, not divisible by "
                f"tensor_parallel_degree {tp} (sequence parallel splits them); use a multiple of {math.lcm(chunks, cp * tp)}"
            )
    if problems:
        raise ConfigError(*problems)


def window_positions(window: int, *, cp: int, rank: int, load_balance: bool) -> torch.Tensor:
    """The window positions rank `rank` of `cp` holds, in the order it holds them: (window // cp,) int64."""
    if not load_balance:
        size = window // cp
        return torch.arange(rank * size, (rank + 1) * size)
    size = window // (2 * cp)
    head, tail = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(head * size, (head + 1) * size), torch.arange(tail * size, (tail + 1) * size)])


def context_parallel(mesh: DeviceMesh, par: Parallelism) -> ContextParallel | None:
    """This rank's ContextParallel under parallelism.context_parallel_degree > 1, else None."""
    if par.context_parallel_degree == 1:
        return None
    return ContextParallel(mesh["cp"], load_balance=par.context_parallel_load_balancer == "headtail")


class ContextParallel:
    """This rank's part of each window (`shard`, `positions`) and the all-gather of keys and values (`gather`)."""

    def __init__(self, cp_mesh: DeviceMesh, *, load_balance: bool = True):
        self.mesh, self.load_balance = cp_mesh, load_balance
        self.degree, self.rank = cp_mesh.size(), cp_mesh.get_local_rank()

    @functools.lru_cache(maxsize=8)  # noqa: B019 (one object per run; a few window lengths)
    def _positions(self, window: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        mine = window_positions(window, cp=self.degree, rank=self.rank, load_balance=self.load_balance)
        gathered = torch.cat(
            [
                window_positions(window, cp=self.degree, rank=r, load_balance=self.load_balance)
                for r in range(self.degree)
            ]
        )
        return mine.to(device), torch.argsort(gathered).to(device)  # (the order that puts gathered rows in place)

    def positions(self, window: int, device: torch.device) -> torch.Tensor:
        """The window positions of this rank's tokens."""
        return self._positions(window, device)[0]

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of (bs, window, ...) inputs or labels: (bs, window // cp, ...)."""
        return t[:, self.positions(t.shape[1], t.device)]

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole window's keys and values from every rank's (bs, window // cp, kv_heads, head_dim) part, in
        window order: one all-gather (its backward reduce-scatters the gradients)."""
        local = k.shape[1]
        kv = torch.cat([k, v], dim=2).transpose(0, 1).contiguous()  # (local, bs, 2 kv_heads, head_dim)
        gathered = funcol.all_gather_single_autograd(kv, gather_dim=0, group=self.mesh)
        order = self._positions(local * self.degree, k.device)[1]
        kv = gathered.index_select(0, order).transpose(0, 1)  # (bs, window, 2 kv_heads, head_dim)
        return kv.split(k.shape[2], dim=2)


class ContextParallelAttention(nn.Module):
    """The attention core (models/attention.py) over this rank's queries and the whole window's keys and values."""

    def __init__(self, inner: nn.Module, cp: ContextParallel):
        super().__init__()
        self.inner, self.cp = inner, cp

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None) -> torch.Tensor:
        k, v = self.cp.gather(k, v)
        return self.inner(q, k, v, mask)


def apply_cp(model: nn.Module, cp: ContextParallel) -> None:
    """Wrap every attention core of `model` (a whole model or a pipeline stage) and give its forward this
    rank's window positions. The caller passes this rank's tokens (`cp.shard`) and the whole window's
    `segments` (document indices), which the masks need."""
    cores = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, ScaledDotProductAttention)]  # fmt: skip
    for parent, name in cores:
        setattr(parent, name, ContextParallelAttention(getattr(parent, name), cp))

    def add_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        tokens = args[0] if args else kwargs["tokens"]  # (bs, local) tokens, or (bs, local, dim) hidden states
        window = tokens.shape[1] * cp.degree
        if len(args) < 2 and kwargs.get("segments") is None:  # one document per window
            kwargs["segments"] = torch.zeros(tokens.shape[0], window, dtype=torch.int32, device=tokens.device)
        kwargs["positions"] = cp.positions(window, tokens.device)
        return args, kwargs

    model.register_forward_pre_hook(add_positions, with_kwargs=True)
