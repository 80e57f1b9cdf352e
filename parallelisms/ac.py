"""Activation checkpointing (AC), applied once per transformer block.

Modes (config section [activation_checkpoint]):
    none                        keep every activation
    full                        keep only each block's input; recompute the whole block in backward
    selective, option "op"      recompute the block, but keep the outputs of the expensive ops:
                                attention, TP's and EP's collectives (_SAVE_OPS) and the matmuls of the
                                linears the family names (plans.py SAC_SAVED_LINEARS)
    selective, option k         full AC on every k-th block only (1 = full)
    per_block                   each block its own: "none", "op" or "full" (activation_checkpoint.per_block)
    auto                        per_block, chosen to fit activation_checkpoint.memory_budget_gib with the least
                                recompute (planning/memory.py choose_ac), before apply_ac runs

Exactly one checkpointing mechanism may be active (docs/failures.md #1): `apply_ac` refuses a
model whose blocks are already checkpointed, by us or by FSDP's `checkpoint_wrapper`.
Checkpointing is non-reentrant by default, which keeps the recomputed-metadata checks that
catch a stateful forward (docs/failures.md #2). `tests.instruments.count_calls` and `tests.instruments.count_ops`
count what the recomputation really runs (tests/test_parallelisms.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn

# CheckpointWrapper (FSDP1-era `checkpoint_wrapper`) lives in a private torch module (2.13); it is
# imported only to recognise blocks wrapped outside this repo, nothing here creates one.
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

from config import BlockMode  # what AC does to one block; `block_modes` gives each block's
from errors import ConfigError, warn

if TYPE_CHECKING:
    from config import ActivationCheckpoint

aten = torch.ops.aten


# Ops whose outputs selective op AC keeps whatever the model: what is expensive to recompute.
_SAVE_OPS: frozenset[torch._ops.OpOverload] = frozenset(
    {
        # Attention kernels: CUDA flash, memory-efficient, cuDNN, and the CPU flash kernel that
        # runs on CPU. (The "math" fallback is a composite op: it reaches the policy as bmm /
        # softmax pieces and is recomputed.)
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.higher_order.flex_attention,  # block_causal on CUDA
        # A compiled TP block's reduce-scatter, context parallel's all-gather of keys and values (parallelisms/cp.py):
        # recomputing them would repeat the communication.
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        # A block's all-reduce: a norm's statistic over a TP-split dimension, (bs, seqlen, 1) float32, 4 bytes a token
        # to keep against a collective's latency to send again (tests/test_parallelisms.py counts it per family).
        torch.ops._c10d_functional.all_reduce.default,
        # Expert parallel's exchange of counts and of tokens (parallelisms/ep.py), both ways: recomputing would send
        # the rows again. (The host still reads the kept counts in the recomputation: no communication.)
        torch.ops._c10d_functional.all_to_all_single.default,
        torch.ops._c10d_functional_autograd.all_to_all_single.default,
        # The amax of float8 scaling: cheap to keep, a full reduction to recompute.
        aten.max.default,
    }
)
_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
# An FSDP unit inside a checkpointed block (expert parallel's experts, parallelisms/fsdp.py) marks its hooks with
# record_function, and its hooks do not run the same times in the recomputation as in forward (it gathers, prefetches
# and casts its inputs differently in backward): op SAC, which counts every op of the block to match recomputed ops
# with saved ones, refuses the block ("invocation index 3 ... not found in storage"). The marks compute nothing, and
# PyTorch's selective checkpointing lets ops of that kind through unmatched: detach, which AC itself adds
# (torch.utils.checkpoint.SAC_IGNORED_OPS, a module-level set of PyTorch 2.13); the profiler's marks join them.
torch.utils.checkpoint.SAC_IGNORED_OPS |= {
    torch.ops.profiler._record_function_enter.default,
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}
# The matmul of a linear layer (plain, with bias, float8); kept when the linear is one the family names.
_MATMUL_OPS: frozenset[torch._ops.OpOverload] = frozenset(
    {aten.mm.default, aten.addmm.default, aten._scaled_mm.default}
)


def apply_ac(
    model: nn.Module,
    cfg: ActivationCheckpoint,
    *,
    saved_linears: tuple[str, ...] = (),
    recompute_gathers_of: str | None = None,
) -> None:
    """Checkpoint the transformer blocks of `model` in place, as `cfg` (validated by config/sections.py) says:
    each block as `block_modes` gives it (mode "auto" is resolved into "per_block" before, planning/memory.py).

    saved_linears: for selective op AC, the linears (names inside a block) whose matmul outputs are
    kept (the family's plans.py SAC_SAVED_LINEARS); every other matmul is recomputed.
    recompute_gathers_of: a process group's name (the TP group under async TP) whose all-gathers op SAC recomputes
    instead of keeping. A kept all-gather output has a second user, so inductor's micro-pipeline pass cannot fuse
    it with its matmul; recomputed, it is gathered again in backward, fused there too (benchmarks/async_tp_fusion.py
    counts both). Plain TP keeps it: a gather saved is one not sent twice.
    Parameter names, state-dict keys and `isinstance(block, <its class>)` stay as they were:
    the block's class is swapped for a subclass whose forward checkpoints the original one (see
    `checkpoint_module`). Raises ConfigError if a block is already checkpointed.
    """
    modes = block_modes(cfg, [int(key) for key in model.layers])
    if all(mode == "none" for mode in modes):
        return
    refuse_nested_checkpointing(model)
    if cfg.use_reentrant:
        if "op" in modes:
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
    for block, mode in zip(model.layers.values(), modes, strict=True):
        if mode != "none":
            context_fn = _op_sac_context(block, saved_linears, recompute_gathers_of) if mode == "op" else None
            checkpoint_module(
                block, use_reentrant=cfg.use_reentrant, context_fn=context_fn, early_stop=cfg.early_stop, **options
            )


def block_modes(cfg: ActivationCheckpoint, layers: list[int]) -> list[BlockMode]:
    """What `apply_ac` does to each block of a model or pipeline stage, given its blocks' indices in the whole model
    in order: "none" (keeps every activation), "op" (selective op AC) or "full". The one rule, which the memory
    estimate, the dry run and mode "auto"'s choice (planning/) read too."""
    n = len(layers)
    match cfg.mode:
        case "none":
            return ["none"] * n
        case "full":
            return ["full"] * n
        case "selective" if cfg.selective_ac_option == "op":
            return ["op"] * n
        case "selective":
            # Block i (its position in the model or stage) when (i + 1) % k == 0: k = 2 -> 1, 3, 5, ... (torchtitan's).
            every = cfg.selective_every
            assert every is not None, "config.validate checks selective_ac_option"
            return ["full" if (i + 1) % every == 0 else "none" for i in range(n)]
        case "per_block":
            if (need := max(layers, default=-1) + 1) > len(cfg.per_block):
                raise ConfigError(
                    f"activation_checkpoint.per_block: {len(cfg.per_block)} entries for a model of at least {need} "
                    "blocks; give one per block"
                )
            return [cfg.per_block[layer] for layer in layers]
    raise ValueError(
        f'activation_checkpoint.mode = "{cfg.mode}" is chosen per block before apply_ac (planning/memory.py)'
    )


