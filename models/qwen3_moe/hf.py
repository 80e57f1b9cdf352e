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

from models.hf_reader import HFConfigReader, HFDefaults
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
# transformers' Qwen3MoeConfig defaults, which a config.json that omits the key gets (it has no head_dim of its own:
# transformers reads the key when given, else divides; every published config sets rope_theta 1e6).
_DEFAULTS = HFDefaults(rms_norm_eps=1e-6, max_position_embeddings=32768, num_key_value_heads=4)
_MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}


def model_args_from_hf_config(cfg: dict[str, Any], *, source: str) -> ModelArgs:
    """ModelArgs from a Qwen3 MoE config.json's contents. Every field that changes the function is mapped; one the
    model cannot represent is refused, all such fields together, each line naming `source` (models/hf_reader.py
    reads what every family reads; this adds the sparse MLP's)."""
    read = HFConfigReader(cfg, source=source, defaults=_DEFAULTS, sizes=())  # no dense MLP: no intermediate_size
    # transformers 5 writes num_experts as num_local_experts; the published (4.51) configs say num_experts.
    experts_key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    experts = cfg.get(experts_key, _MOE_DEFAULTS["num_experts"])
    top_k = cfg.get("num_experts_per_tok", _MOE_DEFAULTS["num_experts_per_tok"])
    hidden = cfg.get("moe_intermediate_size", _MOE_DEFAULTS["moe_intermediate_size"])
    sized = [read.positive(key, value) for key, value in ((experts_key, experts), ("num_experts_per_tok", top_k))]
    read.positive("moe_intermediate_size", hidden)
    if all(sized) and top_k > experts:
        read.refuse("num_experts_per_tok", f"exceeds {experts_key} = {experts}")
    if cfg.get("decoder_sparse_step", 1) != 1:
        read.refuse("decoder_sparse_step", "is not supported; every block of the model is sparse (set it to 1)")
    if cfg.get("mlp_only_layers"):
        read.refuse("mlp_only_layers", "is not supported; the model has no dense blocks (set it to [])")
    read.check()
    return ModelArgs(
        **read.args(),
        head_dim=read.head_dim,
        moe_hidden_dim=hidden,
        num_experts=experts,
        top_k=top_k,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )


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
