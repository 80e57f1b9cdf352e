"""Tiny random Hugging Face Llama folders for tests: no downloads, made in a second."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from tests.launch import REPO

SHIPPED_TOKENIZER = REPO / "assets" / "tokenizer"
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # Small enough that at seq_len 64 RoPE has unscaled, interpolated and scaled bands.
    "original_max_position_embeddings": 64,
}  # fmt: skip
BASE = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=192,
    vocab_size=2048, max_position_embeddings=256, rope_theta=500000.0, rms_norm_eps=1e-5,
)  # fmt: skip


@torch.no_grad()
def unit_scale_init_(model: nn.Module, *, seed: int, gain_noise: float = 0.2) -> None:
    """Weights that give O(1) activations, logits and gradients (a transformers model's names).

    transformers' init (std 0.02) leaves the logits nearly uniform and the gradients tiny, where
    a wrong RoPE, norm or gradient would hardly show above float32 noise.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.ndim == 1:  # RMSNorm gains
            p.copy_(1 + gain_noise * noise)
        elif "embed" in name:
            p.copy_(noise)
        else:  # (out, in) projections: unit variance out for unit variance in
            p.copy_(noise * p.shape[1] ** -0.5)


def tiny_hf_model(*, seed: int = 0, **config: Any) -> LlamaForCausalLM:
    """A transformers LlamaForCausalLM (fp32, eager attention: the plainest reference math)."""
    cfg = LlamaConfig(**{**BASE, **config}, attn_implementation="eager")
    model = LlamaForCausalLM(cfg).float()
    unit_scale_init_(model, seed=seed)
    return model.eval()


def save_hf_folder(
    model: LlamaForCausalLM, path: Path, *, tokenizer: bool = True, max_shard_size: str | None = None
) -> Path:
    """save_pretrained (sharded when max_shard_size is small), plus the shipped tokenizer files."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        for file in SHIPPED_TOKENIZER.iterdir():
            shutil.copy2(file, path / file.name)
    return path


def tiny_hf_folder(path: Path, *, seed: int = 0, **config: Any) -> Path:
    return save_hf_folder(tiny_hf_model(seed=seed, **config), path)
