"""Async tensor parallel: overlap TP's collectives with the matmuls that consume or produce them.

Async TP is not another sharding plan. It is an inductor pass (micro-pipeline TP) that splits each
all-gather + matmul and matmul + reduce-scatter of the TP plan (parallelisms/tp.py) into chunks
that overlap, copying between peers through CUDA symmetric memory. Hence its requirements:
torch.compile, CUDA with NCCL, and a TP group of at least two ranks; elsewhere it is refused in
one line. torchtitan measured 1.09-1.16x tokens/s on H100s (docs/failures.md #4).

The switch is a private inductor config that inductor's FX graph cache key ignored before
PyTorch 2.8, which is how a plain-TP run was once served async-TP graphs (docs/failures.md #4);
parallelize_model puts this setting in the key of the inductor cache folder (parallelisms/compile.py).

To remove async TP from a fork: delete this file, its call in parallelize_model, and the
`enable_async_tensor_parallel` key of [parallelism] in config.py (README.md, "Removing a part").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from errors import ConfigError


def async_tp_problems(*, compile_enabled: bool, tp_degree: int, device_type: str, backend: str) -> list[str]:
    """What is missing for async TP; empty when it can run."""
    missing = []
    if not compile_enabled:
        missing.append("compile.enable is false")
    if device_type != "cuda" or "nccl" not in backend:
        missing.append(f"the TP group runs on {device_type} with {backend}")
    if tp_degree < 2:
        missing.append(f"tensor_parallel_degree is {tp_degree}")
    return missing


def apply_async_tp(tp_mesh: DeviceMesh, *, compile_enabled: bool, planning: bool = False) -> None:
    """Switch on micro-pipeline TP for `tp_mesh`, or raise a one-line ConfigError saying what is missing.

    planning: a dry run (dry_run.py) on a fake process group: check the job against the CUDA + NCCL machine it
    plans for, and switch nothing on."""
    device_type, backend = (
        ("cuda", "nccl") if planning else (tp_mesh.device_type, dist.get_backend(tp_mesh.get_group()))
    )
    missing = async_tp_problems(
        compile_enabled=compile_enabled, tp_degree=tp_mesh.size(), device_type=device_type, backend=backend
    )
    if missing:
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel: async TP needs compile.enable = true, CUDA with NCCL and "
            f"tensor_parallel_degree > 1, but {', '.join(missing)}; set it to false"
        )
    if planning:
        return
    # Both switches are private PyTorch APIs (2.13 has no public one); torchtitan uses the same two.
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    switch_on_micro_pipeline_tp()
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def switch_on_micro_pipeline_tp() -> None:
    """Inductor's micro-pipeline TP pass, read when it compiles (benchmarks/async_tp_fusion.py counts what it fuses)."""
    torch._inductor.config._micro_pipeline_tp = True
