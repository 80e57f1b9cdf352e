"""Qwen3 dense (0.6B to 32B) as one plain PyTorch module.

Shape legend used in the comments:
    bs: batch size, seqlen: sequence length, dim: model width,
    n_heads / n_kv_heads: query / key-value heads (local to the rank under TP),
    head_dim: the width of one head, set explicitly (n_heads * head_dim need not be dim:
    0.6B has dim 1024 and 16 heads of 128), hidden: the SwiGLU width, vocab: vocabulary size.

What differs from Llama 3 (models/llama3/model.py), and nothing else does:
  * QK-norm: an RMSNorm over head_dim, one weight shared by all heads, applied to each query
    and key head after its projection and before RoPE. It keeps the attention logits bounded,
    for stable training (the Qwen3 technical report, arXiv:2505.09388).
  * head_dim and the MLP width (`hidden_dim`, HF's intermediate_size) are explicit, not derived.
  * RoPE with theta 1e6 and no frequency scaling; RMSNorm eps 1e-6.

Design rules shared with Llama's module, so the same skeleton (models/__init__.py) and parallelisms work:
  * The training forward is a pure function of (parameters, tokens): no KV cache, no state
    that a recomputation under activation checkpointing could see twice (docs/failures.md #2).
  * The model knows nothing about meshes; parallelisms/ wraps it. Build on the meta device,
    parallelize, `to_empty(device)`, then `init_weights()`.
  * Layers in a ModuleDict keyed "0", "1", ... so names stay stable under pipeline cuts.
  * RoPE in the "rotate half" layout of Hugging Face checkpoints: HF weights load unpermuted.
  * attn_mask_type "block_causal": attention stays inside each packed document (`segments`).

This folder is self-contained on purpose: its RoPE frequencies are a few lines, written again here rather
than imported from models/llama3, so a fork may delete or change either family without breaking the
other. The attention core, its masks and the rotation of q and k are generic (models/attention.py,
models/rope.py), shared by every family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import AttentionMask, ScaledDotProductAttention, attention_mask
from models.kv_cache import KVCache, LayerCache, check_inference
from models.rope import apply_rope, rope_table


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # every Qwen3 size uses grouped-query attention; n_heads here means multi-head
    head_dim: int
    hidden_dim: int  # SwiGLU width (HF intermediate_size)
    vocab_size: int = 151936
    norm_eps: float = 1e-6  # every RMSNorm: the blocks', the final one and QK-norm
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 32768  # longest sequence the flavor supports (RoPE table length)
    tie_word_embeddings: bool = False
    attn_mask_type: str = "causal"  # or "block_causal": attention stays inside each packed document

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads


# The published sizes, from the config.json of each Hugging Face repo in hf.py's PUBLISHED (the
# Base repos; Qwen/Qwen3-32B for 32B, which has no Base release), cross-checked against the model
# cards (Qwen3 technical report, arXiv:2505.09388, table 1) and torchtitan 0.2.2's qwen3 flavors.
# Every size: vocab 151936, rms_norm_eps 1e-6, rope_theta 1e6 without scaling, no bias, head_dim 128,
# 8 KV heads. max_position_embeddings is 32768 in the Base configs and 40960 in the post-trained ones.
FLAVORS: dict[str, ModelArgs] = {
    # ~7M parameters: trains on two CPU cores with the shipped 2048-token BPE. Shaped like 0.6B in
    # miniature (2 query heads per KV head, n_heads * head_dim = 2 * dim, hidden = 3 * dim) so the
    # head_dim != dim / n_heads path runs in every debug run; untied so tensor parallel applies.
    "debugmodel": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=32, hidden_dim=768, vocab_size=2048,
        max_seq_len=2048,
    ),
    # 0.6B, 1.7B, 4B: tied input and output embeddings.
    "qwen3_0.6b": ModelArgs(
        dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, hidden_dim=3072, tie_word_embeddings=True,
    ),
    "qwen3_1.7b": ModelArgs(
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, hidden_dim=6144, tie_word_embeddings=True,
    ),
    "qwen3_4b": ModelArgs(
        dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=9728, tie_word_embeddings=True,
    ),
    "qwen3_8b": ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=12288),
    "qwen3_14b": ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, head_dim=128, hidden_dim=17408),
    "qwen3_32b": ModelArgs(
        dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128, hidden_dim=25600, max_seq_len=40960,
    ),
}  # fmt: skip


# --------------------------------------------------------------------------- RoPE


def rope_cos_sin(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """The RoPE table of this family's frequencies (models/rope.py): (2, max_seq_len, head_dim // 2, 2)."""
    # Frequencies in float64, rounded once: theta 1e6 makes the slowest ones tiny.
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.float64, device=device) / args.head_dim
    inv_freq = (1.0 / args.rope_theta**exponents).float()
    return rope_table(inv_freq, args.max_seq_len)


# ------------------------------------------------------------------------ modules


class Attention(nn.Module):
    """Causal grouped-query self-attention with QK-norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.sdpa = ScaledDotProductAttention()
        # Over head_dim, shared by the heads: under TP each rank normalizes its own heads with the
        # same (replicated) weight, and no statistic crosses ranks.
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(
        self, x: torch.Tensor, cos_sin: torch.Tensor, mask: AttentionMask = None, kv: LayerCache | None = None
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism each rank holds a slice of heads.
        q = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))  # (bs, seqlen, n_heads, head_dim)
        k = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))  # (bs, seqlen, n_kv_heads, head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_kv_heads, head_dim)
        q, k = apply_rope(q, k, cos_sin)
        if kv is not None:  # generation: attend over every cached position (models/kv_cache.py)
            k, v = kv.update(k, v)
        return self.wo(self.sdpa(q, k, v, mask))  # (models/attention.py; context parallel wraps it)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


# Copied from models.llama3.model.FeedForward
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


# Copied from models.llama3.model.TransformerBlock
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


# Copied from models.llama3.model.Transformer with Tied models (1B/3B)->Tied sizes (0.6B to 4B)
class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Tied sizes (0.6B to 4B) reuse the embedding matrix as the output projection. No shared
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


# Copied from models.llama3.model._matmul_params_per_layer
def _matmul_params_per_layer(args: ModelArgs) -> int:
    attention = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads)  # wq, wk, wv, wo
    return attention + 3 * args.dim * args.hidden_dim  # + w1, w2, w3


def num_params(args: ModelArgs, *, exclude_embedding: bool = False) -> int:
    """Parameter count from the shapes alone (no model needed). exclude_embedding drops the input
    embedding only, as Llama's does: an untied output projection is a matmul weight and stays. (The
    Qwen3 model cards' "non-embedding" counts also drop an untied output projection.)"""
    norms = 2 * args.dim + 2 * args.head_dim  # the block's two RMSNorms + QK-norm
    per_layer = _matmul_params_per_layer(args) + norms
    embedding = args.vocab_size * args.dim
    output = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    total = embedding + args.n_layers * per_layer + args.dim + output
    return total - embedding if exclude_embedding else total


def num_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), the convention behind reported MFU.

    As for Llama: 6 FLOPs per matmul weight per token over the blocks' projections and the
    output projection (also when tied), none for the embedding lookup or the norms (QK-norm
    included); plus attention scores and values, 12 * n_layers * n_heads * head_dim * seq_len,
    with n_heads * head_dim the attention width (not dim: they differ in Qwen3). The causal
    mask is not credited (no halving). tests/test_qwen3.py checks this against FlopCounterMode.
    """
    matmul_params = args.n_layers * _matmul_params_per_layer(args) + args.vocab_size * args.dim
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return 6 * matmul_params + attention
