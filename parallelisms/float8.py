"""float8 linear training through torchao: `[model] converters = ["quantize.linear.float8"]`.

Each converted nn.Linear becomes a torchao `Float8Linear`: its weight stays a high-precision
(fp32 master, bf16 under FSDP's param_dtype) parameter, and every forward casts the weight, the
input and, in backward, the output gradient to float8 with a dynamic scale, so the three matmuls
of a linear run on float8 tensor cores (H100/H200: twice bf16's dense peak). Checkpoints are
unchanged: the state dict holds the same high-precision weights under the same names, so a
float8 run resumes as bf16 and back (tests/test_float8.py).

Recipes ([quantize.linear.float8] recipe_name, torchao's names):
  tensorwise (default)  one scale per tensor; the fastest; allows the float8 FSDP all-gather and
                        the float8 TP plan below.
  rowwise               one scale per row: more accurate with outliers, slower (~1.1x vs ~1.25x
                        over bf16 in torchao's 8B numbers).
  rowwise_with_gw_hp    rowwise, but the weight gradient's matmul in high precision.

What this file does, and where it sits in parallelize_model (first: every later step must see the
final modules; the TP plan, compile and FSDP all read them):
  * converts the linears of the blocks; a linear whose dims are not multiples of 16 (what float8
    matmuls need) or whose name contains one of `filter_fqns` (default: the output projection,
    whose precision the loss is most sensitive to) stays nn.Linear;
  * tensorwise under TP on NCCL: `adapt_tp_plan` swaps the block's TP styles for torchao's float8
    ones, so the sequence-parallel all-gather of a linear's input moves float8 bytes (half of bf16);
    gloo has no float8 dtype, so on CPU the plain TP plan runs the float8 linears;
  * tensorwise under FSDP with enable_fsdp_float8_all_gather: FSDP all-gathers the weights in
    float8 (half the bytes of bf16), and with precompute_float8_dynamic_scale_for_fsdp the scales
    of all weights are computed in one fused step after each optimizer step
    (`precompute_scales_after_each_step`) instead of one reduction per weight per forward.
float8 needs compute capability 8.9+ (H100, H200, L4, RTX 4090); elsewhere it is refused in one
line, except with `emulate = true`, which runs the same casts with high-precision matmuls (the
tests, on CPU). parallelize_model puts the recipe in the inductor cache key (docs/failures.md #4).

To remove float8 from a fork: docs/development.md's "Removing a part" (this file, its calls in parallelisms/parallelize.py
and train.py, the dry run's count of the float8 all-gather, the tests' float8 layouts).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from errors import ConfigError, warn

if TYPE_CHECKING:
    from config import QuantizeLinearFloat8

TORCHAO_PIN = "torchao==0.18.0"  # pyproject.toml's pin


def float8_problems(cfg: QuantizeLinearFloat8, *, device: torch.device) -> list[str]:
    """Why float8 cannot run here; empty when it can."""
    if cfg.emulate:
        return []
    if device.type != "cuda":
        return [f"float8 matmuls need a CUDA GPU of compute capability 8.9 or more, and this runs on {device.type}"]
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return [f"float8 matmuls need compute capability 8.9 or more (H100, H200, L4), and {name} has {major}.{minor}"]
    return []


def _import_torchao() -> Any:
    # torchao logs a warning for each CUDA extension it cannot load (all of them on a CPU build).
    logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ConfigError(
            f"model.converters: quantize.linear.float8 needs torchao, which does not import ({e}); "
            f"pip install {TORCHAO_PIN}"
        ) from None
    return float8


def is_tensorwise(cfg: QuantizeLinearFloat8) -> bool:
    return cfg.recipe_name in (None, "tensorwise")


def converts(module: nn.Module, fqn: str, cfg: QuantizeLinearFloat8) -> bool:
    """Whether apply_float8 makes this module float8: a linear outside filter_fqns whose dims are multiples of 16."""
    if not isinstance(module, nn.Linear) or any(name in fqn for name in cfg.filter_fqns):
        return False
    return module.out_features % 16 == 0 and module.in_features % 16 == 0


def gathers_float8(cfg: QuantizeLinearFloat8, *, fsdp_sharded: bool) -> bool:
    """Whether FSDP all-gathers the float8 linears' weights in float8 (tensorwise scales only)."""
    return is_tensorwise(cfg) and cfg.enable_fsdp_float8_all_gather and fsdp_sharded


