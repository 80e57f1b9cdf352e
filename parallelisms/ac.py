"""Activation checkpointing (AC), applied once per transformer block.

Modes (config section [activation_checkpoint]):
    none                        keep every activation
    full                        keep only each block's input; recompute the whole block in backward
    selective, option "op"      recompute the block, but keep the outputs of the expensive ops
                                (half of the matmuls, attention, reduce-scatters): see _SAVE_OPS
    selective, option k         full AC on every k-th block only (1 = full)

Exactly one checkpointing mechanism may be active (docs/failures.md #1): `apply_ac` refuses a
model whose blocks are already checkpointed, by us or by FSDP's `checkpoint_wrapper`.
Checkpointing is non-reentrant by default, which keeps the recomputed-metadata checks that
catch a stateful forward (docs/failures.md #2). `metrics.count_calls` and `metrics.count_ops`
count what the recomputation really runs (tests/test_parallelisms.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# CheckpointWrapper (FSDP1-era `checkpoint_wrapper`) lives in a private torch module (2.13); it is
# imported only to recognise blocks wrapped outside this repo, nothing here creates one.
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

from config import ActivationCheckpoint, selective_ac_every
from errors import ConfigError, warn
from models.llama3 import Transformer

aten = torch.ops.aten

# Ops whose outputs selective op AC keeps: the expensive ones to recompute. Matmuls are special:
# only every other one is kept (see _op_sac_context).
_SAVE_OPS: frozenset[torch._ops.OpOverload] = frozenset(
    {
        aten.mm.default,
        # Attention kernels: CUDA flash, memory-efficient, cuDNN, and the CPU flash kernel that
        # runs on CPU. (The "math" fallback is a composite op: it reaches the policy as bmm /
        # softmax pieces and is recomputed.)
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.higher_order.flex_attention,  # block_causal on CUDA
        # A compiled TP block's reduce-scatter: recomputing it would repeat the communication.
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        # The amax of float8 scaling: cheap to keep, a full reduction to recompute.
        aten.max.default,
    }
)


def apply_ac(model: Transformer, cfg: ActivationCheckpoint) -> None:
    """Checkpoint the transformer blocks of `model` in place, as `cfg` (validated by config.py) says.

    Parameter names, state-dict keys and `isinstance(block, TransformerBlock)` stay as they were:
    the block's class is swapped for a subclass whose forward checkpoints the original one (see
    `checkpoint_module`). Raises ConfigError if a block is already checkpointed.
    """
    if cfg.mode == "none":
        return
    refuse_nested_checkpointing(model)
    every, context_fn = 1, None
    if cfg.mode == "selective" and cfg.selective_ac_option == "op":
        context_fn = _op_sac_context
    elif cfg.mode == "selective":
        every = selective_ac_every(cfg.selective_ac_option)
        assert every is not None, "config.validate checks selective_ac_option"
    if cfg.use_reentrant:
        if context_fn is not None:
            raise ConfigError(
                "activation_checkpoint.use_reentrant: selective op AC works with non-reentrant checkpointing only; "
                "set use_reentrant = false"
            )
        warn(
            "activation_checkpoint.use_reentrant = true: reentrant checkpointing skips the check that recomputed "
            "tensors match the forward ones (docs/failures.md #2) and can silently give wrong gradients"
        )
    # torch.utils.checkpoint's own switches; the recomputed-tensor checks and debug traces exist in
    # non-reentrant checkpointing only.
    options: dict[str, Any] = {"preserve_rng_state": cfg.preserve_rng_state}
    if not cfg.use_reentrant:
        options.update(determinism_check=cfg.determinism_check, debug=cfg.debug)
    # Block i is checkpointed when (i + 1) % k == 0: k = 2 -> blocks 1, 3, 5, ... (torchtitan's choice).
    for i, block in enumerate(model.layers.values()):
        if (i + 1) % every == 0:
            checkpoint_module(
                block, use_reentrant=cfg.use_reentrant, context_fn=context_fn, early_stop=cfg.early_stop, **options
            )


class CheckpointedModule:
    """Mixin put in front of a module's own class by `checkpoint_module`.

    Only `forward` is checkpointed, not `__call__`: module hooks (FSDP's all-gather and reshard
    hooks) stay outside the checkpointed region, so they do not run again during recomputation.
    """

    _ac_options: dict[str, Any]  # torch.utils.checkpoint's keyword arguments
    _ac_early_stop: bool

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = super().forward  # type: ignore[misc]  # the wrapped module class's forward
        if self._ac_early_stop:  # torch's default
            return checkpoint(inner, *args, **self._ac_options, **kwargs)
        # Read when the forward runs, not when backward recomputes.
        with set_checkpoint_early_stop(False):
            return checkpoint(inner, *args, **self._ac_options, **kwargs)


@functools.cache
def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    # One subclass per module class, created on demand; the same trick FSDP2's fully_shard uses.
    return type(f"Checkpointed{cls.__name__}", (CheckpointedModule, cls), {})


def checkpoint_module(
    module: nn.Module,
    *,
    use_reentrant: bool = False,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    early_stop: bool = True,
    **options: Any,
) -> None:
    """Make `module.forward` run under torch.utils.checkpoint, in place, keeping every name.

    context_fn: a selective-AC policy from `create_selective_checkpoint_contexts` (non-reentrant).
    early_stop: stop each recomputation once backward has what it needs. options: the other keyword
    arguments of `torch.utils.checkpoint.checkpoint` (preserve_rng_state, determinism_check, debug).
    """
    assert not isinstance(module, CheckpointedModule), "module is already checkpointed"
    assert not (use_reentrant and context_fn is not None), "context_fn needs non-reentrant checkpointing"
    module.__class__ = _checkpointed_class(type(module))
    module._ac_options = {"use_reentrant": use_reentrant, **options}
    if context_fn is not None:
        module._ac_options["context_fn"] = context_fn
    module._ac_early_stop = early_stop


def refuse_nested_checkpointing(model: nn.Module) -> None:
    """A second checkpoint around the first recomputes each block once more per level (docs/failures.md #1)."""
    for name, module in model.named_modules():
        if isinstance(module, (CheckpointedModule, CheckpointWrapper)):
            raise ConfigError(
                f"activation_checkpoint.mode: {name or 'the model'} ({type(module).__name__}) is already "
                "activation-checkpointed and would be recomputed twice per backward (docs/failures.md #1); pass an "
                "unwrapped model and let parallelize_llama apply activation checkpointing once"
            )


# --------------------------------------------------------------- selective op AC


def _op_sac_context() -> tuple[Any, Any]:
    """Fresh (forward, recompute) contexts for one checkpointed block call."""
    # Matmuls are numbered separately in the forward and in the recompute, so the same ones are
    # saved in both; a block has wq, wk, wv, wo, w1, w3, w2 in that order: wk, wo, w3 are recomputed.
    mm_index = {False: 0, True: 0}

    def policy(ctx: Any, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op == aten.mm.default:
            mm_index[ctx.is_recompute] += 1
            # Recompute every second matmul (torchtitan's policy): about half of the matmul outputs
            # are kept; the recomputed ones (wk, wo, w3) are ~37% of a Llama 3 8B block's matmul FLOPs.
            if mm_index[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
