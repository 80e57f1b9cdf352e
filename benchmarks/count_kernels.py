"""Kernels per training step: one trainer's step, its ops counted as the dispatcher runs them (rank 0).

    torchrun --nproc_per_node=2 -m benchmarks.count_kernels recipe|torchtitan OUT.json TRAINER ARGS...

benchmarks/vs_torchtitan.py starts both trainers through this module in every layout: train.py's
`train_step` or torchtitan 0.2.2's `Trainer.train_step` is wrapped (neither trainer's code is changed) and
step COUNTED_STEP, the first after lazy initialization and outside the timed steps, runs (eager) under
planning.trace.observe_ops. On a GPU every op an eager step dispatches that is not a view is a kernel
launch, and at small shapes launches, not FLOPs, bound a step. DTensor ops count as the local ops they run,
collectives as one op each; views (reshapes, transposes, slices) launch nothing and are counted apart, and
record_function's annotations (the profiler namespace) not at all.

A compiled step (`--compile.enable` among the trainer's arguments) is counted from torch.profiler instead, as its
launches: on CPU every kernel inductor generated (its C++ kernels announce themselves with `cpp.enable_kernel_profile`,
set before either trainer compiles) and every op called outside them (matmuls and attention, collectives, the
optimizer, the compiled code's glue) that is not a view and not inside another op; on a GPU every kernel launch the
CUDA runtime or driver records (Triton's, fused the GPU's way, included; not yet run on one). The same rule for both
trainers.

The profiled step also says where its time goes (`profile` in the JSON): on a GPU each kernel's device time as the
profiler records it (memory copies and sets included; not yet run on one either), on CPU the CPU time of the launches
counted above (each op outside the generated kernels and each generated kernel: the same code runs in a rehearsal).
It holds the step's wall time under the profiler (`step_ms`), the time of all its kernels (`kernels_ms`), that time
by kind of kernel (KINDS: attention, matmul, inductor's generated, optimizer, collective, copy, other) and the TOP
kernels by total time, each with its calls. The profiled step is COUNTED_STEP, before the timed ones, and leaves
nothing behind that could slow them: the profiler's events are collected (their parent links are cycles) before the
step returns, and on a GPU the profiler detaches from CUDA when it stops (TEARDOWN_CUPTI, `main`).
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

COUNTED_STEP = 2
_OP = re.compile(r"^(aten|c10d|_c10d_functional|fsdp)::(\w+)")
_GENERATED = re.compile(r"cpp_fused")  # a C++ kernel inductor generated (graph_<n>_cpp_fused_...)
_LAUNCH = re.compile(r"^cu(da)?LaunchKernel")  # cudaLaunchKernel(ExC), cuLaunchKernel(Ex): Triton's too
TOP = 15  # the kernels kept by total time
# A kernel's kind, by its name, the first that matches: CUDA kernels (cuBLAS's gemm/nvjet/xmma, FlashAttention's
# flash/fmha, Triton's triton_*, foreach's multi_tensor_apply, NCCL's) and, on CPU, the ops of the same work.
KINDS = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|^aten::(mm|addmm|bmm|baddbmm|_scaled_mm|linear|matmul)$", re.I)),
    ("generated", re.compile(r"^triton_|cpp_fused")),  # before copy: inductor names its kernels by the ops fused
    ("optimizer", re.compile(r"multi_tensor_apply|_foreach_|adam", re.I)),
    ("collective", re.compile(r"nccl|^c10d::|^_c10d_functional::", re.I)),
    ("copy", re.compile(r"^Memcpy|^Memset|copy", re.I)),
)  # fmt: skip


def count_step(
    step_fn: Callable[..., Any], is_counted: Callable[..., bool], out: Path, *, compiled: bool = False
) -> Callable[..., Any]:
    """`step_fn`, writing to `out` (JSON) on rank 0 the ops of the call where `is_counted(*args, **kwargs)`: as the
    dispatcher runs them, or for a `compiled` step its launches as the profiler records them (module docstring)."""
    import torch.distributed as dist

    def counted(*args: Any, **kwargs: Any) -> Any:
        if not (is_counted(*args, **kwargs) and dist.get_rank() == 0):
            return step_fn(*args, **kwargs)
        result, counts = (_profiled if compiled else _dispatched)(step_fn, *args, **kwargs)
        out.write_text(json.dumps(counts, indent=1))
        return result

    return counted


def _dispatched(step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    from planning.trace import observe_ops

    kernels: Counter[str] = Counter()
    views = 0

    def on_op(op: Any, *_: Any) -> None:
        nonlocal views
        if op.namespace == "profiler":  # record_function's annotations: no kernel
            return
        if op.is_view:
            views += 1
        else:
            kernels[op.name()] += 1

    with observe_ops(on_op):
        result = step_fn(*args, **kwargs)
    return result, {"kernels": sum(kernels.values()), "views": views, "by_op": dict(sorted(kernels.items()))}


def _profiled(step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()  # the step before ends before this one's clock starts
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        begin = time.perf_counter()
        result = step_fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        step_us = (time.perf_counter() - begin) * 1e6
    counts, timed = _launches_and_times(prof.events(), cuda=cuda)
    del prof  # its events link parents and children both ways: collected here, not in a timed step
    gc.collect()
    return result, counts | {"profile": where_the_time_goes(timed, step_us=step_us, device="cuda" if cuda else "cpu")}


def _launches_and_times(events: Any, *, cuda: bool) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """The profiled step's launches (module docstring) and the time of each call (us) by kernel name: the device's on a
    GPU, the CPU's of the launches counted on CPU."""
    from torch.autograd import DeviceType

    kernels: Counter[str] = Counter()
    timed: dict[str, list[float]] = {}
    views = 0
    for event in events:
        if cuda:  # every launch, generated or not, is a call of the CUDA runtime or driver (not yet run on a GPU)
            if _LAUNCH.match(event.name):
                kernels["cuda::launch"] += 1
            elif event.device_type == DeviceType.CUDA:  # a kernel, copy or set as the GPU ran it
                timed.setdefault(event.name, []).append(event.time_range.elapsed_us())
        elif _GENERATED.search(event.name):
            kernels["inductor::generated"] += 1
            timed.setdefault(event.name, []).append(event.time_range.elapsed_us())
        elif (op := _OP.match(event.name)) and not _inside_an_op(event):
            if _is_view(op[1], op[2]):
                views += 1
            else:
                kernels[event.name] += 1
                timed.setdefault(event.name, []).append(event.time_range.elapsed_us())
    return {"kernels": sum(kernels.values()), "views": views, "by_op": dict(sorted(kernels.items()))}, timed


