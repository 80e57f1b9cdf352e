"""benchmarks/vs_torchtitan.py, one short round of FSDP 2: torchtitan's own Trainer runs on CPU ranks through
tests/torchtitan_trainer.py; both trainers' logs give their tokens/s, memory and losses, and one step of
each its kernels (benchmarks/count_kernels.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks import vs_torchtitan


def test_torchtitans_trainer_and_this_recipe_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "vs_torchtitan.json"
    assert vs_torchtitan.main(["--out", str(out), "--rounds", "1", "--steps", "3", "--layouts", "fsdp2"]) == 0
    fsdp2 = json.loads(out.read_text())["results"]["fsdp2"]
    assert fsdp2["recipe_tps"] > 0 and fsdp2["torchtitan_tps"] > 0 and fsdp2["ratio_min"] == fsdp2["ratio_max"]
    # One TOML, one model and data source: both start near ln(2048) = 7.6 and learn at the same pace.
    first, last = fsdp2["recipe_losses"], fsdp2["torchtitan_losses"]
    assert all(7.0 < loss < 8.5 and math.isfinite(loss) for loss in first + last)
    assert abs(first[-1] - last[-1]) < 0.2, (first, last)
    rows = vs_torchtitan.rows(json.loads(out.read_text())["results"])
    assert [(r.problem, r.broken, r.fixed, r.unit) for r in rows] == [
        ("vs torchtitan", "torchtitan 0.2.2", "this recipe", "tok/s"),
        ("vs torchtitan", "torchtitan 0.2.2", "this recipe", "ops"),
        ("vs torchtitan", "torchtitan 0.2.2", "this recipe", "GiB"),
    ]
    # Kernels per eager step (rank 0, one untimed step), op by op (docs/benchmarks.md): no more than torchtitan's.
    # RoPE was the difference: a roll, two muls and an add per rotation each way when written out, against
    # one complex mul forward in torchtitan (interleaved rows); models/rope.py now copies each pair together
    # once (30 clones: 18 rotations forward, recomputation included, 12 backward) and multiplies it as a complex
    # number, where torchtitan copies the conjugate angles in backward (12 clones).
    more, fewer = fsdp2["kernels_more_here"], fsdp2["kernels_fewer_here"]
    assert sum(more.values()) - sum(fewer.values()) == fsdp2["recipe_kernels"] - fsdp2["torchtitan_kernels"] < 0
    assert not {"aten::roll", "aten::neg", "aten::cat"} & set(more), more
    assert more["aten::clone"] == 30 + 1 - 12, more  # + 1: one clone elsewhere in this recipe's step
    assert rows[1].metric == "kernels per eager step (ops dispatched but views, step 2), FSDP 2"
    ratio = fsdp2["recipe_tps"] / fsdp2["torchtitan_tps"]  # one round: the per-round ratio is the ratio
    assert rows[0].metric == f"tokens/s per device, FSDP 2; per round {ratio:.3f}x ({ratio:.3f}-{ratio:.3f})"


def test_a_compiled_step_is_counted_as_its_launches(tmp_path: Path) -> None:
    """count_kernels on a compiled step (benchmarks/count_kernels.py, `_profiled`): each kernel inductor generated
    once per call, each op outside them once (the matmuls inductor leaves to aten), nothing nested inside an op or a
    view."""
    import torch
    import torch._inductor.config

    from benchmarks.count_kernels import _profiled

    def step(x: torch.Tensor, w: torch.Tensor) -> None:
        (torch.nn.functional.silu(x @ w) * 2 + 1).sum().backward()

    x, w = torch.randn(64, 64), torch.randn(64, 64, requires_grad=True)
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        compiled = torch.compile(step)
        compiled(x, w)  # compiles
        _, counts = _profiled(compiled, x, w)
    # The forward's matmul and fused kernel; backward's seed (ones), fused kernel, matmul and accumulation into w.grad.
    expected = {"aten::mm": 2, "inductor::generated": 2, "aten::ones_like": 1, "aten::add_": 1}
    assert counts == {"kernels": 6, "views": 0, "by_op": expected}, counts
