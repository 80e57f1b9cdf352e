"""Async tensor parallel: overlap TP's collectives with the matmuls that consume or produce them.

Async TP is not another sharding plan. It is an inductor pass (micro-pipeline TP) that splits each
all-gather + matmul and matmul + reduce-scatter of the TP plan (parallelisms/tp.py) into chunks
that overlap, copying between peers through CUDA symmetric memory. Hence its requirements:
torch.compile, CUDA with NCCL, and a TP group of at least two ranks; elsewhere it is refused in
one line. torchtitan measured 1.09-1.16x tokens/s on H100s (docs/failures.md #4).

The switch is a private inductor config that inductor's FX graph cache key ignored before
PyTorch 2.8, which is how a plain-TP run was once served async-TP graphs (docs/failures.md #4);
parallelize_model puts this setting in the key of the inductor cache folder (parallelisms/compile.py).

One more pass of this file's own runs first (SummedMatmuls): in backward, the gradient of an input that several
column-parallel linears share (attention's x for q, k and v; the MLP's x for w1 and w3) is a sum of matmuls, which
the micro-pipeline pass cannot split, so the reduce-scatter that follows it stayed a plain collective. The pass
rewrites the sum as one matmul over the concatenated gradients and weights, A1 @ B1 + A2 @ B2 = [A1 A2] @ [B1; B2],
where the sum feeds a reduce-scatter; the model, its state dict and every run without async TP are untouched.

To remove async TP from a fork: delete this file, its call in parallelize_model, and the
`enable_async_tensor_parallel` key of [parallelism] in config/sections.py (docs/development.md, "Removing a part").
"""

from __future__ import annotations

import functools
import operator
from typing import Any

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


def require_async_tp(*, compile_enabled: bool, tp_degree: int, device_type: str, backend: str) -> None:
    """A one-line ConfigError saying what async TP lacks (async_tp_problems), if anything. apply_async_tp checks the
    run's TP group with it; a dry run (planning/dry_run.py) the CUDA + NCCL machine it plans for."""
    missing = async_tp_problems(
        compile_enabled=compile_enabled, tp_degree=tp_degree, device_type=device_type, backend=backend
    )
    if missing:
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel: async TP needs compile.enable = true, CUDA with NCCL and "
            f"tensor_parallel_degree > 1, but {', '.join(missing)}; set it to false"
        )


def apply_async_tp(tp_mesh: DeviceMesh, *, compile_enabled: bool) -> None:
    """Switch on micro-pipeline TP for `tp_mesh`, or raise a one-line ConfigError saying what is missing."""
    backend = dist.get_backend(tp_mesh.get_group())
    require_async_tp(
        compile_enabled=compile_enabled, tp_degree=tp_mesh.size(), device_type=tp_mesh.device_type, backend=backend
    )
    # Both switches are private PyTorch APIs (2.13 has no public one); torchtitan uses the same two.
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    switch_on_micro_pipeline_tp()
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def switch_on_micro_pipeline_tp() -> None:
    """Inductor's micro-pipeline TP pass, read when it compiles (benchmarks/async_tp_fusion.py counts what it fuses),
    with SummedMatmuls before it (after any post-grad pass already set, which a benchmark may use to count)."""
    from torch._inductor.custom_graph_pass import get_custom_graph_passes

    torch._inductor.config._micro_pipeline_tp = True
    summed_matmuls = _summed_matmuls_class()
    passes = get_custom_graph_passes(torch._inductor.config.post_grad_custom_pre_pass)
    if not any(isinstance(p, summed_matmuls) for p in passes):
        torch._inductor.config.post_grad_custom_pre_pass = [*passes, summed_matmuls()]


aten = torch.ops.aten
_REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
# What may stand between a summed gradient and its reduce-scatter: DTensor's Shard(1) -> reduce-scatter on dim 0
# splits along the sequence and concatenates the pieces.
_PASS_THROUGH = (aten.split.Tensor, operator.getitem, aten.cat.default, aten.reshape.default, aten.view.default)


