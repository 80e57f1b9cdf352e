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

from models.hf_reader import HFConfigReader, HFDefaults
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
# transformers' Qwen3Config defaults, which a config.json that omits the key gets (note head_dim: 128, not
# hidden_size / num_attention_heads; and num_key_value_heads: 32, null meaning multi-head; every published config
# sets rope_theta 1e6).
_DEFAULTS = HFDefaults(rms_norm_eps=1e-6, max_position_embeddings=32768, num_key_value_heads=32, head_dim=128)


def model_args_from_hf_config(cfg: dict[str, Any], *, source: str) -> ModelArgs:
    """ModelArgs from a Qwen3 config.json's contents. Every field that changes the function is mapped;
    one the model cannot represent is refused, all such fields together, each line naming `source`
    (models/hf_reader.py reads them all: Qwen3 dense adds only its MLP's width)."""
    read = HFConfigReader(cfg, source=source, defaults=_DEFAULTS)
    read.check()
    return ModelArgs(**read.args(), head_dim=read.head_dim, hidden_dim=cfg["intermediate_size"])


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