def where_the_time_goes(timed: dict[str, list[float]], *, step_us: float, device: str) -> dict[str, Any]:
    """One profiled step's kernel times (`timed`: name -> each call's microseconds) as the JSON's `profile`: the
    step's wall time, its kernels' total, that total by kind (KINDS) and the TOP kernels by total time, each with its
    calls and its share of the step's wall time; times in milliseconds."""
    totals = {name: sum(times) / 1e3 for name, times in timed.items()}
    step_ms = step_us / 1e3
    by_kind: Counter[str] = Counter()
    for name, ms in totals.items():
        by_kind[kind(name)] += ms
    top = sorted(totals, key=lambda name: -totals[name])[:TOP]
    return {
        "device": device, "step_ms": step_ms, "kernels_ms": sum(totals.values()),
        "by_kind": {k: ms for k, ms in by_kind.most_common()},
        "top": [{"name": name, "count": len(timed[name]), "ms": totals[name], "share": totals[name] / step_ms}
                for name in top],
    }  # fmt: skip


def kind(name: str) -> str:
    """The KINDS entry a kernel's (or op's) name falls under; "other" for none."""
    return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def _inside_an_op(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _OP.match(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def _is_view(namespace: str, name: str) -> bool:
    import torch

    packet = getattr(getattr(torch.ops, namespace, None), name, None)
    overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
    return any(o.is_view for o in overloads)


def main(argv: list[str]) -> int:
    trainer, out, trainer_argv = argv[0], Path(argv[1]), argv[2:]
    compiled = "--compile.enable" in trainer_argv
    if compiled:
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True  # before either trainer compiles
        # The profiler's CUDA hooks (CUPTI) stay attached after it stops unless told to detach, and slowed the
        # steps after it by 10-20% (pytorch/pytorch#144455, open as of torch 2.13): the timed steps come after the
        # profiled one. torch sets it to 0 itself where CUDA graphs are compiled; neither trainer compiles any.
        os.environ.setdefault("TEARDOWN_CUPTI", "1")
    if trainer == "recipe":
        import train  # the repo is on PYTHONPATH (benchmarks.harness.run_python)

        is_counted = lambda step, *a, **k: step == COUNTED_STEP  # noqa: E731
        train.train_step = count_step(train.train_step, is_counted, out, compiled=compiled)
        return train.main(trainer_argv)
    from tests import torchtitan_trainer

    sys.argv = [sys.argv[0], *trainer_argv]  # before torchtitan imports: its parser's default is sys.argv[1:] then
    torchtitan_trainer.prepare()
    from torchtitan.train import Trainer

    is_titans = lambda self, *a, **k: self.step == COUNTED_STEP  # noqa: E731
    Trainer.train_step = count_step(Trainer.train_step, is_titans, out, compiled=compiled)
    torchtitan_trainer.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
