"""The transformers LlamaForCausalLM of docs/failures.md #1 and #2, and the guards it needs under AC.

Both failures happened to people who checkpointed a transformers model from outside (llama-recipes,
Lightning): HF's own gradient checkpointing left on under a second, per-layer checkpoint (#1), and
HF's KV cache, on by default, filled again by the recomputation (#2). The recipe trains its own
Transformer (models/llama3), which has neither, so parallelisms/ac.py guards against neither; this
module builds such a model (small, fp32, in code, no download), switches on what those users
switched on, and `apply_ac_hf` refuses both before checkpointing each layer once. Only benchmarks/
imports transformers for this; benchmarks/recompute.py and benchmarks/metadata.py use it.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from errors import ConfigError
from parallelisms.ac import checkpoint_module, refuse_nested_checkpointing


@dataclass(frozen=True)
class HFShape:
    """A small Llama (GQA, SwiGLU) in transformers' config names, and the batch it trains on."""

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 768
    vocab_size: int = 2048
    seq_len: int = 256
    batch_size: int = 4


# What the tests use: the same structure, small enough for many steps in seconds.
TINY = HFShape(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=192,
    vocab_size=512,
    seq_len=32,
    batch_size=2,
)


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The command-line options that pick the HFShape of a benchmark (see `shape_from_args`)."""
    p.add_argument("--seq-len", type=int, default=HFShape.seq_len)
    p.add_argument("--batch-size", type=int, default=HFShape.batch_size)
    p.add_argument("--tiny", action="store_true", help="the tests' tiny model instead (ignores the two above)")


def shape_from_args(args: argparse.Namespace) -> HFShape:
    return TINY if args.tiny else HFShape(seq_len=args.seq_len, batch_size=args.batch_size)


def build_hf_llama(
    shape: HFShape, *, use_cache: bool = False, attn_implementation: str = "sdpa", seed: int = 0
) -> LlamaForCausalLM:
    """An fp32 LlamaForCausalLM in training mode with transformers' own init, the same weights for a seed."""
    cfg = LlamaConfig(
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        max_position_embeddings=max(shape.seq_len, 256),
        use_cache=use_cache,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float().train()


def random_batch(shape: HFShape, *, seed: int = 1) -> torch.Tensor:
    """Token ids, (batch_size, seq_len); the model's labels are the same ids (HF shifts them)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape.vocab_size, (shape.batch_size, shape.seq_len), generator=gen)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers logs one warning per setting it overrides; the benchmarks report them themselves."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)


# ------------------------------------------------------------- what the reports ran


def enable_hf_gradient_checkpointing(model: LlamaForCausalLM, *, use_reentrant: bool) -> None:
    """HF's own per-layer checkpointing, called the way transformers 4.x users did."""
    with warnings.catch_warnings():
        # transformers 5 renamed it activation_checkpointing_enable; the old name still works
        # and is the one 4.x scripts (llama-recipes) call.
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


def wrap_layers_fsdp1_style(model: LlamaForCausalLM, *, reentrant: bool) -> None:
    """Replace each decoder layer by torch's checkpoint_wrapper, as FSDP1-era recipes did.

    checkpoint_wrapper lives in a private torch module (torch.distributed.algorithms._checkpoint,
    2.13); it is used here only to reproduce what llama-recipes and Lightning users ran. Unlike
    `checkpoint_module(..., use_reentrant=True)` it also works reentrant on HF layers: it packs
    keyword arguments into positional ones, which reentrant checkpointing requires.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, checkpoint_impl=impl)


# ------------------------------------------------------------------------- the fix


def apply_ac_hf(model: LlamaForCausalLM) -> None:
    """Full activation checkpointing of each decoder layer, once, after the guards of #1 and #2.

    Non-reentrant `checkpoint_module`, as parallelisms/ac.py applies to our Transformer. Raises a
    one-line ConfigError when HF's checkpointing is on, when `config.use_cache` is True, or when a
    layer is already checkpointed (`refuse_nested_checkpointing`).
    """
    refuse_hf_gradient_checkpointing(model)
    refuse_kv_cache(model)
    refuse_nested_checkpointing(model)
    for layer in model.model.layers:
        checkpoint_module(layer)


def refuse_hf_gradient_checkpointing(model: nn.Module) -> None:
    """HF's checkpoint inside ours recomputes each layer once more per backward (docs/failures.md #1)."""
    for name, module in model.named_modules():
        # gradient_checkpointing_enable() sets this flag on the model and on each decoder layer.
        if getattr(module, "gradient_checkpointing", False) is True:
            raise ConfigError(
                f"{name or 'the model'} has Hugging Face gradient checkpointing on, so each layer would be "
                "recomputed twice per backward (docs/failures.md #1); call model.gradient_checkpointing_disable() "
                "and let apply_ac_hf checkpoint each layer once"
            )


def refuse_kv_cache(model: LlamaForCausalLM) -> None:
    """A training forward must be stateless, or the recomputation sees the state twice (docs/failures.md #2)."""
    # transformers turns its KV cache off in training only under its own checkpointing (4.x:
    # LlamaModel.forward; 5.x: GradientCheckpointingLayer); under ours the recomputation would
    # append to the cache again.
    if model.config.use_cache is True:
        raise ConfigError(
            "model.config.use_cache is True, so the recomputation would append to the KV cache a second time "
            "(CheckpointError, docs/failures.md #2); set model.config.use_cache = False for training"
        )


def refusal(build: Callable[[], None]) -> str | None:
    """The ConfigError message a guard raises inside `build`, or None when everything is accepted."""
    try:
        build()
    except ConfigError as e:
        return str(e)
    return None


# ------------------------------------------------------------------ comparing gradients


def param_name(name: str) -> str:
    """Parameter names without checkpoint_wrapper's extra level, so that setups can be compared."""
    return name.replace("._checkpoint_wrapped_module", "")


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (zeros where backward left none), by unwrapped name."""
    return {
        param_name(n): (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k] - b[k]).abs().max().item() for k in a)


def rel_norm_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """||got - ref|| / ||ref|| over all gradients flattened into one vector."""
    num = sum((got[k] - ref[k]).pow(2).sum() for k in ref)
    den = sum(ref[k].pow(2).sum() for k in ref)
    return (num / den).sqrt().item()
