"""The key/value cache of generation: an object the generator (generate.py) creates and hands to the model
with each forward, `model(tokens, positions=..., cache=cache)`. It never lives in the model.

Why it is an argument and not module state (docs/failures.md #2): a cache kept inside the module's forward
is written once when the forward runs and again when activation checkpointing recomputes that forward
for backward, so the recomputation sees a cache one step ahead of the one the forward saw. Training never
passes a cache, and a cache passed where training could see it (grad enabled, a model wrapped for
activation checkpointing or FSDP) is refused (`check_inference`).

Layout: one (bs, max_len, kv_heads, head_dim) key and value buffer per layer, allocated once, up front, at
that shape and in the model's dtype (`KVCache.for_model`), and written in place: a CUDA graph captured over
the decode step (generate.py) reads and writes the same addresses at every replay, and a compiled step sees
the same shapes, so it is compiled once (positions are a device tensor, never a Python int). A new batch of
the same size reuses the buffers (`reset`). A batch of prompts of different lengths is left-padded: row b's
tokens start at `starts[b]`. RoPE depends on relative positions alone, so a prompt starting at position 3
computes what it would at position 0; the mask keeps every query away from its row's padding and from the
positions not written yet (whatever an earlier batch left there), and is computed on the device from
`starts` and the query positions, with no value read by the host.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class KVCache:
    """Keys and values of every layer of a batch of `starts.numel()` sequences of at most `max_len` tokens."""

    def __init__(
        self,
        starts: torch.Tensor,
        max_len: int,
        *,
        layers: Iterable[str],
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ):
        device = torch.device(device) if device is not None else starts.device
        bs = starts.numel()
        self.max_len = max_len
        # layer name -> (bs, max_len, kv_heads, head_dim)
        self.keys = {name: torch.zeros(bs, max_len, kv_heads, head_dim, dtype=dtype, device=device) for name in layers}
        self.values = {name: torch.zeros_like(keys) for name, keys in self.keys.items()}
        self.starts = torch.zeros(bs, dtype=torch.long, device=device)  # (bs,): each row's first real position
        self.key_positions = torch.arange(max_len, device=device)
        self.real = torch.zeros(bs, max_len, dtype=torch.bool, device=device)  # key position >= its row's start
        self.reset(starts)

    @classmethod
    def for_model(cls, model: nn.Module, starts: torch.Tensor, max_len: int) -> KVCache:
        """A cache for every layer of `model`, on its device and in its parameters' dtype. Under tensor parallel
        (parallelisms/tp.py apply_tp_inference) this rank's share of the KV heads: every family's plan splits
        wk and wv column-wise, kv_heads / tp heads a rank (check_tp requires that tp divides kv_heads)."""
        from torch.distributed.tensor import DTensor

        weight = next(model.parameters())
        tp = next((p.device_mesh.size() for p in model.parameters() if isinstance(p, DTensor)), 1)
        args = model.args
        return cls(
            starts,
            max_len,
            layers=model.layers.keys(),
            kv_heads=args.kv_heads // tp,
            head_dim=args.head_dim,
            dtype=weight.dtype,
            device=weight.device,
        )

    def reset(self, starts: torch.Tensor) -> None:
        """A new batch of the same size, in place (the buffers keep their addresses): its rows start at `starts`.
        What an earlier batch left in the buffers stays until the prefill overwrites it, never attended."""
        self.starts.copy_(starts)
        torch.ge(self.key_positions[None, :], self.starts[:, None], out=self.real)

    def mask(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(bs, 1, queries, max_len) additive mask for queries at `positions`: causal, and no padding key.
        A padding query sees itself, so that no row of the softmax is empty (its output is never read)."""
        keys = self.key_positions
        causal = keys[None, :] <= positions[:, None]  # (queries, max_len)
        allowed = causal[None] & (self.real[:, None, :] | (keys[None, :] == positions[:, None])[None])
        return torch.zeros(allowed.shape, dtype=dtype, device=keys.device).masked_fill_(~allowed, float("-inf"))[
            :, None
        ]

    def update(self, layer: str, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write k, v (bs, seqlen, kv_heads, head_dim) at `positions` of `layer`; its whole buffers."""
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(1, positions, k)
        values.index_copy_(1, positions, v)
        return keys, values


class LayerCache:
    """One layer's view of a KVCache for one forward: what a block's attention writes and reads."""

    def __init__(self, cache: KVCache, layer: str, positions: torch.Tensor):
        self.cache, self.layer, self.positions = cache, layer, positions

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.cache.update(self.layer, self.positions, k, v)


def check_inference(model: nn.Module, positions: torch.Tensor | None) -> None:
    """Refuse a cache where training could see it (docs/failures.md #2): grad enabled, activation
    checkpointing or FSDP around any module, or no positions to write at."""
    if positions is None:
        raise ValueError(
            "cache: pass positions= too (the cache positions of the tokens), e.g. torch.arange(prompt_len)"
        )
    if torch.compiler.is_compiling():  # checked by the eager prefill already; nothing to trace
        return
    if torch.is_grad_enabled():
        raise RuntimeError("cache: a KV cache is for inference only; call the model under torch.no_grad()")
    from torch.distributed.fsdp import FSDPModule

    for name, module in model.named_modules():
        # parallelisms/ac.py's Checkpointed<Block> and FSDP1's CheckpointWrapper: the models know no parallelism.
        if isinstance(module, FSDPModule) or "Checkpoint" in type(module).__name__:
            raise RuntimeError(
                f"cache: {name or 'the model'} ({type(module).__name__}) is wrapped for training (FSDP or activation "
                "checkpointing); generate from an unwrapped model (generate.py loads one from the checkpoint)"
            )
