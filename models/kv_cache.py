"""The key/value cache of generation: an object the generator (generate.py) creates and hands to the model
with each forward, `model(tokens, positions=..., cache=cache)`. It never lives in the model.

Why it is an argument and not module state (docs/failures.md #2): a cache kept inside the module's forward
is written once when the forward runs and again when activation checkpointing recomputes that forward
for backward, so the recomputation sees a cache one step ahead of the one the forward saw. Training never
passes a cache, and a cache passed where training could see it (grad enabled, a model wrapped for
activation checkpointing or FSDP) is refused (`check_inference`).

Layout: one (bs, max_len, kv_heads, head_dim) key and value buffer per layer, allocated when the prefill
first writes it; fixed shapes, so a compiled decode step is compiled once (positions are a tensor input,
never a Python int). A batch of prompts of different lengths is left-padded: row b's tokens start at
`starts[b]`. RoPE depends on relative positions alone, so a prompt starting at position 3 computes what it
would at position 0; the mask keeps every query away from its row's padding.
"""

from __future__ import annotations

import torch
from torch import nn


class KVCache:
    """Keys and values of every layer of a batch of `starts.numel()` sequences of at most `max_len` tokens."""

    def __init__(self, starts: torch.Tensor, max_len: int):
        self.starts = starts  # (bs,) int64: the first real (not padding) position of each row
        self.max_len = max_len
        self.keys: dict[str, torch.Tensor] = {}  # layer name -> (bs, max_len, kv_heads, head_dim)
        self.values: dict[str, torch.Tensor] = {}

    def mask(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(bs, 1, queries, max_len) additive mask for queries at `positions`: causal, and no padding key.
        A padding query sees itself, so that no row of the softmax is empty (its output is never read)."""
        keys = torch.arange(self.max_len, device=positions.device)
        causal = keys[None, :] <= positions[:, None]  # (queries, max_len)
        real = keys[None, :] >= self.starts[:, None]  # (bs, max_len)
        allowed = causal[None] & (real[:, None, :] | (keys[None, :] == positions[:, None])[None])
        return torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill_(~allowed, float("-inf"))[
            :, None
        ]

    def update(self, layer: str, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write k, v (bs, seqlen, kv_heads, head_dim) at `positions` of `layer`; its whole buffers."""
        if layer not in self.keys:
            shape = (k.shape[0], self.max_len, *k.shape[2:])
            self.keys[layer], self.values[layer] = k.new_zeros(shape), v.new_zeros(shape)
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
