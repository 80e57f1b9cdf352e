"""Llama 3 (3.0, 3.1, 3.2 text) as one plain PyTorch module.

Shape legend used in the comments:
    bs: batch size, seqlen: sequence length, dim: model width,
    n_heads / n_kv_heads: query / key-value heads (local to the rank under TP),
    head_dim: dim // n_heads, vocab: vocabulary size.

Design rules this file keeps:
  * The training forward is a pure function of (parameters, tokens): no KV cache and no
    other state that a recomputation under activation checkpointing could see twice
    (docs/failures.md #2).
  * The model knows nothing about meshes or parallelism; `parallelisms/` wraps it.
  * Build on the meta device, parallelize, `to_empty(device)`, then `init_weights()`.
  * Layers live in a ModuleDict keyed by "0", "1", ... so parameter names stay stable
    when a pipeline stage or a test drops some of them.
  * RoPE uses the "rotate half" layout of Hugging Face checkpoints, so HF weights load
    without permuting wq/wk.
  * attn_mask_type "block_causal": a token attends to the earlier tokens of its own document
    only, given each token's document index in its packed window (`segments`). RoPE depends on
    relative positions alone, so each document then computes exactly what it would alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import AttentionMask, ScaledDotProductAttention, attention_mask
from models.kv_cache import KVCache, LayerCache, check_inference
from models.rope import apply_rope, rope_table


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling ("rope_type": "llama3" in HF configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: multi-head attention (n_kv_heads == n_heads)
    vocab_size: int = 128256
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 131072  # longest sequence the flavor supports (RoPE table length)
    tie_word_embeddings: bool = False
    # An explicit SwiGLU width for checkpoints whose width Llama's rule below cannot produce
    # (e.g. a Hugging Face config's intermediate_size); None: use the rule.
    hidden_dim_override: int | None = None
    attn_mask_type: str = "causal"  # or "block_causal": attention stays inside each packed document

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.hidden_dim_override is not None:
            return self.hidden_dim_override
        # Llama's SwiGLU sizing: 2/3 of 4*dim, scaled, rounded up to `multiple_of`.
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


_LLAMA31_ROPE = RopeScaling(factor=8.0)
_LLAMA32_ROPE = RopeScaling(factor=32.0)

FLAVORS: dict[str, ModelArgs] = {
    # ~6M parameters: trains on two CPU cores in minutes with the shipped 2048-token BPE. torchtitan
    # 0.2.2's debugmodel, shape for shape (16 key/value heads: no grouped-query attention).
    "debugmodel": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048,
        max_seq_len=2048, rope_scaling=_LLAMA31_ROPE,
    ),
    # The debug model's 2-block student (configs/debug_distill.toml): the shape scripts/prune.py --layers 0,5 leaves.
    "debugmodel_2layers": ModelArgs(
        dim=256, n_layers=2, n_heads=16, n_kv_heads=16, vocab_size=2048,
        max_seq_len=2048, rope_scaling=_LLAMA31_ROPE,
    ),
    # Llama 3.2 1B / 3B: tied input and output embeddings.
    "llama3_1b": ModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
        rope_scaling=_LLAMA32_ROPE, tie_word_embeddings=True,
    ),
    "llama3_3b": ModelArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0,
        rope_scaling=_LLAMA32_ROPE, tie_word_embeddings=True,
    ),
    # Llama 3.1 8B / 70B / 405B.
    "llama3_8b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
        multiple_of=1024, rope_scaling=_LLAMA31_ROPE,
    ),
    "llama3_70b": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
        multiple_of=4096, rope_scaling=_LLAMA31_ROPE,
    ),
    "llama3_405b": ModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
        multiple_of=4096, rope_scaling=_LLAMA31_ROPE,
    ),
}  # fmt: skip


# --------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,), with Llama 3.1 scaling when given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    # Long wavelengths (beyond the original context / low_freq_factor) are slowed down by
    # `factor`, short ones (below original context / high_freq_factor) are kept, and the
    # band in between is interpolated linearly in 1/wavelength.
    wavelen = 2 * math.pi / inv_freq
    ctx = scaling.original_max_position_embeddings
    smooth = (ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smooth = smooth.clamp(0.0, 1.0)
    scaled = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return scaled.float()


def rope_cos_sin(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """The RoPE table of this family's frequencies (models/rope.py): (2, max_seq_len, head_dim // 2, 2)."""
    inv_freq = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling).to(device)
    return rope_table(inv_freq, args.max_seq_len)


def torchtitan_interleaved(args: ModelArgs) -> dict[str, int]:
    """torchtitan's Llama 3 rotates interleaved pairs (x0, x1), (x2, x3)... of a head (complex numbers, Meta's
    layout), this model pairs x_i with x_{i + head_dim/2}: the rows of wq and wk that make each head's q and k
    come in another order within the head (checkpoint/torchtitan.py permutes them)."""
    return {"attention.wq.weight": args.n_heads, "attention.wk.weight": args.kv_heads}


# ------------------------------------------------------------------------ modules


