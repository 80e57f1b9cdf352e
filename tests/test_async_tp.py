"""Async TP (parallelisms/async_tp.py): what it needs, refused in one line where it cannot run (this CPU machine),
checked against the CUDA + NCCL machine a dry run plans for. It cannot run here: a GPU machine with NCCL measures it
(docs/benchmarks.md, "GPU"). (A fork that removes async TP removes this file.)"""

from __future__ import annotations

from collections.abc import Callable

from parallelisms.async_tp import async_tp_problems
from tests.launch import python, torchrun, two_at_a_time


def test_what_async_tp_needs() -> None:
    assert async_tp_problems(compile_enabled=True, tp_degree=2, device_type="cuda", backend="nccl") == []
    assert async_tp_problems(compile_enabled=False, tp_degree=1, device_type="cpu", backend="gloo") == [
        "compile.enable is false", "the TP group runs on cpu with gloo", "tensor_parallel_degree is 1",
    ]  # fmt: skip
    assert async_tp_problems(compile_enabled=True, tp_degree=8, device_type="cuda", backend="cuda:nccl") == []


def test_async_tp_on_cpu_is_refused_in_one_line() -> None:
    args = ("--config", "configs/debug_tp.toml", "--parallelism.enable_async_tensor_parallel", "--compile.enable")
    proc = torchrun("train.py", *args, nproc=2, check=False, launcher=True)  # (its failure summary)
    assert proc.stderr.count("error: parallelism.enable_async_tensor_parallel: async TP needs") == 1, proc.stderr
    assert "the TP group runs on cpu with gloo" in proc.stderr
    assert "exitcode  : 2" in proc.stderr  # every rank exits 2; torchrun itself then exits 1


def test_a_dry_run_checks_async_tp_against_the_gpus_it_plans_for() -> None:
    """The 70B recipe turns async TP on with compile: fine for CUDA + NCCL; without compile it is refused there too."""
    args, env = ("train.py", "--config", "configs/llama3_70b.toml", "--comm.mode=fake_backend"), {"WORLD_SIZE": "64"}
    planned, refused = two_at_a_time(
        lambda: python(*args, env=env, timeout=120),
        lambda: python(*args, "--compile.enable=false", env=env, timeout=120),
    )
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert refused.returncode == 2 and refused.stderr.count("error: ") == 1, refused.stderr
    assert "parallelism.enable_async_tensor_parallel: async TP needs compile.enable = true" in refused.stderr
    assert "but compile.enable is false; set it to false" in refused.stderr


def test_summed_matmuls_before_a_reduce_scatter_become_one_matmul() -> None:
    """parallelisms/async_tp.py SummedMatmuls, the pass async TP runs before micro-pipeline TP: x1 @ w1 + x2 @ w2 +
    x3 @ w3 that is reduce-scattered (the input gradient of q, k and v) compiles to one matmul over the concatenated
    operands, in the reshape -> mm -> reshape form micro-pipeline TP fuses with its reduce-scatter, with the same
    values; a sum nobody reduce-scatters is left alone. (benchmarks/async_tp_fusion.py counts the whole blocks.)"""
    import torch
    import torch._inductor.config as inductor_config
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from parallelisms.async_tp import SummedMatmuls

    def summed(x1, x2, x3, w1, w2, w3):  # noqa: ANN001, ANN202
        return x1 @ w1 + x2 @ w2 + x3 @ w3

    def scattered(*args):  # noqa: ANN002, ANN202
        return funcol.reduce_scatter_tensor(summed(*args), "sum", 1, dist.group.WORLD)  # scatter the sequence

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    generator = torch.Generator().manual_seed(0)
    widths = (16, 8, 8)  # q, k, v: grouped-query attention's narrower k and v
    inputs = [torch.randn(2, 6, k, generator=generator) for k in widths]
    inputs += [torch.randn(k, 12, generator=generator) for k in widths]
    graphs: list[list[str]] = []

    def ops(graph: torch.fx.Graph) -> None:
        names = [getattr(n.target, "__name__", "") for n in graph.nodes if n.op == "call_function"]
        graphs.append(sorted(n.split(".")[0] for n in names if n.split(".")[0] in ("mm", "add", "cat")))

    try:
        with inductor_config.patch(post_grad_custom_pre_pass=[SummedMatmuls(), ops], fx_graph_cache=False):
            for fn in (scattered, summed):
                torch._dynamo.reset()
                out = torch.compile(fn, fullgraph=True)(*inputs)
                torch.testing.assert_close(out, fn(*inputs), rtol=1e-5, atol=1e-5)
    finally:
        if started:
            dist.destroy_process_group()
    assert graphs == [["cat", "cat", "mm"], ["add", "add", "mm", "mm", "mm"]], graphs


def test_summed_matmuls_keep_a_compiled_tp_layout_at_parity(parity: Callable[[int], dict[str, dict]]) -> None:
    """The pass on real TP 2 (gloo): tests/parity_worker.py compiles tp2_compile_full_ac with SummedMatmuls (the
    micro-pipeline pass needs CUDA), which rewrites the backward's two summed input gradients, and the layout keeps
    one process's losses and weights (test_loss_and_parameter_parity)."""
    assert parity(2)["tp2_compile_full_ac"]["summed_matmuls"] == 2
