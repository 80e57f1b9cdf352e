"""parallelize_model: where the parallelisms are applied to a model, in a fixed order."""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from config import float8_settings
from lora import apply_lora
from models import family
from parallelisms.ac import apply_ac
from parallelisms.async_tp import apply_async_tp
from parallelisms.compile import apply_compile, inductor_cache_dir
from parallelisms.cp import apply_cp, context_parallel
from parallelisms.ep import apply_ep
from parallelisms.float8 import adapt_tp_plan, apply_float8, float8_tp_supported
from parallelisms.fsdp import DTYPES, applies_fsdp, apply_fsdp
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pp import Pipeline, pipeline_model
from parallelisms.tp import apply_tp

if TYPE_CHECKING:
    from config import JobConfig
    from loss import Loss


def parallelize_model(
    model: nn.Module,
    cfg: JobConfig,
    *,
    dims: ParallelDims,
    mesh: DeviceMesh,
    device: torch.device,
) -> nn.Module:
    """Apply, in order, float8 -> TP -> EP -> LoRA (+ async TP) -> CP -> activation checkpointing -> compile -> FSDP to a (meta) model,
    as the run's config asks: [training], [parallelism], [activation_checkpoint], [compile] and the float8 linears.

    The order is not a matter of taste:
      0. float8 first (when [model] converters has "quantize.linear.float8"): it swaps modules (nn.Linear ->
         torchao Float8Linear), and the TP plan, compile and FSDP must all see the final modules: the float8 TP
         styles apply to Float8Linear only, compile traces their casts, FSDP's float8 all-gather hooks into their
         weights.
      1. TP: it replaces parameters by DTensors sharded over "tp" and installs the input/output redistributions;
         every later step must see those final parameters. Async TP only sets the compiler passes that overlap TP's
         collectives: on before compile.
      1a. EP splits each block's experts over the "ep" ranks (parallelisms/ep.py), once TP has given each rank its own
         tokens at the MoE, before FSDP shards each rank's experts over the ranks left.
      1b. LoRA's adapters (lora.py) join the final linears, placed by PEFT's rule for TP's parallel layers.
      1c. CP wraps each attention core (parallelisms/cp.py) before AC and compile see the block, so its all-gather
         of keys and values is part of the checkpointed and compiled region.
      2. AC before compile: compile then traces the checkpointed block, so the recomputation (and selective AC's
         save/recompute choices) is part of the compiled graph.
      3. Compile per block before FSDP: each block's forward becomes one graph (shared by all
         blocks); FSDP's all-gather and reshard hooks, added next on the same modules, run
         eagerly around it at the block boundary instead of breaking the graph (checked on
         2.13: one graph, no graph breaks, fullgraph=True).
      4. FSDP last: it turns modules into FSDP units and shards over the data-parallel mesh
         whatever the steps before produced (TP DTensors become 2-D (dp_shard, tp) DTensors).
         A job of one rank is not sharded; with bf16 parameters the caller runs its forward under autocast
         (parallelisms/fsdp.py autocast_dtype says which, and why).
    What is particular to the model comes from its family (model.name): how TP splits a block (plans.py tp_plan)
    and which linears selective op AC keeps (plans.py SAC_SAVED_LINEARS).
    Under loss parallel (TP on, parallelism.disable_loss_parallel false) the logits are a
    vocabulary-sharded DTensor: compute the loss AND call backward inside
    `parallelisms.tp.loss_parallel_context(True)`.

    device: where the model will train (float8 refuses a device without float8 matmuls).
    """
    fam, training, parallelism = family(cfg.model.name), cfg.training, cfg.parallelism
    ac, compile = cfg.activation_checkpoint, cfg.compile
    float8 = float8_settings(cfg)  # None without the converter
    if float8 is not None:
        apply_float8(model, float8, device=device, fsdp_sharded=dims.dp_shard > 1)
    if dims.tp_enabled:
        float8_styles = float8 is not None and float8_tp_supported(float8, mesh["tp"])
        if cfg.lora.enable:  # the adapters read a linear's input in the compute dtype, not float8's cast of it
            float8_styles = False
        apply_tp(
            model, mesh["tp"], block_plan=fam.tp_plan, loss_parallel=not parallelism.disable_loss_parallel,
            seq_len=training.seq_len, adapt_block_plan=adapt_tp_plan if float8_styles else None,
        )  # fmt: skip
    experts = None  # (name inside a block, the mesh FSDP shards them over) under expert parallel
    if dims.ep_enabled:
        ep_mesh, experts_fsdp_mesh = dims.expert_meshes(mesh)
        apply_ep(model, ep_mesh, experts=fam.experts_module)
        experts = (fam.experts_module, experts_fsdp_mesh)
    if cfg.lora.enable:  # adapters on the final linears, the rest frozen (lora.py)
        apply_lora(model, cfg.lora, fam, base_dtype=DTYPES[training.mixed_precision_param])
    if parallelism.enable_async_tensor_parallel:
        apply_async_tp(mesh["tp"], compile_enabled=compile.enable and "model" in compile.components)
    if (cp := context_parallel(mesh, parallelism)) is not None:
        apply_cp(model, cp)

    # Under async TP, op SAC gathers TP's activations again in backward rather than keeping them (parallelisms/ac.py).
    apply_ac(
        model,
        ac,
        saved_linears=fam.sac_saved_linears,
        recompute_gathers_of=mesh["tp"].get_group().group_name if parallelism.enable_async_tensor_parallel else None,
    )

    if compile.enable and "model" in compile.components:
        # Every setting that changes the generated code; docs/failures.md #4.
        recipe = {
            "tp_degree": dims.tp,
            "async_tp": parallelism.enable_async_tensor_parallel,
            "ac_mode": ac.mode,
            # The option only means something for selective AC; full AC with a stale option is the same recipe.
            "ac_option": ac.selective_ac_option if ac.mode == "selective" else "",
            "float8": (float8.recipe_name or "tensorwise") if float8 is not None else "",
        }
        apply_compile(model, backend=compile.backend, cache_dir=inductor_cache_dir(recipe))

    if applies_fsdp(dims, param_dtype=training.mixed_precision_param, cpu_offload=training.enable_cpu_offload):
        apply_fsdp(
            model,
            dims.fsdp_mesh(mesh),
            param_dtype=DTYPES[training.mixed_precision_param],
            reduce_dtype=DTYPES[training.mixed_precision_reduce],
            cpu_offload=training.enable_cpu_offload,
            reshard_after_forward=parallelism.fsdp_reshard_after_forward,
            pp_enabled=dims.pp_enabled,
            experts=experts,
        )
    return model


