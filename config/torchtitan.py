"""torchtitan v0.2.2's keys that this recipe accepts only so that torchtitan's TOMLs load unchanged.

config/sections.py's sections inherit the keys below (`class Training(TorchtitanTraining)`), so the TOML names
stay torchtitan's, section for section; whole sections of torchtitan's that this recipe never reads are
here too. Each key is one of two kinds, and its docstring says which:

  * refused unless default (`unsupported`): any other value asks for something this recipe does not do,
    and loading the config says so in one line (`refusal`);
  * ignored: any value is accepted and changes nothing (an MoE or fault-tolerance setting with nothing
    here to act on).

`{model}` in an `unsupported` text stands for the configured model family (model.name).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


def unsupported(what: str, default: Any) -> Any:
    """A torchtitan key this recipe takes at its default only; any other value asks for `what` and is refused."""
    kind = "default_factory" if isinstance(default, list) else "default"
    value = (lambda: list(default)) if isinstance(default, list) else default
    return field(**{kind: value}, metadata={"unsupported": what})


def refusal(key: str, f: dataclasses.Field, value: Any, default: Any, *, model: str) -> str | None:
    """The problem of an `unsupported` key set to `value` instead of its default, None for any other key."""
    if "unsupported" not in f.metadata or value == default:
        return None
    return (
        f"{key}: {value!r} asks for {f.metadata['unsupported'].format(model=model)}, which this recipe does not do; "
        f"remove the key or set it to {default!r}"
    )


# torchtitan's converters other than quantize.linear.float8, refused by name (model.converters).
OTHER_CONVERTERS = {
    "quantize.linear.mx": "MX (microscaling) linears, a Blackwell format",
    "quantize.grouped_mm.float8": "float8 grouped GEMMs for MoE experts",
    "quantize.grouped_mm.mx": "MX grouped GEMMs for MoE experts",
}

# torchtitan's names of earlier releases, and where the key lives now (here and in torchtitan v0.2.2).
MOVED = {
    "training.seed": "debug.seed",
    "training.deterministic": "debug.deterministic",
    "training.batch_size": "training.local_batch_size",
    "training.compile": "compile.enable",
    "training.data_parallel_replicate_degree": "parallelism.data_parallel_replicate_degree",
    "training.data_parallel_shard_degree": "parallelism.data_parallel_shard_degree",
    "training.tensor_parallel_degree": "parallelism.tensor_parallel_degree",
    "training.disable_loss_parallel": "parallelism.disable_loss_parallel",
    "training.fsdp_reshard_after_forward": "parallelism.fsdp_reshard_after_forward",
    "experimental.enable_async_tensor_parallel": "parallelism.enable_async_tensor_parallel",
    "experimental.pipeline_parallel_degree": "parallelism.pipeline_parallel_degree",
    "experimental.pipeline_parallel_schedule": "parallelism.pipeline_parallel_schedule",
    "experimental.pipeline_parallel_microbatches": "parallelism.pipeline_parallel_microbatch_size",
    "experimental.context_parallel_degree": "parallelism.context_parallel_degree",
    "checkpoint.model_weights_only": "checkpoint.last_save_model_only",
    "model.norm_type": None,  # torchtitan <= 0.1: the norm is the model's own (RMSNorm) here
}


# ------------------------------------------------- keys of sections this recipe has


@dataclass
class TorchtitanJob:
    custom_config_module: str = unsupported("a custom config module", "")
    """torchtitan's extension point; refused unless empty."""


@dataclass
class DataLoader:
    """torchtitan's [training.dataloader] / [validation.dataloader]: this recipe reads memory-mapped shards in the
    training process, with no loader workers."""

    num_workers: int = unsupported("worker processes for data loading (windows are memory-map slices)", 0)
    """Loader processes; refused unless 0."""
    persistent_workers: bool = unsupported("persistent data-loading workers", False)
    """torchtitan's DataLoader option; refused unless false (no workers here)."""
    pin_memory: bool = unsupported("pinned data-loading buffers", False)
    """torchtitan's DataLoader option; refused unless false."""
    prefetch_factor: int | None = unsupported("data prefetching by workers", None)
    """torchtitan's DataLoader option; refused unless unset."""


@dataclass
class TorchtitanTraining:
    dtype: Literal["float32", "bfloat16"] = unsupported("pure bfloat16 training (no float32 master weights)", "float32")
    """Dtype of parameters and optimizer state; refused unless float32 (training.mixed_precision_param sets the compute dtype)."""
    gc_debug: bool = unsupported("garbage-collector debugging", False)
    """torchtitan's gc debugging; refused unless false."""
    dataloader: DataLoader = field(default_factory=DataLoader)


@dataclass
class TorchtitanValidation:
    dataloader: DataLoader = field(default_factory=DataLoader)


@dataclass
class TorchtitanOptimizer:
    early_step_in_backward: bool = unsupported("optimizer steps inside backward", False)
    """torchtitan's memory optimization; refused unless false."""


