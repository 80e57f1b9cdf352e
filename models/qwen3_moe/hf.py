"""What is particular to Qwen3 MoE in Hugging Face folders: config.json <-> ModelArgs, weight names, where the
published weights live. Reading and writing the folders is generic (models/hf.py).

Weight names: Qwen3's (models/qwen3/hf.py) for attention, norms, embedding and output, and for the sparse MLP

    model.layers.{i}.mlp.gate.weight                      layers.{i}.moe.router.weight (experts, dim)
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight     layers.{i}.moe.experts.w1[e] (experts, hidden, dim)
    model.layers.{i}.mlp.experts.{e}.down_proj.weight     layers.{i}.moe.experts.w2[e] (experts, dim, hidden)
    model.layers.{i}.mlp.experts.{e}.up_proj.weight       layers.{i}.moe.experts.w3[e] (experts, hidden, dim)

The hub's folders store one tensor per expert, and so does transformers 5's save_pretrained: its Qwen3MoeExperts
holds the experts fused (gate_up_proj, down_proj) and converts to and from these names as it loads and saves. Each
of our 3-D expert weights is the stack of its experts' tensors along dim 0 (STACKED_PER_LAYER).
"""

from __future__ import annotations

from typing import Any

import torch

from errors import ConfigError
from models.qwen3_moe.model import ModelArgs

MODEL_TYPE = "qwen3_moe"  # config.json's model_type
# Written by old transformers versions: the RoPE table, which the model derives from the config.
IGNORED_WEIGHT_SUFFIXES = (".self_attn.rotary_emb.inv_freq",)
# Where each published flavor's weights and tokenizer live on the Hugging Face hub: the Base (pretrained only) repo
# where Qwen published one; Qwen3-235B-A22B has none, so it points at the post-trained repo.
PUBLISHED = {
    "qwen3_moe_30b_a3b": "Qwen/Qwen3-30B-A3B-Base",
    "qwen3_moe_235b_a22b": "Qwen/Qwen3-235B-A22B",
}
# Our parameter names of Hugging Face's weights (models.hf.hf_to_ours): at the top level, and in each layer
# (model.layers.<i>.<name>.weight -> layers.<i>.<ours>.weight).
TOP_LEVEL = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
PER_LAYER = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "self_attn.q_norm": "attention.q_norm",
    "self_attn.k_norm": "attention.k_norm",
    "mlp.gate": "moe.router",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
