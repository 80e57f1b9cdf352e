"""Qwen3 MoE (30B-A3B, 235B-A22B) as one plain PyTorch module.

Shape legend used in the comments:
    bs: batch size, seqlen: sequence length, dim: model width, tokens: bs * seqlen,
    n_heads / n_kv_heads: query / key-value heads, head_dim: the width of one head (explicit, as in Qwen3),
    experts: experts per block (num_experts), top_k: experts each token runs through,
    hidden: one expert's SwiGLU width (HF moe_intermediate_size), vocab: vocabulary size.

What differs from Qwen3 dense (models/qwen3/model.py), and nothing else does: every block's MLP is a sparse
mixture of experts (Qwen3MoeSparseMoeBlock in transformers), in four steps kept apart so that expert parallelism
puts its all-to-alls between them (parallelisms/ep.py):

  * route: a linear router scores every expert in float32, softmax over the experts, the top_k per token, their
    probabilities renormalized to sum to 1 when norm_topk_prob (every published size). No capacity factor: no
    token is dropped, however unbalanced the choice.
  * dispatch: the (token, choice) pairs sorted by expert (a stable sort: within an expert, token order).
  * experts: each expert's SwiGLU over its tokens, the experts' weights as 3-D parameters (experts, out, in),
    the three projections each ONE grouped matmul over the sorted tokens (`grouped_mm`).
  * combine: back to token order, each token's outputs summed with its routing weights (in float32).

Nothing is recorded on the module: the forward is a pure function of (parameters, tokens), so activation
checkpointing reruns it safely (docs/failures.md #2). Load balancing in training (args.balance, models/moe.py) keeps
its statistics in autograd's gradient of a leaf, which a recomputed forward does not add to again, and adds an
expert bias to the router's choice when on; what a router statistic needs (each block's router probabilities and
tokens per expert) is the router's output, `Routing`.

Every block is an MoE block: the published configs have decoder_sparse_step 1 and no mlp_only_layers, and hf.py
refuses the others. The attention, its QK-norm, RoPE and the rest of the skeleton are Qwen3's, copied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import register_flop_formula

from models.attention import AttentionMask, ScaledDotProductAttention, attention_mask
from models.kv_cache import KVCache, LayerCache, check_inference
from models.moe import LoadBalance, MoEBalance
from models.rope import apply_rope, rope_table


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    moe_hidden_dim: int  # one expert's SwiGLU width (HF moe_intermediate_size)
    num_experts: int
    top_k: int  # experts per token (HF num_experts_per_tok)
    norm_topk_prob: bool = True  # renormalize the top_k probabilities to sum to 1 (every published size does)
    vocab_size: int = 151936
    norm_eps: float = 1e-6  # every RMSNorm: the blocks', the final one and QK-norm
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 32768  # longest sequence the flavor supports (RoPE table length)
    tie_word_embeddings: bool = False
    attn_mask_type: str = "causal"  # or "block_causal": attention stays inside each packed document
    # Load balancing and routing statistics in training (models/moe.py), config's [model.moe]; None (a flavor, a
    # Hugging Face folder): transformers' function alone.
    balance: MoEBalance | None = None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads


# The published sizes, from the config.json of each Hugging Face repo in hf.py's PUBLISHED (Qwen/Qwen3-30B-A3B-Base;
# Qwen/Qwen3-235B-A22B, which has no Base release), cross-checked against the model cards and torchtitan 0.2.2's
# qwen3 MoE flavors (whose 30B-A3B max_seq_len and 235B-A22B rope_theta are those of the later 2507 releases).
# Both: vocab 151936, untied, rms_norm_eps 1e-6, rope_theta 1e6 without scaling, head_dim 128, 4 KV heads, 128 experts,
# 8 per token, norm_topk_prob true, decoder_sparse_step 1, no mlp_only_layers.
FLAVORS: dict[str, ModelArgs] = {
    # ~7M parameters, ~3M active: trains on two CPU cores with the shipped 2048-token BPE. Qwen3's debug attention
    # (heads wider than dim / n_heads) and 8 experts of 2 active, the ratio of hidden to dim of 30B-A3B's experts.
    "debugmodel": ModelArgs(
        dim=256, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=32, moe_hidden_dim=128, num_experts=8, top_k=2,
        vocab_size=2048, max_seq_len=2048,
    ),
    "qwen3_moe_30b_a3b": ModelArgs(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, moe_hidden_dim=768, num_experts=128, top_k=8,
    ),
    "qwen3_moe_235b_a22b": ModelArgs(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, moe_hidden_dim=1536, num_experts=128, top_k=8,
        max_seq_len=40960,
    ),
}  # fmt: skip


# --------------------------------------------------------------------------- RoPE


# Copied from models.qwen3.model.rope_cos_sin
def rope_cos_sin(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """The RoPE table of this family's frequencies (models/rope.py): (2, max_seq_len, head_dim // 2, 2)."""
    # Frequencies in float64, rounded once: theta 1e6 makes the slowest ones tiny.
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.float64, device=device) / args.head_dim
    inv_freq = (1.0 / args.rope_theta**exponents).float()
    return rope_table(inv_freq, args.max_seq_len)


