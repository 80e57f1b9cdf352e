"""parallelize_llama: the one place where parallelisms are applied, in a fixed order."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from config import ActivationCheckpoint, Compile, ConfigError, Parallelism, Training
from models.llama3 import Transformer
from parallelisms.fsdp import DTYPES, apply_fsdp
from parallelisms.parallel_dims import ParallelDims


def parallelize_llama(
    model: Transformer,
    *,
    dims: ParallelDims,
    mesh: DeviceMesh,
    training: Training,
    parallelism: Parallelism,
    ac: ActivationCheckpoint,
    compile: Compile,
) -> Transformer:
    """Apply, in order, TP -> activation checkpointing -> compile -> FSDP to a meta model."""
    unsupported = []
    if dims.tp_enabled or parallelism.enable_async_tensor_parallel:
        unsupported.append("parallelism.tensor_parallel_degree: tensor parallel is not available yet; set it to 1")
    if ac.mode != "none":
        unsupported.append("activation_checkpoint.mode: activation checkpointing is not available yet; set it to \"none\"")
    if compile.enable:
        unsupported.append("compile.enable: compile is not available yet; set it to false")
    if unsupported:
        raise ConfigError(*unsupported)

    if dims.dp > 1 or training.mixed_precision_param != "float32" or training.enable_cpu_offload:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.hsdp_enabled else mesh["dp_shard"]
        apply_fsdp(
            model,
            dp_mesh,
            param_dtype=DTYPES[training.mixed_precision_param],
            reduce_dtype=DTYPES[training.mixed_precision_reduce],
            cpu_offload=training.enable_cpu_offload,
        )
    return model
