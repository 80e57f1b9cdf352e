"""The same Llama as a transformers `LlamaForCausalLM`, trainable through this recipe.

Users fine-tune transformers models, so `[model] name = "hf_llama"` trains one through the
same path as our own model: meta device -> `parallelize_llama` -> `to_empty` ->
`init_weights()`. That is the route where the two activation-checkpointing failures of
PROBLEMS.md happen, and where `apply_ac`'s guards refuse them:

  * `[model] hf_gradient_checkpointing = true` switches on transformers' own (reentrant)
    checkpointing, as llama-recipes did; with `activation_checkpoint.mode` != "none" too,
    every layer would be recomputed twice (#1).
  * `[model] hf_use_cache = true` leaves the KV cache on in training; under activation
    checkpointing the recomputation appends to the cache again (#2).

Both default to off and are warned about when switched on. Tensor parallel plans exist for
our own module names only.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from models.llama3.hf import hf_config
from models.llama3.model import ModelArgs


class HFLlama(LlamaForCausalLM):
    """`LlamaForCausalLM` with our model's training interface: tokens -> logits, init_weights()."""

    def __init__(self, args: ModelArgs, *, use_cache: bool = False):
        fields = hf_config(args, dtype=torch.float32)
        # transformers checks llama3 RoPE scaling against the context length: keep the
        # published one even when the recipe trains (and so builds RoPE for) shorter sequences.
        if args.rope_scaling is not None:
            original = args.rope_scaling.original_max_position_embeddings
            fields["max_position_embeddings"] = max(args.max_seq_len, original + 1)
        config = LlamaConfig(**fields)
        config.use_cache = use_cache
        config._attn_implementation = "sdpa"
        super().__init__(config)
        self.args = args

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """tokens (bs, seqlen) int64 -> logits (bs, seqlen, vocab)."""
        return super().forward(input_ids=tokens).logits

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Fill parameters and the RoPE buffers in place (also on sharded DTensor parameters)."""
        # The rotary embedding computed its frequencies on the meta device; recompute them.
        with torch.device(buffer_device or "cpu"):
            fresh = LlamaRotaryEmbedding(self.config)
        for name, buffer in fresh.named_buffers():
            setattr(self.model.rotary_emb, name, buffer)
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, LlamaRMSNorm):
                nn.init.ones_(module.weight)