@functools.cache
def _summed_matmuls_class() -> type:
    """SummedMatmuls, defined on first use: its base class imports inductor, and with it dynamo, which starting
    train.py does not pay for (tests/test_pp.py)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class SummedMatmuls(CustomGraphPass):
        """Inductor post-grad pass: a sum of matmuls whose result is reduce-scattered becomes one matmul over the
        concatenated operands, which micro-pipeline TP then splits and overlaps with the reduce-scatter.

        Matched: a tree of aten.add.Tensor (each add used once) whose leaves are aten.mm nodes, or reshapes of them
        to one shape, each used once: A_i (M, K_i) @ B_i (K_i, N). Written: cat(A_i, dim 1) @ cat(B_i, dim 0), the
        same sum in one reduction over K = sum K_i (the order of the float additions changes, nothing else). The
        copies it adds are of the gradients and the weights' local shards; the matmul reads them once, as the
        separate ones did.
        """

        def __init__(self) -> None:
            self.rewrites = 0  # sums rewritten so far (tests/parity_worker.py reads it)

        def __call__(self, graph: torch.fx.Graph) -> None:
            for node in list(graph.nodes):
                if node.target is aten.add.Tensor and node.graph is graph and _feeds_reduce_scatter(node):
                    leaves = _matmul_leaves(node)
                    if leaves is not None and len(leaves) > 1:
                        _rewrite(graph, node, leaves)
                        self.rewrites += 1
            graph.eliminate_dead_code()

        def uuid(self) -> bytes:  # inductor's FX graph cache keys on this file's text
            return get_hash_for_files((__file__,))

    return SummedMatmuls


def __getattr__(name: str) -> Any:  # `from parallelisms.async_tp import SummedMatmuls` defines it
    if name == "SummedMatmuls":
        return _summed_matmuls_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _feeds_reduce_scatter(node: torch.fx.Node, depth: int = 4) -> bool:
    if depth == 0:
        return False
    for user in node.users:
        if user.target is _REDUCE_SCATTER:
            return True
        if user.target in _PASS_THROUGH and _feeds_reduce_scatter(user, depth - 1):
            return True
    return False


def _matmul_leaves(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The leaves (mm, or a reshape of one) of the add tree at `node`, or None where it is anything else."""
    if node.kwargs or len(node.args) != 2:  # an add with alpha is not a plain sum
        return None
    leaves: list[torch.fx.Node] = []
    for arg in node.args:
        if not isinstance(arg, torch.fx.Node) or len(arg.users) != 1:
            return None
        if arg.target is aten.add.Tensor:
            inner = _matmul_leaves(arg)
            if inner is None:
                return None
            leaves += inner
        elif _mm_of(arg) is not None:
            leaves.append(arg)
        else:
            return None
    shapes = {tuple(leaf.meta["val"].shape) for leaf in leaves}
    dtypes = {leaf.meta["val"].dtype for leaf in leaves}
    return leaves if len(shapes) == len(dtypes) == 1 else None


def _mm_of(leaf: torch.fx.Node) -> torch.fx.Node | None:
    if leaf.target is aten.mm.default:
        return leaf
    if leaf.target in (aten.reshape.default, aten.view.default):
        mm = leaf.args[0]
        if isinstance(mm, torch.fx.Node) and mm.target is aten.mm.default and len(mm.users) == 1:
            return mm
    return None


def _rewrite(graph: torch.fx.Graph, root: torch.fx.Node, leaves: list[torch.fx.Node]) -> None:
    mms = [_mm_of(leaf) for leaf in leaves]
    a_args, b_args = [mm.args[0] for mm in mms], [mm.args[1] for mm in mms]  # type: ignore[union-attr]

    def add(target: object, args: tuple, value: torch.Tensor) -> torch.fx.Node:
        new = graph.call_function(target, args)  # type: ignore[arg-type]
        new.meta["val"] = value
        return new

    with graph.inserting_before(root):
        a = _concat_lhs(a_args, add)
        b = add(aten.cat.default, (b_args, 0), torch.cat([n.meta["val"] for n in b_args], 0))
        out = add(aten.mm.default, (a, b), torch.mm(a.meta["val"], b.meta["val"]))
        shape = root.meta["val"].shape
        if tuple(out.meta["val"].shape) != tuple(shape):
            out = add(aten.reshape.default, (out, list(shape)), out.meta["val"].reshape(shape))
    root.replace_all_uses_with(out)


def _concat_lhs(lhs: list, add: Any) -> torch.fx.Node:
    """cat(A_i, dim 1). Where each A_i is a reshape to 2-D of an activation gradient (batch, seq, K_i), those are
    concatenated on their last dimension and reshaped once: micro-pipeline TP recognizes reshape -> mm -> reshape,
    not cat -> mm."""
    sources = [a.args[0] if a.target is aten.reshape.default else None for a in lhs]
    leading = {tuple(src.meta["val"].shape[:-1]) if src is not None else None for src in sources}
    if None in leading or len(leading) != 1 or len(next(iter(leading))) < 2:
        return add(aten.cat.default, (lhs, 1), torch.cat([a.meta["val"] for a in lhs], 1))
    joined = add(aten.cat.default, (sources, -1), torch.cat([src.meta["val"] for src in sources], -1))
    rows = joined.meta["val"].shape
    return add(aten.reshape.default, (joined, [-1, rows[-1]]), joined.meta["val"].reshape(-1, rows[-1]))