def build_model(
    cfg: JobConfig,
    args: Any,
    *,
    dims: ParallelDims,
    mesh: DeviceMesh,
    loss_fn: Loss,
    device: torch.device,
) -> tuple[torch.nn.Module, Pipeline | None]:
    """The model of cfg's family and shape `args` (config.run_model_args, which the caller also needs) on the meta
    device, parallelized as cfg asks (parallelize_model): shapes and shardings, no storage yet (`init_model`).
    train.py and the dry run both build this way, so what the dry run plans is what trains (the dry run with async TP
    left off, after checking it against the machine it plans for).

    With pipeline parallel this rank holds some stages, each parallelized on its own; the module returned
    is then those stages as one (the whole model's parameter names), and the Pipeline runs them."""
    with torch.device("meta"):
        model = family(cfg.model.name).model_cls(args)
    parallelize = functools.partial(parallelize_model, cfg=cfg, dims=dims, mesh=mesh, device=device)
    if not dims.pp_enabled:
        return parallelize(model), None
    pipeline = pipeline_model(
        model,
        mesh=mesh,
        cfg=cfg.parallelism,
        local_batch_size=cfg.training.local_batch_size,
        loss_fn=loss_fn,
        score_fn=loss_fn.cross_entropy_only(),
        parallelize=parallelize,
        device=device,
    )
    return pipeline.module, pipeline


def init_model(model: torch.nn.Module, pipeline: Pipeline | None, *, device: torch.device) -> None:
    """Allocate the (meta) parameters on `device` and initialize them, stage by stage under pipeline parallel."""
    for part in pipeline.parts if pipeline else [model]:
        part.to_empty(device=device)
        with warnings.catch_warnings():
            # On a CPU mesh DTensor's RNG cannot make sharded init match unsharded init; runs
            # that must start from identical weights load a seed checkpoint (initial_load_path).
            warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
            part.init_weights(buffer_device=device)
    model.train()