class Attention(nn.Module):
    """Causal grouped-query self-attention."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.sdpa = ScaledDotProductAttention()

    def forward(
        self, x: torch.Tensor, cos_sin: torch.Tensor, mask: AttentionMask = None, kv: LayerCache | None = None
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism each rank holds a slice of heads.
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_heads, head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_kv_heads, head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, k, cos_sin)
        if kv is not None:  # generation: attend over every cached position (models/kv_cache.py)
            k, v = kv.update(k, v)
        return self.wo(self.sdpa(q, k, v, mask))  # (models/attention.py; context parallel wraps it)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Output projections get a smaller init the deeper the layer (GPT-2/torchtitan style),
        # so the residual stream's variance does not grow with depth.
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(
        self, x: torch.Tensor, cos_sin: torch.Tensor, mask: AttentionMask = None, kv: LayerCache | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos_sin, mask, kv=kv)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Tied models (1B/3B) reuse the embedding matrix as the output projection. No shared
        # Parameter object: `to_empty` and FSDP would silently untie one.
        self.output = None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived from args, never trained or checkpointed: recomputed by init_buffers().
        self.register_buffer("rope_cos_sin", rope_cos_sin(args), persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        segments: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """tokens (bs, seqlen) int64 -> logits (bs, seqlen, vocab). On a pipeline stage: from hidden states
        (bs, seqlen, dim) if it has no embedding, to hidden states if it has no final norm.

        segments (bs, seqlen): each token's document index in its window, used by block_causal.
        positions (seqlen,): the window positions of `tokens` when they are only a part of the window
            (context parallel, parallelisms/cp.py: its wrapper of `Attention.sdpa` gathers the whole
            window's keys and values); `segments` then covers the whole window. None: 0..seqlen-1.
        head: what to apply to the final norm's output (bs, seqlen, dim) instead of `project`; the
            training loss passes itself, to project and score a chunk of tokens at a time (loss.py).
            It runs inside this forward on purpose: FSDP gathers the projection's parameters for
            the root's forward, and a projection called after it costs one more all-gather and
            one more reduce-scatter per step (counted in tests/test_loss.py).
        cache: generation's key/value cache (models/kv_cache.py), owned by the generator and passed with
            each forward, `positions` then being the cache positions of `tokens`; training never passes one.
        """
        rope = self.rope_cos_sin if positions is None else self.rope_cos_sin[:, positions]
        # A pipeline stage (parallelisms/pp.py) may lack the embedding (it gets the previous stage's
        # hidden states) or the final norm and output (it returns its last block's hidden states).
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (bs, seqlen, dim)
        segments = segments.to(tokens.device) if segments is not None else None
        if cache is not None:  # generation (generate.py); training passes none
            check_inference(self, positions)
        mask = attention_mask(self.args.attn_mask_type, segments, positions, dtype=h.dtype, cache=cache)
        for name, layer in self.layers.items():
            # kv a keyword: the TP plans' input hooks see the positional arguments only.
            h = layer(h, rope, mask, kv=LayerCache(cache, name, positions) if cache is not None else None)
        if self.norm is None:
            return h
        h = self.norm(h)
        return head(h) if head is not None else self.project(h)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """The output projection: (..., dim) -> logits (..., vocab)."""
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    def init_buffers(self, device: torch.device) -> None:
        """The buffers derived from args (never trained or checkpointed), computed on `device`."""
        self.rope_cos_sin = rope_cos_sin(self.args, device=device)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Fill parameters and buffers in place; works on DTensor (sharded) parameters too."""
        self.init_buffers(buffer_device or self.rope_cos_sin.device)
        if self.tok_embeddings is not None:  # None, as norm and output, on some pipeline stages
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        # The output projection starts with logits at unit scale: std dim^-0.5, truncated at 3 std. A tied
        # embedding is the output projection too, so it starts as one: at the embedding's std 1 the first logits
        # would have std dim^0.5 (a first loss of ~1,800 instead of ln(vocab) for llama3_1b).
        tied = self.args.tie_word_embeddings and self.tok_embeddings is not None
        output = self.tok_embeddings.weight if tied else self.output.weight if self.output is not None else None
        if output is not None:
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(output, mean=0.0, std=std, a=-3 * std, b=3 * std)


# ------------------------------------------------------------------ size and FLOPs


def _matmul_params_per_layer(args: ModelArgs) -> int:
    attention = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads)  # wq, wk, wv, wo
    return attention + 3 * args.dim * args.hidden_dim  # + w1, w2, w3


def num_params(args: ModelArgs, *, exclude_embedding: bool = False) -> int:
    """Parameter count from the shapes alone (no model needed: 405B is fine)."""
    per_layer = _matmul_params_per_layer(args) + 2 * args.dim  # + two RMSNorm weights
    embedding = args.vocab_size * args.dim
    output = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    total = embedding + args.n_layers * per_layer + args.dim + output
    return total - embedding if exclude_embedding else total


def num_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), the convention behind reported MFU.

    6 FLOPs per matmul weight per token (2 forward, 4 backward) over every weight that takes
    part in a matmul: the blocks' projections and the output projection, also when it is tied
    to the embedding; not the embedding lookup or the norms. Plus attention scores and
    values: 2 matmuls of seq_len x head_dim per head, times 6, i.e.
    12 * n_layers * n_heads * head_dim * seq_len. Like PaLM and torchtitan, the causal mask is
    not credited (no halving). tests/test_model.py checks this against FlopCounterMode.
    """
    matmul_params = args.n_layers * _matmul_params_per_layer(args) + args.vocab_size * args.dim
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return 6 * matmul_params + attention
