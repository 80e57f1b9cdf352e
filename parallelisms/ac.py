"""Activation checkpointing (AC), applied once per transformer block, and counters that prove it.

Modes (config section [activation_checkpoint]):
    none                        keep every activation
    full                        keep only each block's input; recompute the whole block in backward
    selective, option "op"      recompute the block, but keep the outputs of the expensive ops
                                (half of the matmuls, attention, reduce-scatters): see _SAVE_OPS
    selective, option k         full AC on every k-th block only (1 = full)

Exactly one checkpointing mechanism may be active (PROBLEMS.md #1): `apply_ac` refuses a model
whose blocks are already checkpointed, by us, by FSDP's `checkpoint_wrapper` or by Hugging Face's
`gradient_checkpointing_enable()`. Checkpointing is non-reentrant by default, which keeps the
recomputed-metadata checks of PROBLEMS.md #2.

How the counters are meant to be used (tests, `make bench`), on an eager (not compiled) model:

    with count_calls(model, Attention) as calls:      # forward calls, recomputations included
        loss = loss_fn(model(tokens)); ...
        with count_ops() as backward_ops:             # aten ops that actually ran in backward
            loss.backward()
    calls["layers.0.attention"]        # 1 without AC, 2 with AC, 3 when nested and either level is reentrant
    backward_ops[torch.ops.aten.mm.default]   # no AC: gradient matmuls only; AC adds the recomputed ones

A block's recomputation calls its submodules again (so forward hooks fire again), but under
selective op AC the saved ops are served from the cache and never reach `count_ops`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from config import ActivationCheckpoint, ConfigError

aten = torch.ops.aten

# Ops whose outputs selective op AC keeps: the expensive ones to recompute. Matmuls are special:
# only every other one is kept (see _op_sac_policy).
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
        # A compiled TP block's reduce-scatter: recomputing it would repeat the communication.
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        # The amax of float8 scaling: cheap to keep, a full reduction to recompute.
        aten.max.default,
    }
)


def transformer_blocks(model: nn.Module) -> nn.ModuleDict | nn.ModuleList:
    """The repeated blocks: `model.layers` (our Transformer) or `model.model.layers` (HF *ForCausalLM)."""
    for owner in (model, getattr(model, "model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
            return layers
    raise TypeError(f"{type(model).__name__} has no transformer blocks at .layers or .model.layers")


def apply_ac(model: nn.Module, cfg: ActivationCheckpoint) -> None:
    """Checkpoint the transformer blocks of `model` in place, as `cfg` says.

    Parameter names, state-dict keys and `isinstance(block, TransformerBlock)` stay as they were:
    the block's class is swapped for a subclass whose forward checkpoints the original one (see
    `checkpoint_module`). Raises ConfigError if the model already checkpoints its blocks.
    """
    if cfg.mode == "none":
        return
    container = transformer_blocks(model)
    _refuse_kv_cache(model)
    _refuse_nested_checkpointing(model)

    every, context_fn = 1, None
    match cfg.mode, cfg.selective_ac_option:
        case "full", _:
            pass
        case "selective", "op":
            context_fn = _op_sac_context
        case "selective", option if option.isdigit() and int(option) >= 1:
            every = int(option)
        case "selective", option:
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option: expected 'op' or a positive integer k, got {option!r}"
            )
        case mode, _:
            raise ConfigError(f"activation_checkpoint.mode: expected 'none', 'full' or 'selective', got {mode!r}")

    if cfg.use_reentrant:
        if context_fn is not None:
            raise ConfigError(
                "activation_checkpoint.use_reentrant: selective op AC works with non-reentrant checkpointing only; "
                "set use_reentrant = false"
            )
        warnings.warn(
            "activation_checkpoint.use_reentrant = true: reentrant checkpointing skips the check that recomputed "
            "tensors match the forward ones (PROBLEMS.md #2) and can silently give wrong gradients",
            stacklevel=2,
        )

    # Block i is checkpointed when (i + 1) % k == 0: k = 2 -> blocks 1, 3, 5, ... (torchtitan's choice).
    blocks = container.values() if isinstance(container, nn.ModuleDict) else container
    for i, block in enumerate(blocks):
        if (i + 1) % every == 0:
            checkpoint_module(block, use_reentrant=cfg.use_reentrant, context_fn=context_fn)


class CheckpointedModule:
    """Mixin put in front of a module's own class by `checkpoint_module`.

    Only `forward` is checkpointed, not `__call__`: module hooks (FSDP's all-gather and reshard
    hooks) stay outside the checkpointed region, so they do not run again during recomputation.
    """

    _ac_use_reentrant: bool
    _ac_context_fn: Callable[[], tuple[Any, Any]] | None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = super().forward  # type: ignore[misc]  # the wrapped module class's forward
        if self._ac_context_fn is None:
            return checkpoint(inner, *args, use_reentrant=self._ac_use_reentrant, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=self._ac_context_fn, **kwargs)


@functools.cache
def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    # One subclass per module class, created on demand; the same trick FSDP2's fully_shard uses.
    return type(f"Checkpointed{cls.__name__}", (CheckpointedModule, cls), {})


def checkpoint_module(
    module: nn.Module,
    *,
    use_reentrant: bool = False,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
) -> None:
    """Make `module.forward` run under torch.utils.checkpoint, in place, keeping every name.

    context_fn: a selective-AC policy from `create_selective_checkpoint_contexts` (non-reentrant).
    """
    assert not isinstance(module, CheckpointedModule), "module is already checkpointed"
    assert not (use_reentrant and context_fn is not None), "context_fn needs non-reentrant checkpointing"
    module.__class__ = _checkpointed_class(type(module))
    module._ac_use_reentrant = use_reentrant
    module._ac_context_fn = context_fn


def _refuse_kv_cache(model: nn.Module) -> None:
    """A training forward must be stateless, or the recomputation sees the state twice (PROBLEMS.md #2)."""
    # A Hugging Face model only switches its KV cache off under its own checkpointing; under ours
    # the recompute would append to the cache again. (Our Transformer has no cache at all.)
    if getattr(getattr(model, "config", None), "use_cache", False) is True:
        raise ConfigError(
            "activation_checkpoint.mode: model.config.use_cache is True, so recomputation would append to the KV "
            "cache a second time (CheckpointError, PROBLEMS.md #2); set model.config.use_cache = False for training"
        )


def _refuse_nested_checkpointing(model: nn.Module) -> None:
    """A second checkpoint around the first recomputes each block once more per level (PROBLEMS.md #1)."""
    # CheckpointWrapper (a private torch module) is imported only to recognise FSDP-era
    # `checkpoint_wrapper(block)` wrapping done outside this repo; nothing here creates one.
    for name, module in model.named_modules():
        where = name or "the model"
        if isinstance(module, (CheckpointedModule, CheckpointWrapper)):
            raise ConfigError(
                f"activation_checkpoint.mode: {where} ({type(module).__name__}) is already activation-checkpointed "
                "and would be recomputed twice per backward (PROBLEMS.md #1); pass an unwrapped model and let "
                "parallelize_llama apply activation checkpointing once"
            )
        # Hugging Face's gradient_checkpointing_enable() sets this flag on the model and its layers.
        if getattr(module, "gradient_checkpointing", False) is True:
            raise ConfigError(
                f"activation_checkpoint.mode: {where} has Hugging Face gradient checkpointing on, so each layer would "
                "be recomputed twice per backward (PROBLEMS.md #1); call model.gradient_checkpointing_disable() and "
                "keep activation_checkpoint.mode as the only checkpointing"
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


# ---------------------------------------------------------------------- counters


@contextlib.contextmanager
def count_calls(root: nn.Module, module_type: type[nn.Module] | tuple[type[nn.Module], ...]) -> Iterator[Counter[str]]:
    """Count forward calls, by name, of each submodule of `root` that is a `module_type`.

    Forward hooks also fire when activation checkpointing recomputes a block, so per step the
    attention count is 1 per block without AC, 2 with AC (full or selective) and 3 when two
    checkpoints are nested and either is reentrant (PROBLEMS.md #1). Eager mode only: inside a compiled
    region the hooks are traced once, not run per call.
    """
    counts: Counter[str] = Counter()
    handles = [
        module.register_forward_hook(functools.partial(_count_hook, counts, name))
        for name, module in root.named_modules()
        if isinstance(module, module_type)
    ]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def _count_hook(counts: Counter[str], name: str, *_: Any) -> None:
    counts[name] += 1


# TorchDispatchMode is the documented way to observe every aten op, but it lives in a private
# module (torch.utils._python_dispatch); this class is its only user in the repo.
class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: Counter[torch._ops.OpOverload]):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_ops() -> Iterator[Counter[torch._ops.OpOverload]]:
    """Count, per aten op overload, the ops that actually run inside the block.

    Wrap `loss.backward()` to see what was recomputed: under selective op AC the saved ops come
    from the cache and are not counted. Ops run inside DTensor's own dispatch (the local
    matmul of a sharded one, its collectives) are not seen; eager mode only.
    """
    counts: Counter[torch._ops.OpOverload] = Counter()
    with _OpCounter(counts):
        yield counts