@dataclass
class TorchtitanParallelism:
    pipeline_parallel_schedule_csv: str | None = unsupported("a pipeline schedule from a CSV file", "")
    """torchtitan's custom pipeline schedule; refused unless empty."""
    pipeline_parallel_expert_parallel_overlap: bool = True
    """torchtitan's MoE option (DualPipeV's overlap of stages with expert parallel's all-to-all); ignored."""
    module_fqns_per_model_part: list[list[str]] | None = unsupported("hand-written pipeline stages", None)
    """torchtitan's manual pipeline split; refused unless unset."""
    expert_tensor_parallel_degree: int = unsupported("expert tensor parallel (each expert split over TP ranks)", 1)
    """torchtitan's MoE option; refused unless 1."""
    expert_parallel_comm_backend: Literal["standard", "deepep"] = unsupported("DeepEP's all-to-all kernels", "standard")
    """torchtitan's MoE option; refused unless "standard" (all_to_all_single, parallelisms/ep.py)."""


@dataclass
class TorchtitanActivationCheckpoint:
    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = field(default_factory=lambda: ["moe.router.gate"])
    """torchtitan's MoE option; ignored (op SAC here keeps what models/<family>/plans.py names)."""
    memory_budget: float = 0.5
    """torchtitan's memory_budget mode (mode = memory_budget is refused); ignored."""
    visualize_memory_budget_pareto: bool = unsupported("the memory_budget mode", False)
    """torchtitan's memory_budget mode; refused unless false."""


@dataclass
class TorchtitanCheckpoint:
    initial_load_model_only: bool = unsupported("optimizer state from initial_load_path", True)
    """initial_load_path holds the model only (torchtitan's default); refused unless true."""
    initial_load_in_hf_quantized: bool = unsupported("quantized Hugging Face weights", False)
    """torchtitan's quantized HF loading; refused unless false."""
    enable_ft_dataloader_checkpoints: bool = True
    """torchtitan's fault-tolerance option; ignored."""
    load_only: bool = unsupported("loading without ever saving", False)
    """torchtitan's option; refused unless false."""


@dataclass
class TorchtitanMetrics:
    disable_color_printing: bool = False
    """torchtitan's option; ignored (this recipe prints no colors)."""
    save_for_all_ranks: bool = unsupported("metrics files of every rank", False)
    """torchtitan's option; refused unless false (rank 0 logs here)."""


@dataclass
class TorchtitanDebug:
    moe_force_load_balance: bool = unsupported("routing forced to balance (torchtitan's benchmarking option)", False)
    """torchtitan's MoE option; refused unless false."""


# ------------------------------------------------- sections this recipe never reads


@dataclass
class MXLinear:
    """torchtitan's MX (microscaling, Blackwell) linears: read only with the quantize.linear.mx converter, which is
    refused; its keys are ignored."""

    mxfp8_dim1_cast_kernel_choice: Literal["triton", "cuda", "torch"] = "triton"
    """torchtitan's MX option; ignored."""
    recipe_name: str = "mxfp8_cublas"
    """torchtitan's MX option; ignored."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """torchtitan's MX option; ignored."""


@dataclass
class Float8GroupedMM:
    """torchtitan's float8 MoE expert GEMMs (refused)."""

    fqns: list[str] = unsupported("float8 grouped GEMMs for MoE experts", [])
    """torchtitan's MoE option; refused unless empty."""


@dataclass
class MXGroupedMM:
    """torchtitan's MX MoE expert GEMMs (refused)."""

    recipe_name: Literal["mxfp8"] = "mxfp8"
    """torchtitan's MoE option; ignored."""
    fqns: list[str] = unsupported("MX grouped GEMMs for MoE experts", [])
    """torchtitan's MoE option; refused unless empty."""


@dataclass
class QuantizeGroupedMM:
    """torchtitan's [quantize.grouped_mm]: MoE expert GEMMs."""

    float8: Float8GroupedMM = field(default_factory=Float8GroupedMM)
    mx: MXGroupedMM = field(default_factory=MXGroupedMM)


@dataclass
class MemoryEstimation:
    """torchtitan's memory estimation; python -m planning.estimate_memory and planning/doctor.py estimate memory here."""

    enable: bool = unsupported(
        "torchtitan's memory estimation (python -m planning.estimate_memory and the doctor do it here)", False
    )
    """torchtitan's option; refused unless false."""
    disable_fake_mode: bool = False
    """torchtitan's option; ignored."""


@dataclass
class FaultTolerance:
    """torchtitan's torchft fault tolerance; refused when enabled, its other keys ignored."""

    enable: bool = unsupported("torchft fault tolerance", False)
    """torchtitan's option; refused unless false."""
    process_group: str = "gloo"
    """torchtitan's option; ignored."""
    process_group_timeout_ms: int = 10000
    """torchtitan's option; ignored."""
    replica_id: int = 0
    """torchtitan's option; ignored."""
    group_size: int = 0
    """torchtitan's option; ignored."""
    min_replica_size: int = 1
    """torchtitan's option; ignored."""
    semi_sync_method: str | None = None
    """torchtitan's option; ignored."""


@dataclass
class Experimental:
    """torchtitan's extension points; a fork edits the code instead."""

    custom_import: str = unsupported("custom imports", "")
    """torchtitan's extension point; refused unless empty."""
    custom_args_module: str = unsupported("a custom config module", "")
    """torchtitan's extension point; refused unless empty."""
