"""What is particular to Llama in Hugging Face folders: config.json <-> ModelArgs, weight names,
where the published weights live. Reading and writing the folders is generic (models/hf.py).

Weight names map one to one:

    model.embed_tokens.weight                 tok_embeddings.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj layers.{i}.attention.w{q,k,v,o}
    model.layers.{i}.mlp.gate_proj            layers.{i}.feed_forward.w1
    model.layers.{i}.mlp.down_proj            layers.{i}.feed_forward.w2
    model.layers.{i}.mlp.up_proj              layers.{i}.feed_forward.w3
    model.layers.{i}.input_layernorm          layers.{i}.attention_norm
    model.layers.{i}.post_attention_layernorm layers.{i}.ffn_norm
    model.norm.weight                         norm.weight
    lm_head.weight                            output.weight (absent when embeddings are tied)

RoPE layout: Meta's original checkpoints (and torchtitan's model) rotate interleaved pairs
(x0, x1), (x2, x3), ... of each head, so converting them to HF permutes the rows of q_proj and
k_proj. Our model uses HF's "rotate half" layout, pairing x_i with x_{i + head_dim/2}, so HF
q_proj/k_proj are our wq/wk as they are: no permutation in either direction.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from models.hf_reader import HFConfigReader, HFDefaults
from models.llama3.model import FLAVORS, ModelArgs, RopeScaling

MODEL_TYPE = "llama"  # config.json's model_type
# Written by old transformers versions: the RoPE table, which the model derives from the config.
IGNORED_WEIGHT_SUFFIXES = (".self_attn.rotary_emb.inv_freq",)
# Where each published flavor's weights and tokenizer live on the Hugging Face hub (gated: accept the license first).
PUBLISHED = {
    "llama3_1b": "meta-llama/Llama-3.2-1B",
    "llama3_3b": "meta-llama/Llama-3.2-3B",
    "llama3_8b": "meta-llama/Llama-3.1-8B",
    "llama3_70b": "meta-llama/Llama-3.1-70B",
    "llama3_405b": "meta-llama/Llama-3.1-405B",
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
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
STACKED_PER_LAYER: dict[str, str] = {}  # every weight is one HF tensor (models.hf.hf_sources: an MoE's experts are not)
# transformers' LlamaConfig defaults, which a config.json that omits the key gets (num_key_value_heads null or
# absent: multi-head).
_DEFAULTS = HFDefaults(rms_norm_eps=1e-6, max_position_embeddings=2048)


def model_args_from_hf_config(cfg: dict[str, Any], *, source: str) -> ModelArgs:
    """ModelArgs from a Llama config.json's contents. Every field that changes the function is mapped;
    one the model cannot represent is refused, all such fields together, each line naming `source`
    (models/hf_reader.py reads what every family reads; this adds Llama's own)."""
    read = HFConfigReader(cfg, source=source, defaults=_DEFAULTS, rope_types=("default", "llama3"))
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if read.head_dim * n_heads != dim:  # the model derives head_dim = dim / n_heads
        if cfg.get("head_dim") is None:
            read.refuse("hidden_size", f"is not divisible by num_attention_heads = {n_heads}")
        else:
            read.refuse(
                "head_dim", f"differs from hidden_size / num_attention_heads = {dim // n_heads}; the model derives it"
            )
    if cfg.get("mlp_bias"):
        read.refuse("mlp_bias", "is not supported; the model's projections have no bias")
    # pretraining_tp only splits the matmuls of old transformers code into slices: same function, ignored.

    rope_scaling = None
    if read.rope_type == "llama3":
        fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if missing := [f for f in fields if f not in read.rope]:
            read.problem(f"{read.rope_key} of type llama3 lacks {', '.join(missing)}")
        else:
            rope_scaling = RopeScaling(
                factor=float(read.rope["factor"]),
                low_freq_factor=float(read.rope["low_freq_factor"]),
                high_freq_factor=float(read.rope["high_freq_factor"]),
                original_max_position_embeddings=int(read.rope["original_max_position_embeddings"]),
            )
    read.check()
    return _with_ffn_width(ModelArgs(**read.args(), rope_scaling=rope_scaling), cfg["intermediate_size"])


def _with_ffn_width(args: ModelArgs, width: int) -> ModelArgs:
    """Express the SwiGLU width the way a flavor does when one produces it, so a published
    Llama 3 config maps onto its flavor exactly; otherwise keep the width verbatim."""
    # Flavors of the same width first: 3B's multiplier 1.0 and the debug model's None agree at 3072.
    for flavor in sorted(FLAVORS.values(), key=lambda f: f.dim != args.dim):
        candidate = dataclasses.replace(
            args, multiple_of=flavor.multiple_of, ffn_dim_multiplier=flavor.ffn_dim_multiplier
        )
        if candidate.hidden_dim == width:
            return candidate
    return dataclasses.replace(args, hidden_dim_override=width)


def hf_config(args: ModelArgs, *, dtype: torch.dtype) -> dict[str, Any]:
    """A config.json for `args`, in the layout published Llama 3.1 folders use (rope_theta +
    rope_scaling), which transformers 4 and 5 and inference stacks all read."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
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
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if args.rope_scaling is not None:
        s = args.rope_scaling
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return config