# ------------------------------------------------------------------ grouped matmul


# torch.nn.functional.grouped_mm (a private aten op underneath, PyTorch 2.13) computes float32 in eager mode (CPU
# checked here), but its meta function accepts bfloat16 only, so torch.compile, the meta device and the memory
# estimator's fake tensors refuse a float32 model (the CPU debug runs, the float32 parity tests). Wrapped as custom
# ops with their own shape functions, the same kernel runs in every dtype under all of them; the backward is two
# more grouped matmuls, custom ops too, so that compile traces it as well. The kernels need rows of a multiple of
# 16 bytes: dim and moe_hidden_dim multiples of 8 in bfloat16, of 4 in float32 (every published size's are).
# The ops' namespace is this package's name, so that a copy of the folder registers its own.
_OPS = __name__.rpartition(".")[0].replace(".", "_")


@torch.library.custom_op(f"{_OPS}::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (rows, in), its rows sorted by group; w (groups, out, in); offsets (groups,) int32, where each group's
    rows end -> (rows, out): group e's rows times w[e] transposed, as a linear layer per group."""
    return F.grouped_mm(x, w.transpose(-2, -1), offs=offsets)


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op(f"{_OPS}::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The gradient of grouped_mm's w: grad (rows, out), x (rows, in) -> (groups, out, in), group e's grad rows
    transposed times its x rows."""
    return F.grouped_mm(grad.t(), x, offs=offsets)


@grouped_mm_weight_grad.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(offsets.shape[0], grad.shape[1], x.shape[1])


def _grouped_mm_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    x, w, offsets = ctx.saved_tensors
    grad = grad.contiguous()  # the kernel refuses a broadcast (stride 0) gradient
    return grouped_mm(grad, w.transpose(-2, -1), offsets), grouped_mm_weight_grad(grad, x, offsets), None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


# FlopCounterMode counts the custom ops as the matmuls they are (2 FLOPs per multiply-add).
@register_flop_formula(getattr(torch.ops, _OPS).grouped_mm)
def _grouped_mm_flops(x_shape: tuple, w_shape: tuple, *args: object, **kwargs: object) -> int:
    return 2 * x_shape[0] * x_shape[1] * w_shape[1]


@register_flop_formula(getattr(torch.ops, _OPS).grouped_mm_weight_grad)
def _grouped_mm_weight_grad_flops(grad_shape: tuple, x_shape: tuple, *args: object, **kwargs: object) -> int:
    return 2 * grad_shape[0] * grad_shape[1] * x_shape[1]


# ------------------------------------------------------------------------ modules


# Copied from models.qwen3.model.Attention
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


class Routing(NamedTuple):
    """Where a block's router sends its tokens: what dispatch and combine need, and what the load balancing
    (models/moe.py) reads."""

    probs: torch.Tensor  # (tokens, experts) float32: the softmax over every expert
    expert_ids: torch.Tensor  # (tokens, top_k) int64: each token's chosen experts
    weights: torch.Tensor  # (tokens, top_k) float32: their routing weights (renormalized when norm_topk_prob)
    tokens_per_expert: torch.Tensor  # (experts,) int64: how many (token, choice) pairs each expert gets


class Router(nn.Module):
    """Top-k token choice: a linear score per expert, computed in float32 whatever the parameters' dtype (the
    choice is discrete: bfloat16 rounding would move tokens between experts)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.top_k
        self.norm_topk_prob = args.norm_topk_prob
        # A bare weight, not an nn.Linear: no converter (float8) may lower the router's precision.
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.dim))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> Routing:
        """x (tokens, dim) -> Routing. bias (experts,): added to the probabilities for the choice of the top_k only
        (models/moe.py's expert bias); the routing weights stay the probabilities."""
        logits = F.linear(x.float(), self.weight.float())  # (tokens, experts)
        probs = logits.softmax(dim=-1)
        if bias is None:
            weights, expert_ids = probs.topk(self.top_k, dim=-1)  # (tokens, top_k)
        else:
            expert_ids = (probs + bias).topk(self.top_k, dim=-1).indices
            weights = probs.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = expert_ids.flatten()
        # A count per expert of a fixed shape (bincount's would depend on the values, which compile cannot trace).
        tokens_per_expert = flat.new_zeros(self.weight.shape[0]).scatter_add(0, flat, torch.ones_like(flat))
        return Routing(probs, expert_ids, weights, tokens_per_expert)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.weight, mean=0.0, std=init_std)


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (tokens, dim), expert_ids (tokens, top_k) -> (the routed rows (tokens * top_k, dim) sorted by expert, and
    `order`: which (token, choice) pair, flattened, each routed row is). A stable sort keeps token order within an
    expert, so the result does not depend on the sort's implementation."""
    order = torch.argsort(expert_ids.flatten(), stable=True)  # (tokens * top_k,)
    return x[order // expert_ids.shape[1]], order


def combine(out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The experts' outputs (tokens * top_k, dim) in dispatch's order -> (tokens, dim) float32: put back in
    (token, choice) order, each token's top_k outputs summed with their routing weights (tokens, top_k)."""
    tokens, top_k = weights.shape
    unsorted = out[torch.argsort(order)].view(tokens, top_k, -1).float()  # (tokens, top_k, dim)
    return (unsorted * weights.unsqueeze(-1)).sum(dim=1)


class GroupedExperts(nn.Module):
    """The experts' SwiGLUs, w2(silu(w1 x) * w3 x) per expert, over rows sorted by expert: each projection one
    grouped matmul. The weights are (experts, out, in), each expert's slice laid out as a linear layer's weight."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(args.num_experts, args.moe_hidden_dim, args.dim))  # gate
        self.w2 = nn.Parameter(torch.empty(args.num_experts, args.dim, args.moe_hidden_dim))  # down
        self.w3 = nn.Parameter(torch.empty(args.num_experts, args.moe_hidden_dim, args.dim))  # up

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x (rows, dim) sorted by expert, tokens_per_expert (experts,): how many rows each has -> (rows, dim)."""
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        h = F.silu(grouped_mm(x, self.w1, offsets)) * grouped_mm(x, self.w3, offsets)  # (rows, hidden)
        return grouped_mm(h, self.w2, offsets)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)


class MoE(nn.Module):
    """The sparse MLP: route, dispatch, the experts, combine (the module docstring's four steps), and in training
    the load balancing of args.balance (models/moe.py)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.router = Router(args)
        self.experts = GroupedExperts(args)
        self.balance = (
            LoadBalance(args.num_experts, args.balance, moe_layers=args.n_layers) if args.balance is not None else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (bs, seqlen, dim) -> (bs, seqlen, dim)."""
        tokens = x.flatten(0, 1)  # (tokens, dim)
        routing = self.router(tokens, bias=self.balance.expert_bias if self.balance is not None else None)
        routed, order = dispatch(tokens, routing.expert_ids)  # (tokens * top_k, dim)
        out = combine(self.experts(routed, routing.tokens_per_expert), order, routing.weights)
        if self.balance is not None:  # the load-balancing loss's gradient, the step's statistics (models/moe.py)
            out = self.balance(out, routing.probs, routing.tokens_per_expert)
        return out.to(x.dtype).view_as(x)

    def init_weights(self, init_std: float) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.balance is not None:
            self.balance.init_buffers()


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + moe(norm(h))."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.moe = MoE(args)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Output projections get a smaller init the deeper the layer (GPT-2/torchtitan style),
        # so the residual stream's variance does not grow with depth.
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(
        self, x: torch.Tensor, cos_sin: torch.Tensor, mask: AttentionMask = None, kv: LayerCache | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos_sin, mask, kv=kv)
        return h + self.moe(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.moe.init_weights(self.init_std)


# Copied from models.qwen3.model.Transformer with Tied sizes (0.6B to 4B)->Tied models
class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Tied models reuse the embedding matrix as the output projection. No shared
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


def _matmul_params_per_layer(args: ModelArgs, *, experts: int) -> int:
    """The weights of one block's matmuls, with `experts` of its experts (all of them, or the top_k one token runs)."""
    attention = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads)  # wq, wk, wv, wo
    router = args.num_experts * args.dim
    return attention + router + experts * 3 * args.dim * args.moe_hidden_dim  # + w1, w2, w3 of each expert


def _params(args: ModelArgs, *, experts: int, exclude_embedding: bool) -> int:
    norms = 2 * args.dim + 2 * args.head_dim  # the block's two RMSNorms + QK-norm
    per_layer = _matmul_params_per_layer(args, experts=experts) + norms
    embedding = args.vocab_size * args.dim
    output = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    total = embedding + args.n_layers * per_layer + args.dim + output
    return total - embedding if exclude_embedding else total


def num_params(args: ModelArgs, *, exclude_embedding: bool = False) -> int:
    """Parameter count from the shapes alone (no model needed): every expert's. exclude_embedding drops the input
    embedding only, as Llama's and Qwen3's do (the model cards' "non-embedding" counts also drop the output)."""
    return _params(args, experts=args.num_experts, exclude_embedding=exclude_embedding)


def active_params(args: ModelArgs, *, exclude_embedding: bool = False) -> int:
    """The parameters one token runs through: num_params with top_k experts per block instead of all of them (the
    router scores every expert, so all of it counts). The model cards' "activated" counts, the A3B of 30B-A3B."""
    return _params(args, experts=args.top_k, exclude_embedding=exclude_embedding)


def num_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), the convention behind reported MFU, over ACTIVE parameters.

    As for Qwen3: 6 FLOPs per matmul weight per token over the blocks' projections and the output projection (also
    when tied), none for the embedding lookup or the norms; of the experts, the top_k each token runs through, and
    the router (one score per expert); plus attention scores and values, 12 * n_layers * n_heads * head_dim *
    seq_len, the causal mask not credited. tests/test_qwen3_moe.py checks this against FlopCounterMode.
    """
    matmul_params = args.n_layers * _matmul_params_per_layer(args, experts=args.top_k) + args.vocab_size * args.dim
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return 6 * matmul_params + attention
