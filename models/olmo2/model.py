"""OLMo 2 (Ai2's fully open models, 7B and 13B) as one plain PyTorch module.

Shape legend used in the comments:
    bs: batch size, seqlen: sequence length, dim: model width,
    n_heads / n_kv_heads: query / key-value heads (local to the rank under TP),
    head_dim: the width of one head, hidden: the SwiGLU width, vocab: vocabulary size.

What differs from Llama 3 (models/llama3/model.py), and nothing else does:
  * Post-norm blocks: no norm before attention or the MLP; each branch's output is normalized before it
    is added to the residual, h = x + norm(attn(x)), out = h + norm(mlp(h)). The residual stream itself
    is never normalized inside a block, only by the final norm.
  * QK-norm over the whole projection: one RMSNorm over all n_heads * head_dim outputs of wq (and one
    over the n_kv_heads * head_dim outputs of wk), applied before the split into heads and before RoPE.
    Qwen3's QK-norm is per head; this one's statistic spans every head, which is what tensor parallel
    has to reassemble across ranks (plans.py).
  * RoPE with theta 500000 and no frequency scaling; RMSNorm eps 1e-6; untied embeddings.

Design rules shared with the other families, so the same skeleton (models/__init__.py) and parallelisms work:
  * The training forward is a pure function of (parameters, tokens): no KV cache, no state
    that a recomputation under activation checkpointing could see twice (docs/failures.md #2).
  * The model knows nothing about meshes; parallelisms/ wraps it. Build on the meta device,
    parallelize, `to_empty(device)`, then `init_weights()`.
  * Layers in a ModuleDict keyed "0", "1", ... so names stay stable under pipeline cuts.
  * RoPE in the "rotate half" layout of Hugging Face checkpoints: HF weights load unpermuted.

This folder is self-contained on purpose (a fork may delete any family): its RoPE frequencies are written
again here. The attention core, its masks and the rotation of q and k are generic (models/attention.py,
models/rope.py), shared by every family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from models.attention import AttentionMask, ScaledDotProductAttention, attention_mask
from models.kv_cache import KVCache, LayerCache, check_inference
from models.rope import apply_rope, rope_table


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # 7B and 13B are multi-head (n_kv_heads == n_heads)
    head_dim: int  # dim / n_heads in every published size (transformers derives it so)
    hidden_dim: int  # SwiGLU width (HF intermediate_size)
    vocab_size: int = 100352
    norm_eps: float = 1e-6  # every RMSNorm: the post-norms, QK-norm and the final one
    rope_theta: float = 500_000.0
    max_seq_len: int = 4096  # longest sequence the flavor supports (RoPE table length)
    tie_word_embeddings: bool = False
    attn_mask_type: str = "causal"  # or "block_causal": attention stays inside each packed document

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads


# The published sizes, from the config.json of each Hugging Face repo in hf.py's PUBLISHED: vocab 100352,
# rms_norm_eps 1e-6, rope_theta 500000 without scaling, 4096 positions, untied, no bias, multi-head.
# OLMo 2 1B (allenai/OLMo-2-0425-1B) and 32B (allenai/OLMo-2-0325-32B) are left out until their
# config.json is checked: a flavor here is a claim about a published shape.
FLAVORS: dict[str, ModelArgs] = {
    # ~6M parameters: trains on two CPU cores with the shipped 2048-token BPE. Grouped-query (2 query heads
    # per KV head) so that q_norm and k_norm have different widths in every debug run.
    "debugmodel": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=16, hidden_dim=768, vocab_size=2048,
        max_seq_len=2048,
    ),
    "olmo2_1b": ModelArgs(dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, head_dim=128, hidden_dim=8192),
    "olmo2_7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128, hidden_dim=11008),
    "olmo2_13b": ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, head_dim=128, hidden_dim=13824),
    "olmo2_32b": ModelArgs(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, head_dim=128, hidden_dim=27648),
}  # fmt: skip


# --------------------------------------------------------------------------- RoPE


def rope_cos_sin(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """The RoPE table of this family's frequencies (models/rope.py): (2, max_seq_len, head_dim // 2, 2)."""
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.float64, device=device) / args.head_dim
    inv_freq = (1.0 / args.rope_theta**exponents).float()
    return rope_table(inv_freq, args.max_seq_len)


# ------------------------------------------------------------------------ modules


