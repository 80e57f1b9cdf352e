"""The attention core every family's Attention calls after its projections and RoPE, and the masks.

Generic on purpose (no family's module is named here): the families differ in what comes before the
core (QK-norm, head sizes), not in the core itself. It is a module of its own (`Attention.sdpa`, no
parameters, so no state-dict name changes) because context parallel (parallelisms/cp.py) wraps it:
each rank then holds a part of the window's queries, and the wrapper gathers the whole window's keys
and values before calling this core. The masks cover both cases:

    positions None     the tokens are the whole window: `None` (SDPA's own causal mask) or a
                       document mask (block_causal), window x window
    positions given    the tokens are a part of the window (context parallel), at these window
                       positions: queries x window, causal by position, within documents for block_causal

CUDA gets FlexAttention BlockMasks for masks (blocks no query may see are skipped); elsewhere dense
additive masks for SDPA (FlexAttention has no CPU backward in PyTorch 2.13), exact and fine for the
sequence lengths of tests: bs x queries x window elements in the compute dtype, built once per forward.
Additive and in that dtype on purpose: SDPA saves its mask for backward, and a boolean one it first
converts to a float copy in every block, where this one is saved once, shared by every block (what it
saves: docs/benchmarks.md, "Context parallel").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

if TYPE_CHECKING:
    from models.kv_cache import KVCache

# (bs, 1, queries, keys) additive (0: attend, -inf: not) for SDPA, or a FlexAttention BlockMask on CUDA;
# None: plain causal attention over the whole window.
AttentionMask = torch.Tensor | BlockMask | None


class ScaledDotProductAttention(nn.Module):
    """softmax(q k^T / sqrt(head_dim) + mask) v over (bs, seqlen, heads, head_dim) tensors, grouped-query:
    k and v may have fewer heads than q (they are repeated to match). Returns (bs, seqlen, heads * head_dim)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask = None) -> torch.Tensor:
        bs, seqlen = q.shape[:2]
        # An expand + reshape instead of SDPA's enable_gqa, which not every fused kernel supports.
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bs, heads, seqlen, head_dim)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif isinstance(mask, torch.Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = _flex_attention(q, k, v, block_mask=mask)
        return out.transpose(1, 2).reshape(bs, seqlen, -1)


def attention_mask(
    mask_type: str,
    segments: torch.Tensor | None,
    positions: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    cache: KVCache | None = None,
) -> AttentionMask:
    """The mask of one forward. segments (bs, window): each token's document index in its window (used by
    block_causal); positions (queries,): the window positions of the tokens when they are only a part of
    the window (context parallel), which then needs `segments` for the window's length. dtype: the
    attention's compute dtype (of a dense mask). cache: generation's KV cache, whose mask it is then
    (positions: the tokens' cache positions)."""
    if cache is not None:
        return cache.mask(positions, dtype)
    if positions is None:
        return document_mask(segments, dtype=dtype) if mask_type == "block_causal" and segments is not None else None
    if segments is None:
        raise ValueError("attention_mask: positions (a part of the window) need segments, the whole window's")
    docs = segments if mask_type == "block_causal" else torch.zeros_like(segments)
    return document_mask(docs, positions, dtype=dtype)


def document_mask(
    segments: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    block_mask: bool | None = None,
) -> AttentionMask:
    """Causal attention inside each document of a packed window, segments (bs, window); for the queries at
    window `positions` (all of them when None). block_mask: a FlexAttention BlockMask (default: on CUDA)."""
    bs, window = segments.shape
    q_pos = torch.arange(window, device=segments.device) if positions is None else positions.to(segments.device)
    if segments.is_cuda if block_mask is None else block_mask:

        def same_document_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return (segments[b, q_pos[q]] == segments[b, kv]) & (q_pos[q] >= kv)

        return create_block_mask(same_document_causal, bs, None, len(q_pos), window, device=segments.device)
    causal = q_pos[:, None] >= torch.arange(window, device=segments.device)[None, :]  # (queries, window)
    allowed = ((segments[:, q_pos, None] == segments[:, None, :]) & causal)[:, None]  # (bs, 1, queries, window)
    return torch.zeros(allowed.shape, dtype=dtype, device=segments.device).masked_fill_(~allowed, float("-inf"))


_compiled_flex = None


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_mask: BlockMask) -> torch.Tensor:
    """FlexAttention compiled once: eager flex_attention is a slow reference implementation."""
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask)
