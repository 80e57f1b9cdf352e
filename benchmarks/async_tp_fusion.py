"""Async TP (docs/failures.md #4): does inductor's micro-pipeline TP pass find the TP plan's collectives in this
recipe's compiled blocks? Counted on CPU, per block, forward and backward, for each AC mode and every dense family.

    python -m benchmarks.async_tp_fusion

Async TP helps only where the pass rewrites an all-gather -> matmul into `fused_all_gather_matmul` and a matmul ->
reduce-scatter into `fused_matmul_reduce_scatter`; what it cannot match stays a plain collective, silently (torch
logs "async TP found no matching all-gather/reduce-scatter patterns for fusion" only when it finds none at all).

How: one process is rank 0 of a 2-rank fake process group (torch's FakeProcessGroup, as in the dry run). The tiny
model of each family (tests/parity_worker.py's shapes) is built by the recipe's own `build_model` with TP 2 (sequence
parallel, loss parallel) and each AC mode, compiled per block, with inductor's micro-pipeline TP pass on; one forward
and backward runs. Inductor's post-grad hooks read each compiled graph before and after the pass.

What stands in for the CUDA machine async TP needs, none of it in the recipe's code:
- `torch.distributed.is_nccl_available()` reads True while this runs: on a torch build without NCCL (this CPU
  wheel) the pass returns before matching anything;
- torch's symmetric-memory test mode says the TP group has symmetric memory;
- the fused ops get torch's own fallback implementations for CPU (torch registers them for CUDA only);
- inductor generates no kernels (`fallback_by_default`: lowering runs after the pass; the graphs counted are the
  same), so a compile takes seconds.
What only a GPU shows is the overlap itself and its speed (docs/benchmarks.md, "GPU").

In backward, each reduce-scatter is of the input gradient that several column-wise linears share (q, k and v; w1
and w3), a sum of matmuls the pass cannot split; parallelisms/async_tp.py's SummedMatmuls, which the recipe's async
TP runs before it, makes each one matmul. torchtitan 0.2.2's Llama block is counted beside (its model, its TP plan,
its per-block compile, its switch): its backward keeps those reduce-scatters plain. (On torch 2.13 its compiled TP
step then fails in a DTensor redistribution outside the block, after both graphs were compiled and counted; the
table says so.)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import traceback
from typing import Any

import torch
import torch.distributed as dist

import models
from benchmarks.harness import Row
from tests.parity_worker import TINY_SHAPES

# The layouts counted: (family, AC mode). "op, gathers kept" is op SAC as plain TP runs it (parallelisms/ac.py). Every
# dense family: a mixture of experts trains TP only with expert parallel, which compile (async TP's pass) does not
# take yet (parallelisms/ep.py check_ep).
DENSE = [name for name in TINY_SHAPES if not models.family(name).experts_module]
LAYOUTS = [("llama3", "op, gathers kept")] + [(f, ac) for f in DENSE for ac in ("none", "op", "full")]
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
FUSED = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")
TORCHTITAN = "torchtitan 0.2.2 llama3"  # the peer's block, counted beside (count_torchtitan)


def _op_name(node: torch.fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _count(graph: torch.fx.Graph) -> dict[str, int]:
    counts = collections.Counter(_op_name(n) for n in graph.nodes if n.op == "call_function")
    return {name: counts[name] for name in (*COLLECTIVES, *FUSED) if counts[name]}


def count_layout(family: str, ac_mode: str) -> dict[str, Any]:
    """One forward and backward of the family's tiny model under TP 2 and `ac_mode`, compiled with the pass on: per
    compiled graph (forward, backward), the collectives before the pass and what is left after it."""
    import torch._inductor.config as inductor_config

    from config import ActivationCheckpoint, Compile, JobConfig, Model, Parallelism
    from loss import build_loss_fn
    from parallelisms.async_tp import switch_on_micro_pipeline_tp
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.parallelize import build_model, init_model
    from tests.parity_worker import GLOBAL_BATCH, TRAINING, model_args, random_batch

    torch._dynamo.reset()
    before: list[dict[str, int]] = []
    after: list[dict[str, int]] = []
    ac = {
        "none": ActivationCheckpoint(mode="none"),
        "full": ActivationCheckpoint(mode="full"),
    }.get(ac_mode, ActivationCheckpoint(mode="selective", selective_ac_option="op"))
    # Async TP as parallelize_model switches it on; "gathers kept": op SAC's policy for plain TP.
    parallelism = Parallelism(
        tensor_parallel_degree=2,
        data_parallel_shard_degree=1,
        enable_async_tensor_parallel=ac_mode != "op, gathers kept",
    )
    dims = ParallelDims.from_config(parallelism, world_size=2)
    mesh = dims.build_mesh("cpu")
    with inductor_config.patch(
        post_grad_custom_pre_pass=lambda g: before.append(_count(g)),
        post_grad_custom_post_pass=lambda g: after.append(_count(g)),
    ):
        try:
            cfg = JobConfig(
                model=Model(name=family),
                training=dataclasses.replace(TRAINING, local_batch_size=GLOBAL_BATCH),
                parallelism=parallelism,
                activation_checkpoint=ac,
                compile=Compile(enable=True),
            )
            model, pipeline = build_model(
                cfg,
                model_args(family=family),
                dims=dims,
                mesh=mesh,
                loss_fn=build_loss_fn(Compile()),
                device=torch.device("cpu"),
            )
            init_model(model, pipeline, device=torch.device("cpu"))
            switch_on_micro_pipeline_tp()  # the pass on, whichever policy op SAC was given
            tokens = random_batch()
            model(tokens[:, :-1]).float().mean().backward()
        except Exception as e:  # a torch failure is the result for this layout
            last = traceback.format_exception_only(e)[-1].strip()
            return {"family": family, "ac": ac_mode, "error": last[:300]}
    graphs = ["forward", "backward"]
    assert len(before) == len(after) == 2, (before, after)
    return {
        "family": family,
        "ac": ac_mode,
        "before": dict(zip(graphs, before, strict=True)),
        "after": dict(zip(graphs, after, strict=True)),
    }


def count_torchtitan(ac_mode: str = "none") -> dict[str, Any]:
    """The same count for torchtitan 0.2.2's Llama 3 block (its model, its TP plan `apply_tp`, its per-block
    `apply_compile`, its async-TP switch), at the tiny Llama shape, without AC: its blocks' collectives as inductor's
    pass leaves them."""
    import torch._inductor.config as inductor_config
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.config.job_config import Compile as TorchtitanCompile
    from torchtitan.models.llama3.infra.parallelize import apply_compile, apply_tp
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    from tests.parity_worker import TINY, random_batch

    torch._dynamo.reset()
    before: list[dict[str, int]] = []
    after: list[dict[str, int]] = []
    args = TransformerModelArgs(
        dim=TINY.dim, n_layers=1, n_heads=TINY.n_heads, n_kv_heads=TINY.n_kv_heads, vocab_size=TINY.vocab_size,
        max_seq_len=TINY.max_seq_len,
    )  # fmt: skip
    with inductor_config.patch(
        post_grad_custom_pre_pass=lambda g: before.append(_count(g)),
        post_grad_custom_post_pass=lambda g: after.append(_count(g)),
    ):
        model = Transformer(args)
        with torch.no_grad():  # as torchtitan's trainer initializes
            model.init_weights()
        # Logits gathered (no loss parallel): the head is outside the blocks counted.
        apply_tp(model, init_device_mesh("cpu", (2,)), loss_parallel=False, enable_float8_tensorwise_tp=False)
        apply_compile(model, TorchtitanCompile(enable=True))
        inductor_config._micro_pipeline_tp = True  # torchtitan's maybe_enable_async_tp, without its job config
        tokens = random_batch()
        error = None
        try:
            model(tokens[:, :-1]).float().mean().backward()
        except Exception as e:  # what happens to torchtitan is the result; the graphs compiled so far are counted
            error = traceback.format_exception_only(e)[-1].strip()[:300]
    graphs = ["forward", "backward"]
    return {
        "family": TORCHTITAN,
        "ac": ac_mode,
        "before": dict(zip(graphs, before, strict=False)),
        "after": dict(zip(graphs, after, strict=False)),
        **({"error": error} if error else {}),
    }


def _switch_on_async_tp(tp_mesh: Any, **_: Any) -> None:
    """parallelisms.async_tp.apply_async_tp without its CUDA checks and its CUDA-only symmetric memory (the test mode
    stands in): the inductor switch."""
    from parallelisms.async_tp import switch_on_micro_pipeline_tp

    switch_on_micro_pipeline_tp()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import os
    import shutil
    import tempfile
    from unittest import mock

    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory as symm_mem
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallelisms import parallelize

    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="async_tp_fusion_")  # removed at the end
    for op, fallback in (
        ("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback),
        ("fused_matmul_reduce_scatter", symm_mem._fused_matmul_reduce_scatter_fallback),
    ):
        torch.library.impl(f"symm_mem::{op}", "CPU")(fallback)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with (
            mock.patch.object(dist, "is_nccl_available", return_value=True),
            mock.patch.object(parallelize, "apply_async_tp", _switch_on_async_tp),
            symm_mem._test_mode(),
            inductor_config.patch(fallback_by_default=True, fx_graph_cache=False, _micro_pipeline_tp=False),
        ):
            layouts = []
            for family, ac_mode in LAYOUTS:
                inductor_config._micro_pipeline_tp = False
                layouts.append(count_layout(family, ac_mode))
            inductor_config._micro_pipeline_tp = False
            layouts.append(count_torchtitan())
    finally:
        dist.destroy_process_group()
        shutil.rmtree(cache, ignore_errors=True)
    return {"tp": 2, "layouts": layouts}


def _cell(counts: dict[str, int]) -> str:
    short = {"all_gather_into_tensor": "AG", "reduce_scatter_tensor": "RS", "all_reduce": "AR",
             "fused_all_gather_matmul": "AG+mm", "fused_matmul_reduce_scatter": "mm+RS"}  # fmt: skip
    return " ".join(f"{n} {short[k]}" for k, n in counts.items()) or "-"


def table(results: dict[str, Any]) -> str:
    width = max(8, *(len(r["family"]) for r in results["layouts"]))
    lines = [
        f"Async TP: collectives of one compiled block (TP {results['tp']}), before -> after inductor's micro-pipeline"
        " TP pass",
        f"{'family':<{width}} {'AC':<16} {'forward':<34} {'backward':<34}",
    ]
    for r in results["layouts"]:
        graphs = [g for g in ("forward", "backward") if g in r.get("before", {})]
        if graphs:
            cells = [f"{_cell(r['before'][g])} -> {_cell(r['after'][g])}" for g in graphs]
            lines.append(f"{r['family']:<{width}} {r['ac']:<16} " + " ".join(f"{c:<34}" for c in cells))
        if "error" in r:
            lines.append(f"{r['family']:<{width}} {r['ac']:<16} {'then ' if graphs else ''}fails: {r['error'][:100]}")
    return "\n".join(lines)


def unfused(counts: dict[str, int]) -> int:
    """All-gathers and reduce-scatters the pass left as plain collectives."""
    return counts.get("all_gather_into_tensor", 0) + counts.get("reduce_scatter_tensor", 0)


def rows(results: dict[str, Any]) -> list[Row]:
    """Forward collectives left unfused in a Llama 3 block under op SAC: gathers kept (as plain TP keeps them) vs
    recomputed (what the recipe does under async TP); backward collectives left unfused in a Llama 3 block without AC,
    torchtitan 0.2.2's vs this recipe's (SummedMatmuls)."""
    by = {(r["family"], r["ac"]): r for r in results["layouts"]}
    kept, recomputed = by[("llama3", "op, gathers kept")], by[("llama3", "op")]
    out = [
        Row("#4 async TP", "unfused TP collectives, op SAC forward", "", "all-gathers kept",
            unfused(kept["after"]["forward"]), "recomputed", unfused(recomputed["after"]["forward"])),
    ]  # fmt: skip
    peer = by.get((TORCHTITAN, "none"), {}).get("after", {})
    if "backward" in peer:
        out.append(Row("#4 async TP", "unfused TP collectives, a block's backward", "", "torchtitan 0.2.2",
                       unfused(peer["backward"]), "this recipe", unfused(by[("llama3", "none")]["after"]["backward"])))  # fmt: skip
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    pass


def main(argv: list[str] | None = None) -> int:
    from benchmarks import harness

    return harness.main("async_tp_fusion", argv, doc=__doc__ or "", add_args=add_args, measure=measure, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