class _SumOfShards(torch.autograd.Function):
    """A Partial DTensor (bs, seqlen, 1) made Replicate, its gradient made Replicate too: an all-reduce of the
    statistic each way. DTensor's own redistribute leaves the gradient Partial (its adjoint needs no
    communication), which then meets the sharded input in backward as a full-width reduce-scatter."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, partial: DTensor) -> DTensor:
        return partial.redistribute(placements=[Replicate()] * partial.device_mesh.ndim)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: DTensor) -> DTensor:
        return grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)


class ProjectionNorm(nn.Module):
    """RMSNorm over a whole projection output (all heads at once), in fp32.

    Written out rather than nn.RMSNorm because of tensor parallel: the projection's output, and so this
    norm's input and weight, are split over the TP ranks along the normalized dimension (plans.py hands
    it a DTensor sharded on its last dim). The mean of squares is then a sum over the local shard, a
    DTensor Partial, made whole by `_SumOfShards`: an all-reduce of (bs, seqlen, 1) in forward and one
    of the same size in backward. Left to DTensor (its implicit redistribution inside the `+ eps`), the
    forward is the same but the backward carries the partial gradient on to the full-width input and
    reduce-scatters (bs, seqlen, heads * head_dim) there.
    Unsplit, it is nn.RMSNorm's arithmetic (in fp32, as transformers' Olmo2RMSNorm).
    """

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.width = width
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sum_of_squares = xf.pow(2).sum(-1, keepdim=True)  # (bs, seqlen, 1)
        if isinstance(sum_of_squares, DTensor):  # a sum of this rank's columns only: add the other ranks'
            sum_of_squares = _SumOfShards.apply(sum_of_squares)
        mean_square = sum_of_squares / self.width  # the full width, not the local shard's
        return (xf * torch.rsqrt(mean_square + self.eps) * self.weight).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Causal grouped-query self-attention with QK-norm over the whole q and k projections."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.sdpa = ScaledDotProductAttention()
        self.q_norm = ProjectionNorm(args.n_heads * args.head_dim, args.norm_eps)
        self.k_norm = ProjectionNorm(args.kv_heads * args.head_dim, args.norm_eps)

    def forward(
        self, x: torch.Tensor, cos_sin: torch.Tensor, mask: AttentionMask = None, kv: LayerCache | None = None
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # Normalized before the split into heads; -1 heads: under tensor parallelism each rank holds a slice.
        q = self.q_norm(self.wq(x)).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_heads, head_dim)
        k = self.k_norm(self.wk(x)).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_kv_heads, head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_kv_heads, head_dim)
        q, k = apply_rope(q, k, cos_sin)
        if kv is not None:  # generation: attend over every cached position (models/kv_cache.py)
            k, v = kv.update(k, v)
        return self.wo(self.sdpa(q, k, v, mask))  # (models/attention.py; context parallel wraps it)

    def init_weights(self) -> None:
        for linear in (self.wq, self.wk, self.wv, self.wo):
            _fan_in_init(linear)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self) -> None:
        for linear in (self.w1, self.w2, self.w3):
            _fan_in_init(linear)


def _fan_in_init(linear: nn.Linear) -> None:
    """std fan_in^-0.5 (truncated at 3 std): unit-RMS outputs for unit-RMS inputs. At OLMo 2's widths that is
    about the 0.02 of the other families (4096: 0.0156), and in small shapes it keeps a branch's output far
    above the post-norm's eps: with 0.02 at dim 64 the MLP branch's RMS is about 0.003, which its post-norm
    scales up 300-fold, float32 rounding with it (the tiny parity model then drifted 6e-5 from one process)."""
    std = linear.weight.shape[1] ** -0.5
    nn.init.trunc_normal_(linear.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class TransformerBlock(nn.Module):
    """Post-norm block: h = x + norm(attn(x)), then h + norm(mlp(h)).

    No depth-scaled init of wo and w2 (Llama's and Qwen3's smaller std the deeper the layer): the norm
    right after each of them undoes any scale they start with, so the branch adds unit-RMS output times
    the norm's gain whatever their std is.
    """

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.post_attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.post_ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self, x: torch.Tensor, cos_sin: torch.Tensor, mask: AttentionMask = None, kv: LayerCache | None = None
    ) -> torch.Tensor:
        h = x + self.post_attention_norm(self.attention(x, cos_sin, mask, kv=kv))
        return h + self.post_ffn_norm(self.feed_forward(h))

    def init_weights(self) -> None:
        self.post_attention_norm.reset_parameters()
        self.post_ffn_norm.reset_parameters()
        self.attention.init_weights()
        self.feed_forward.init_weights()


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Every published size is untied; a tied shape (from a config.json) reuses the embedding matrix,
        # with no shared Parameter object: `to_empty` and FSDP would silently untie one.
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
        """tokens (bs, seqlen) int64 -> logits (bs, seqlen, vocab); the arguments are those of every family's
        forward (models/qwen3/model.py documents each)."""
        rope = self.rope_cos_sin if positions is None else self.rope_cos_sin[:, positions]
        # A pipeline stage (parallelisms/pp.py) may lack the embedding or the final norm and output.
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
    embedding only, as the other families do: an untied output projection is a matmul weight and stays."""
    norms = 2 * args.dim + (args.n_heads + args.kv_heads) * args.head_dim  # two post-norms + QK-norm
    per_layer = _matmul_params_per_layer(args) + norms
    embedding = args.vocab_size * args.dim
    output = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    total = embedding + args.n_layers * per_layer + args.dim + output
    return total - embedding if exclude_embedding else total


def num_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), the convention behind reported MFU, as for the other
    families: 6 per matmul weight per token over the blocks' projections and the output projection, none for
    the embedding lookup or the norms; plus attention scores and values, 12 * n_layers * n_heads * head_dim *
    seq_len, the causal mask not credited. tests/test_olmo2.py checks this against FlopCounterMode.
    """
    matmul_params = args.n_layers * _matmul_params_per_layer(args) + args.vocab_size * args.dim
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return 6 * matmul_params + attention