class CheckpointedModule:
    """Mixin put in front of a module's own class by `checkpoint_module`.

    Only `forward` is checkpointed, not `__call__`: module hooks (FSDP's all-gather and reshard
    hooks) stay outside the checkpointed region, so they do not run again during recomputation.
    """

    _ac_options: dict[str, Any]  # torch.utils.checkpoint's keyword arguments
    _ac_early_stop: bool
    _ac_compiled_forward: Callable[..., Any] | None = None  # set by `compile` under full checkpointing of a TP block

    def compile(self, **compile_options: Any) -> None:
        """`Module.compile` for a checkpointed block: compiled whole, checkpoint included, so that the recomputation is
        traced into the backward graph (a selective policy must be traced with the ops it tags; full AC then fuses its
        recomputation with the backward's kernels, one graph, as torchtitan compiles it). One exception: full
        checkpointing around a tensor-parallel block (DTensor parameters) compiles the wrapped forward alone and keeps
        the checkpoint eager around it (the forward and its recomputation both run the compiled graph): PyTorch 2.13
        cannot compile that checkpoint (AOT autograd saves the block's DeviceMesh for the recomputation and fails at
        the first step: "expected all tensors_saved_with_vc_check to be Tensors"; torchtitan 0.2.2 fails the same
        way; tests/parity_worker.py's tp2_compile_full_ac)."""
        tensor_parallel = any(isinstance(p, DTensor) for p in self.parameters())  # type: ignore[attr-defined]
        if "context_fn" in self._ac_options or not tensor_parallel:
            super().compile(**compile_options)  # type: ignore[misc]
        else:
            self._ac_compiled_forward = torch.compile(super().forward, **compile_options)  # type: ignore[misc]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._ac_compiled_forward or super().forward  # type: ignore[misc]  # the wrapped class's forward
        # Compiled whole, the recomputation is part of the backward graph, which computes only what backward needs:
        # early stop or not, the same graph (and dynamo refuses to trace set_checkpoint_early_stop).
        if self._ac_early_stop or torch.compiler.is_compiling():  # torch's default
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
                "unwrapped model and let parallelize_model apply activation checkpointing once"
            )