def apply_float8(model: nn.Module, cfg: QuantizeLinearFloat8, *, device: torch.device, fsdp_sharded: bool) -> list[str]:
    """Swap the model's eligible nn.Linear for torchao Float8Linear, in place; returns their names.

    fsdp_sharded: FSDP shards the parameters (dp_shard > 1), where the float8 all-gather applies.
    """
    if problems := float8_problems(cfg, device=device):
        raise ConfigError(
            f"model.converters: {problems[0]}; remove quantize.linear.float8 (or set "
            "quantize.linear.float8.emulate = true to test it in high precision)"
        )
    float8 = _import_torchao()
    if is_tensorwise(cfg):
        config = float8.Float8LinearConfig(
            enable_fsdp_float8_all_gather=gathers_float8(cfg, fsdp_sharded=fsdp_sharded), emulate=cfg.emulate
        )
    else:
        config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(cfg.recipe_name), emulate=cfg.emulate)
        if cfg.recipe_name == "rowwise":
            # torchao's advice for rowwise under inductor (pytorch/pytorch#150859), as torchtitan does.
            torch._inductor.config.emulate_precision_casts = True

    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: converts(m, fqn, cfg))
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]


def float8_tp_supported(cfg: QuantizeLinearFloat8, tp_mesh: DeviceMesh) -> bool:
    """Whether TP can use torchao's float8 styles (adapt_tp_plan): tensorwise scales, and a TP group that can move
    float8 tensors (NCCL; gloo has no float8 dtype, so on CPU the plain plan runs the float8 linears, with a warning)."""
    if not is_tensorwise(cfg):
        return False
    if "nccl" not in dist.get_backend(tp_mesh.get_group()):
        warn("quantize.linear.float8: TP's collectives move high-precision activations here (float8 ones need NCCL)")
        return False
    return True


def adapt_tp_plan(block: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The block's TP plan with torchao's float8 styles where they apply (tensorwise Float8Linear):
    colwise/rowwise linears cast before their collectives, and a module whose linears are all
    float8 all-gathers its input in float8 once for all of them."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    def tensorwise(fqn: str) -> bool:
        module = block.get_submodule(fqn)
        return (
            isinstance(module, Float8Linear)
            and module.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE
        )

    # Each float8 style is given every argument of the style it replaces: a plan's layouts and local outputs hold.
    adapted: dict[str, ParallelStyle] = {}
    for fqn, style in plan.items():
        if isinstance(style, ColwiseParallel | RowwiseParallel) and tensorwise(fqn):
            float8 = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
            adapted[fqn] = float8(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
        elif isinstance(style, PrepareModuleInput) and _all_float8(block.get_submodule(fqn), tensorwise, fqn):
            adapted[fqn] = PrepareFloat8ModuleInput(
                input_layouts=style.input_layouts,
                desired_input_layouts=style.desired_input_layouts,
                input_kwarg_layouts=style.input_kwarg_layouts,
                desired_input_kwarg_layouts=style.desired_input_kwarg_layouts,
                use_local_output=style.use_local_output,
            )
        else:
            adapted[fqn] = style
    return adapted


def _all_float8(module: nn.Module, tensorwise: Any, prefix: str) -> bool:
    linears = [f"{prefix}.{name}" for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    return bool(linears) and all(tensorwise(fqn) for fqn in linears)


def precompute_scales_after_each_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """After every optimizer step, compute the float8 scales of all FSDP-sharded float8 weights at once
    (precompute_float8_dynamic_scale_for_fsdp); the next forward's all-gathers use them. Nothing to do
    where apply_float8 left the float8 all-gather off (rowwise, or no FSDP sharding)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_linear import Float8Linear

    if any(isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather for m in model.modules()):
        optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
