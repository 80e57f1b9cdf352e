"""What is particular to OLMo 2 in Hugging Face folders: config.json <-> ModelArgs, weight names, where the
published weights live. Reading and writing the folders is generic (models/hf.py).

Weight names map one to one:

    model.embed_tokens.weight                    tok_embeddings.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj    layers.{i}.attention.w{q,k,v,o}
    model.layers.{i}.self_attn.{q,k}_norm        layers.{i}.attention.{q,k}_norm (over the whole projection)
    model.layers.{i}.mlp.gate_proj               layers.{i}.feed_forward.w1
    model.layers.{i}.mlp.down_proj               layers.{i}.feed_forward.w2
    model.layers.{i}.mlp.up_proj                 layers.{i}.feed_forward.w3
    model.layers.{i}.post_attention_layernorm    layers.{i}.post_attention_norm (after attention, not before the MLP)
    model.layers.{i}.post_feedforward_layernorm  layers.{i}.post_ffn_norm
    model.norm.weight                            norm.weight
    lm_head.weight                               output.weight (absent when embeddings are tied)

RoPE: HF's Olmo2 rotates half of each head, as our model does, so q_proj/k_proj load as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from models.hf_reader import HFConfigReader, HFDefaults
from models.olmo2.model import ModelArgs

MODEL_TYPE = "olmo2"  # config.json's model_type
# Written by old transformers versions: the RoPE table, which the model derives from the config.
IGNORED_WEIGHT_SUFFIXES = (".self_attn.rotary_emb.inv_freq",)
# Where each published flavor's weights and tokenizer live on the Hugging Face hub: the Base (pretrained
# only) repos. allenai/OLMo-2-0425-1B and allenai/OLMo-2-0325-32B have no flavor yet (model.py says why).
PUBLISHED = {
    "olmo2_1b": "allenai/OLMo-2-0425-1B",
    "olmo2_7b": "allenai/OLMo-2-1124-7B",
    "olmo2_13b": "allenai/OLMo-2-1124-13B",
    "olmo2_32b": "allenai/OLMo-2-0325-32B",
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
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffn_norm",
}
STACKED_PER_LAYER: dict[str, str] = {}  # every weight is one HF tensor (models.hf.hf_sources: an MoE's experts are not)
# transformers' Olmo2Config defaults, which a config.json that omits the key gets (num_key_value_heads null or
# absent: multi-head; head_dim absent: hidden_size / num_attention_heads, as Olmo2Attention reads it; every published
# config sets rope_theta 500000).
_DEFAULTS = HFDefaults(rms_norm_eps=1e-5, max_position_embeddings=2048)


def model_args_from_hf_config(cfg: dict[str, Any], *, source: str) -> ModelArgs:
    """ModelArgs from an OLMo 2 config.json's contents. Every field that changes the function is mapped;
    one the model cannot represent is refused, all such fields together, each line naming `source`
    (models/hf_reader.py reads them all: OLMo 2 adds only its MLP's width)."""
    read = HFConfigReader(cfg, source=source, defaults=_DEFAULTS)
    read.check()
    return ModelArgs(**read.args(), head_dim=read.head_dim, hidden_dim=cfg["intermediate_size"])


def hf_config(args: ModelArgs, *, dtype: torch.dtype) -> dict[str, Any]:
    """A config.json for `args` in the layout of the published OLMo 2 folders (rope_theta + rope_scaling,
    transformers 4.47), which transformers 4 and 5 read as Olmo2ForCausalLM. head_dim only when it is not
    dim / n_heads (the published configs never write it)."""
    config = {
        "architectures": ["Olmo2ForCausalLM"],
        "model_type": MODEL_TYPE,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if args.head_dim * args.n_heads != args.dim:
        config["head_dim"] = args.head_dim
    return config