# --------------------------------------------------------------- selective op AC


class _LinearScope:
    """Which of a block's named linears is running: the selective-AC policy sees ops, not modules. A module a named
    linear holds (LoRA's adapters, lora.py) is not the linear: its matmuls are recomputed (an adapter's are r wide,
    and keeping lora_B's full-width output would cost what keeping the linear's costs again).

    Eager: forward pre/post hooks on the linears (they also fire when the block is recomputed).
    Compiled: the hooks are skipped (torch.compiler.is_compiling(): no side effect in the graph), and the
    policy, which runs while AOT autograd traces the block, reads the module stack dynamo recorded for the
    op's graph node (torch.fx.traceback's node meta; its keys are id() of the modules in PyTorch 2.13, a
    private layout used only here, and checked by tests/test_parallelisms.py's compiled op-SAC count).
    """

    def __init__(self, block: nn.Module, names: tuple[str, ...]):
        modules = dict(block.named_modules())
        if missing := [name for name in names if name not in modules]:
            raise ValueError(f"SAC_SAVED_LINEARS names {missing}, which {type(block).__name__} does not have")
        self.ids = {str(id(modules[name])) for name in names}
        held = [m for name in names for m in modules[name].modules() if m is not modules[name]]
        self.held_ids = {str(id(m)) for m in held}
        self.active = self.held = 0
        for m, counter in [*((modules[name], "active") for name in names), *((m, "held") for m in held)]:
            m.register_forward_pre_hook(functools.partial(self._count, counter, 1))
            m.register_forward_hook(functools.partial(self._count, counter, -1))

    def _count(self, counter: str, step: int, *_: Any) -> None:
        if not torch.compiler.is_compiling():
            setattr(self, counter, getattr(self, counter) + step)

    def inside(self) -> bool:
        if self.active:
            return not self.held
        stack = (fx_traceback.get_current_meta() or {}).get("nn_module_stack") or ()
        return bool(self.ids.intersection(stack)) and not self.held_ids.intersection(stack)


def _op_sac_context(
    block: nn.Module, saved_linears: tuple[str, ...], recompute_gathers_of: str | None = None
) -> Callable[[], tuple[Any, Any]]:
    """A context_fn for one block: fresh (forward, recompute) contexts per checkpointed call, keeping the
    outputs of _SAVE_OPS (but the all-gathers of group `recompute_gathers_of`) and of the matmuls of
    `saved_linears`, recomputing the rest."""
    scope = _LinearScope(block, saved_linears)

    def policy(ctx: Any, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is _ALL_GATHER and args[2] == recompute_gathers_of:  # (input, group size, group name)
            return CheckpointPolicy.PREFER_RECOMPUTE
        if op in _SAVE_OPS or (op in _MATMUL_OPS and scope.inside()):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)