# Our parameters that Hugging Face stores as one tensor per expert (models.hf.hf_sources): in each layer,
# model.layers.<i>.<name, {} the expert's index> for every index along the parameter's dim 0 -> layers.<i>.<ours>.
STACKED_PER_LAYER = {
    "mlp.experts.{}.gate_proj.weight": "moe.experts.w1",
    "mlp.experts.{}.down_proj.weight": "moe.experts.w2",
    "mlp.experts.{}.up_proj.weight": "moe.experts.w3",
}
# transformers' Qwen3MoeConfig defaults, which a config.json that omits the key gets.
_DEFAULTS = {
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,  # transformers' default_theta: every published config sets 1e6
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
}
_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def model_args_from_hf_config(cfg: dict[str, Any], *, source: str) -> ModelArgs:
    """ModelArgs from a Qwen3 MoE config.json's contents. Every field that changes the function is mapped; one the
    model cannot represent is refused, all such fields together, each line naming `source`."""
    problems: list[str] = []

    def refuse(key: str, why: str) -> None:
        problems.append(f"{source}: {key} = {cfg.get(key)!r} {why}")

    for key in _SHAPE_KEYS:
        if not _positive_int(cfg.get(key)):
            refuse(key, "must be a positive integer")
    if problems:  # the defaults below need the shape
        raise ConfigError(*problems)
    # transformers 5 writes num_experts as num_local_experts; the published (4.51) configs say num_experts.
    experts_key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    sizes = {
        # Qwen3MoeConfig has no head_dim of its own: transformers reads the key when given, else divides.
        "head_dim": cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
        "num_key_value_heads": cfg.get("num_key_value_heads", _DEFAULTS["num_key_value_heads"]),
        experts_key: cfg.get(experts_key, _DEFAULTS["num_experts"]),
        "num_experts_per_tok": cfg.get("num_experts_per_tok", _DEFAULTS["num_experts_per_tok"]),
        "moe_intermediate_size": cfg.get("moe_intermediate_size", _DEFAULTS["moe_intermediate_size"]),
    }
    if sizes["num_key_value_heads"] is None:
        sizes["num_key_value_heads"] = cfg["num_attention_heads"]
    for key, value in sizes.items():
        if not _positive_int(value):
            problems.append(f"{source}: {key} = {value!r} must be a positive integer")
    if problems:  # the checks below need the shape
        raise ConfigError(*problems)

    n_heads, n_kv_heads, head_dim = cfg["num_attention_heads"], sizes["num_key_value_heads"], sizes["head_dim"]
    if n_heads % n_kv_heads:
        problems.append(f"{source}: num_key_value_heads = {n_kv_heads} does not divide num_attention_heads = {n_heads}")
    if head_dim % 2:
        refuse("head_dim", "is odd; RoPE rotates pairs of dimensions")
    if sizes["num_experts_per_tok"] > sizes[experts_key]:
        refuse("num_experts_per_tok", f"exceeds {experts_key} = {sizes[experts_key]}")
    if cfg.get("decoder_sparse_step", _DEFAULTS["decoder_sparse_step"]) != 1:
        refuse("decoder_sparse_step", "is not supported; every block of the model is sparse (set it to 1)")
    if cfg.get("mlp_only_layers"):
        refuse("mlp_only_layers", "is not supported; the model has no dense blocks (set it to [])")
    if cfg.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "is not supported; the model's experts are SwiGLU (silu)")
    if cfg.get("attention_bias"):
        refuse("attention_bias", "is not supported; the model's projections have no bias")
    if cfg.get("attention_dropout", 0.0):
        refuse("attention_dropout", "is not supported; the model has no dropout (set it to 0.0)")
    if cfg.get("use_sliding_window"):
        refuse("use_sliding_window", "is not supported; the model attends to the whole causal window (set it to false)")
    if any(t != "full_attention" for t in cfg.get("layer_types") or ()):
        kinds = sorted(set(cfg["layer_types"]) - {"full_attention"})
        problems.append(f"{source}: layer_types has {kinds}; the model implements full_attention layers only")

    # transformers < 5 writes rope_theta + rope_scaling, transformers 5 one rope_parameters dict.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", _DEFAULTS["rope_theta"])))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        problems.append(
            f"{source}: {rope_key}.rope_type = {rope_type!r} is not supported; the model implements RoPE "
            "without scaling (Qwen3's YaRN long-context extension included)"
        )
    if problems:
        raise ConfigError(*problems)

    return ModelArgs(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        moe_hidden_dim=sizes["moe_intermediate_size"],
        num_experts=sizes[experts_key],
        top_k=sizes["num_experts_per_tok"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", _DEFAULTS["norm_topk_prob"])),
        vocab_size=cfg["vocab_size"],
        norm_eps=float(cfg.get("rms_norm_eps", _DEFAULTS["rms_norm_eps"])),
        rope_theta=rope_theta,
        max_seq_len=int(cfg.get("max_position_embeddings", _DEFAULTS["max_position_embeddings"])),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", _DEFAULTS["tie_word_embeddings"])),
    )


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def hf_config(args: ModelArgs, *, dtype: torch.dtype) -> dict[str, Any]:
    """A config.json for `args` in the layout of the published Qwen3 MoE folders (rope_theta + rope_scaling,
    num_experts; transformers 4.51), which transformers 4 and 5 and inference stacks all read as Qwen3MoeForCausalLM.
    No intermediate_size: it sizes the dense MLP of blocks outside the sparse ones, and this model has none."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": MODEL_TYPE,
        "hidden_size": args.dim,
        "moe_intermediate_size": args.moe_hidden_dim,
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
        "output_router_logits": False,
        "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
