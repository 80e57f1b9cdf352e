"""What is particular to Qwen3 dense in Hugging Face folders: config.json <-> ModelArgs, weight names,
where the published weights live. Reading and writing the folders is generic (models/hf.py).

Weight names map one to one (and are torchtitan's names for its qwen3 model too):

    model.embed_tokens.weight                 tok_embeddings.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj layers.{i}.attention.w{q,k,v,o}
    model.layers.{i}.self_attn.{q,k}_norm     layers.{i}.attention.{q,k}_norm
    model.layers.{i}.mlp.gate_proj            layers.{i}.feed_forward.w1
    model.layers.{i}.mlp.down_proj            layers.{i}.feed_forward.w2
    model.layers.{i}.mlp.up_proj              layers.{i}.feed_forward.w3
    model.layers.{i}.input_layernorm          layers.{i}.attention_norm
    model.layers.{i}.post_attention_layernorm layers.{i}.ffn_norm
    model.norm.weight                         norm.weight
    lm_head.weight                            output.weight (absent when embeddings are tied)

RoPE: HF's Qwen3 rotates half of each head (x_i with x_{i + head_dim/2}), as our model does, so
q_proj/k_proj load as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from errors import ConfigError
from models.qwen3.model import ModelArgs

MODEL_TYPE = "qwen3"  # config.json's model_type
# Written by old transformers versions: the RoPE table, which the model derives from the config.
IGNORED_WEIGHT_SUFFIXES = (".self_attn.rotary_emb.inv_freq",)
# Where each published flavor's weights and tokenizer live on the Hugging Face hub. The Base
# (pretrained only) repos: a pretraining recipe continues pretraining or fine-tunes from them, and
# the post-trained ones (Qwen/Qwen3-8B) are chat/thinking models with the same shapes. Qwen published
# no Qwen3-32B-Base, so 32B points at the post-trained Qwen/Qwen3-32B.
PUBLISHED = {
    "qwen3_0.6b": "Qwen/Qwen3-0.6B-Base",
    "qwen3_1.7b": "Qwen/Qwen3-1.7B-Base",
    "qwen3_4b": "Qwen/Qwen3-4B-Base",
    "qwen3_8b": "Qwen/Qwen3-8B-Base",
    "qwen3_14b": "Qwen/Qwen3-14B-Base",
    "qwen3_32b": "Qwen/Qwen3-32B",
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
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
STACKED_PER_LAYER: dict[str, str] = {}  # every weight is one HF tensor (models.hf.hf_sources: an MoE's experts are not)
# transformers' Qwen3Config defaults, which a config.json that omits the key gets (note head_dim:
# 128, not hidden_size / num_attention_heads; and num_key_value_heads: 32, null meaning multi-head).
_DEFAULTS = {
    "head_dim": 128,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,  # transformers' default_theta: every published config sets 1e6
}


def model_args_from_hf_config(cfg: dict[str, Any], *, source: str) -> ModelArgs:
    """ModelArgs from a Qwen3 config.json's contents. Every field that changes the function is mapped;
    one the model cannot represent is refused, all such fields together, each line naming `source`."""
    problems: list[str] = []

    def refuse(key: str, why: str) -> None:
        problems.append(f"{source}: {key} = {cfg.get(key)!r} {why}")

    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not _positive_int(cfg.get(key)):
            refuse(key, "must be a positive integer")
    head_dim = cfg.get("head_dim", _DEFAULTS["head_dim"])
    n_kv_heads = cfg.get("num_key_value_heads", _DEFAULTS["num_key_value_heads"])
    if n_kv_heads is None:
        n_kv_heads = cfg.get("num_attention_heads")
    for key, value in (("head_dim", head_dim), ("num_key_value_heads", n_kv_heads)):
        if key in cfg and not _positive_int(value):
            refuse(key, "must be a positive integer")
    if problems:  # the checks below need the shape
        raise ConfigError(*problems)

    n_heads = cfg["num_attention_heads"]
    if n_heads % n_kv_heads:
        problems.append(f"{source}: num_key_value_heads = {n_kv_heads} does not divide num_attention_heads = {n_heads}")
    if head_dim % 2:
        refuse("head_dim", "is odd; RoPE rotates pairs of dimensions")
    if cfg.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "is not supported; the model's MLP is SwiGLU (silu)")
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
        hidden_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        norm_eps=float(cfg.get("rms_norm_eps", _DEFAULTS["rms_norm_eps"])),
        rope_theta=rope_theta,
        max_seq_len=int(cfg.get("max_position_embeddings", _DEFAULTS["max_position_embeddings"])),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", _DEFAULTS["tie_word_embeddings"])),
    )


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def hf_config(args: ModelArgs, *, dtype: torch.dtype) -> dict[str, Any]:
    """A config.json for `args` in the layout of the published Qwen3 folders (rope_theta + rope_scaling,
    transformers 4.51), which transformers 4 and 5 and inference stacks all read as Qwen3ForCausalLM."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": MODEL_TYPE,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
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
        "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
