"""Tiny random Hugging Face models and folders (Llama, Qwen3, OLMo 2, Qwen3 MoE) for tests, and the helpers their parity tests
share: no downloads, made in a second."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.launch import REPO

SHIPPED_TOKENIZER = REPO / "assets" / "tokenizer"
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # Small enough that at seq_len 64 RoPE has unscaled, interpolated and scaled bands.
    "original_max_position_embeddings": 64,
}  # fmt: skip
BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=192,
    vocab_size=2048,
    max_position_embeddings=256,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
QWEN3_BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=192,
    vocab_size=512,
    max_position_embeddings=256,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
)
OLMO2_BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=192,
    vocab_size=512,
    max_position_embeddings=256,
    rope_theta=500_000.0,
    rms_norm_eps=1e-6,
)
# Qwen3's, with 8 experts of width 32 in every block, 2 per token (dimensions that are multiples of 4: the grouped
# matmul's CPU kernel needs rows of a multiple of 16 bytes).
QWEN3_MOE_BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    vocab_size=512,
    max_position_embeddings=256,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
)


@torch.no_grad()
def unit_scale_init_(model: nn.Module, *, seed: int, gain_noise: float = 0.2) -> None:
    """Weights that give O(1) activations, logits and gradients, for transformers' names and ours alike.

    transformers' init (std 0.02) leaves the logits nearly uniform and the gradients tiny, where
    a wrong RoPE, norm or gradient would hardly show above float32 noise.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.ndim == 1:  # RMSNorm gains, QK-norm's included: random gains tell their placement apart
            p.copy_(1 + gain_noise * noise)
        elif "embed" in name:  # embed_tokens, tok_embeddings
            p.copy_(noise)
        else:  # (out, in) projections, or (experts, out, in): unit variance out for unit variance in
            p.copy_(noise * p.shape[-1] ** -0.5)


# Each family's transformers model, config class and tiny config, one row each (`[model] name` -> row).
HF_MODELS = {
    "llama3": (LlamaForCausalLM, LlamaConfig, BASE),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, QWEN3_BASE),
    "olmo2": (Olmo2ForCausalLM, Olmo2Config, OLMO2_BASE),
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig, QWEN3_MOE_BASE),
}


def tiny_hf_model(*, seed: int = 0, family: str = "llama3", **config: Any) -> nn.Module:
    """The family's transformers model, its HF_MODELS row (fp32, eager attention: the plainest reference math)."""
    model_cls, config_cls, base = HF_MODELS[family]
    model = model_cls(config_cls(**{**base, **config}, attn_implementation="eager"))
    unit_scale_init_(model.float(), seed=seed)
    return model.eval()


# How real tokenizers frame a text, each made here from the shipped vocabulary (ids 0 and 1 are its two specials):
#   llama3   names <|begin_of_text|> and adds it before every text (Llama 3's; the shipped tokenizer's)
#   smollm2  names a BOS (its end-of-text, as SmolLM2's base tokenizer does) but adds nothing
#   qwen3    names no BOS at all and adds nothing; <|end_of_text|> ends a document (Qwen3's <|endoftext|>)
#   flags    tokenizer_config.json's add_bos_token / add_eos_token decide, whatever tokenizer.json says (transformers)
CONVENTIONS = {
    "llama3": {},
    "smollm2": {"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>", "post_processor": None},
    "qwen3": {"bos_token": None, "eos_token": "<|end_of_text|>", "post_processor": None},
    "flags": {"add_bos_token": True, "add_eos_token": True},
}


def tokenizer_folder(path: Path, convention: str = "llama3") -> Path:
    """The shipped tokenizer's files in `path`, framing texts by `convention` (a CONVENTIONS row)."""
    path.mkdir(parents=True, exist_ok=True)
    for file in SHIPPED_TOKENIZER.iterdir():
        shutil.copy2(file, path / file.name)
    change = dict(CONVENTIONS[convention])
    if "post_processor" in change:
        tokenizer = json.loads((path / "tokenizer.json").read_text())
        tokenizer["post_processor"] = change.pop("post_processor")
        (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        ours = change if name == "tokenizer_config.json" else {k: v for k, v in change.items() if k.endswith("_token")}
        config = json.loads((path / name).read_text()) | ours
        (path / name).write_text(json.dumps({k: v for k, v in config.items() if v is not None}, indent=1))
    return path


def save_hf_folder(
    model: nn.Module,
    path: Path,
    *,
    tokenizer: bool = True,
    max_shard_size: str | None = None,
    convention: str = "llama3",
) -> Path:
    """save_pretrained (sharded when max_shard_size is small), plus the shipped tokenizer's files (in `convention`)."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        tokenizer_folder(path, convention)
    return path


def tiny_hf_folder(
    path: Path, *, seed: int = 0, family: str = "llama3", convention: str = "llama3", **config: Any
) -> Path:
    return save_hf_folder(tiny_hf_model(seed=seed, family=family, **config), path, convention=convention)


# ------------------------------------------------------------------ parity helpers


def batch(vocab: int, *, seq: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels), 2 rows of `seq` random ids each."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, seq), generator=gen), torch.randint(0, vocab, (2, seq), generator=gen)


def logits_and_grads(
    model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The logits of `forward(tokens)` and every parameter's gradient of their cross-entropy against labels."""
    logits = forward(tokens)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def total_norm(grads: dict[str, torch.Tensor]) -> float:
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()


def write_config(folder: Path, config: dict) -> Path:
    """A folder holding just this config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def check_transformers_round_trip(model: nn.Module, args: Any, exported: Path, *, hf_class: type, tol: float) -> None:
    """`exported` (to_hf of `model`) loads in transformers as `hf_class` with no weight missing, unexpected or
    mismatched, and gives `model`'s logits within `tol`; that folder and what transformers' save_pretrained writes of
    it read back here (models/hf.py from_hf) as the same args and, bit for bit, the same weights."""
    from transformers import AutoModelForCausalLM

    from models.hf import from_hf

    hf, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True, attn_implementation="eager")
    assert isinstance(hf, hf_class), type(hf)
    assert not any(info.values()), info
    tokens, _ = batch(args.vocab_size)
    with torch.no_grad():
        diff = (hf(tokens).logits - model(tokens)).abs().max().item()
    assert diff <= tol, diff
    resaved = exported.with_name(exported.name + "-resaved")
    hf.save_pretrained(resaved)
    ours = model.state_dict()
    for folder in (exported, resaved):
        back, back_args = from_hf(folder)
        assert back_args == args, folder
        theirs = back.state_dict()
        assert theirs.keys() == ours.keys(), folder
        for name, tensor in ours.items():
            assert torch.equal(theirs[name], tensor), (folder, name)
