"""float8 (parallelisms/float8.py) on CPU with `emulate = true`: the same float8 casts and scales, the
matmuls in high precision. What runs: which modules convert, that each recipe trains close to the
high-precision run, FSDP with the float8 all-gather and precomputed scales, checkpoints across
float8 and bf16 runs, and the refusals where float8 cannot run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from config import QuantizeLinearFloat8
from errors import ConfigError
from models.llama3 import FLAVORS, Transformer
from parallelisms.float8 import apply_float8, float8_problems
from tests.conftest import TINY, losses
from tests.launch import torchrun, two_at_a_time
from tests.parity_worker import TINY as TINY_ARGS
from tests.parity_worker import build_tiny, random_batch, train

EMULATE = QuantizeLinearFloat8(emulate=True)
FLOAT8 = ["--model.converters=quantize.linear.float8", "--quantize.linear.float8.emulate"]
CPU = torch.device("cpu")


def test_converted_modules_and_names() -> None:
    """The block linears whose dims are multiples of 16 convert; the output projection is filtered by
    default; the parameter names (hence checkpoints) do not change."""
    args = dataclasses.replace(TINY_ARGS, dim=48, n_heads=4, n_kv_heads=2)  # head_dim 12: wk, wv are 48 -> 24
    with torch.device("meta"):
        plain, model = Transformer(args), Transformer(args)
    converted = apply_float8(model, EMULATE, device=CPU, fsdp_sharded=False)
    blocks = [f"layers.{i}.{name}" for i in range(args.n_layers) for name in
              ("attention.wq", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]  # fmt: skip
    assert converted == blocks
    assert type(model.output) is nn.Linear and type(model.layers["0"].attention.wk) is nn.Linear
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the weights stay high precision
    everything = apply_float8(
        Transformer(TINY_ARGS), dataclasses.replace(EMULATE, filter_fqns=[]), device=CPU, fsdp_sharded=False
    )
    assert "output" in everything


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_each_recipe_trains_close_to_high_precision(recipe: str) -> None:
    """10 AdamW steps of the tiny model: float8 within 1e-3 relative of fp32 at every step (measured:
    1.8e-4 tensorwise, 8.7e-5 rowwise), yet not equal to it (the casts are real)."""
    tokens = random_batch()
    reference, _ = train(build_tiny(), tokens, steps=10)
    model = build_tiny()
    apply_float8(model, dataclasses.replace(EMULATE, recipe_name=recipe), device=CPU, fsdp_sharded=False)
    got, _ = train(model, tokens, steps=10)
    assert got[-1] < got[0] - 0.5
    rel = [abs(a - b) / b for a, b in zip(got, reference, strict=True)]
    assert max(rel) < 1e-3 and max(rel) > 1e-6, rel


def test_float8_is_refused_where_it_cannot_run() -> None:
    (problem,) = float8_problems(QuantizeLinearFloat8(), device=CPU)
    assert problem == "float8 matmuls need a CUDA GPU of compute capability 8.9 or more, and this runs on cpu"
    with pytest.raises(ConfigError) as e:
        apply_float8(build_tiny(), QuantizeLinearFloat8(), device=CPU, fsdp_sharded=False)
    assert str(e.value).endswith(
        "remove quantize.linear.float8 (or set quantize.linear.float8.emulate = true to test it in high precision)"
    )
    assert float8_problems(EMULATE, device=CPU) == []


def test_fsdp_float8_all_gather_trains_and_checkpoints_cross_with_bf16(tmp_path: Path, seed: Path) -> None:
    """2 ranks, FSDP, bf16 params: tensorwise float8 with the float8 all-gather and precomputed scales
    trains like the bf16 run; its checkpoint resumes in a bf16 run and a bf16
    checkpoint in a float8 run (the same high-precision weights under the same names)."""
    common = (
        *TINY,
        "--training.mixed_precision_param=bfloat16",
        "--checkpoint.enable",
        "--checkpoint.interval=3",
        f"--checkpoint.initial_load_path={seed}",
        "--training.steps=6",
    )
    all_gather = ["--quantize.linear.float8.enable_fsdp_float8_all_gather",
                  "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]  # fmt: skip
    bf16, f8 = tmp_path / "bf16", tmp_path / "float8"
    _, proc = two_at_a_time(
        lambda: torchrun("train.py", *common, f"--job.dump_folder={bf16}", nproc=2),
        lambda: torchrun(
            "train.py",
            *common,
            *FLOAT8,
            *all_gather,
            f"--job.dump_folder={f8}",
            "--training.steps=3",
            "--model.print_after_conversion",
            nproc=2,
        ),
    )
    assert proc.stdout.count("Float8Linear(") == 7 * FLAVORS["debugmodel"].n_layers  # every block linear, printed once
    # The float8 checkpoint of step 3 resumes without float8 ...
    torchrun("train.py", *common, f"--job.dump_folder={f8}", nproc=2)
    ref, got = losses(bf16), losses(f8)
    assert sorted(got) == list(range(1, 7))
    rel = [abs(got[s] - ref[s]) / ref[s] for s in sorted(ref)]
    # Step 1 runs the same weights: the casts alone (measured 4.8e-5). Later steps follow another
    # trajectory: lr 3e-3 on 256 tokens a step amplifies any difference (measured up to 7.6%).
    assert rel[0] < 1e-3 and max(rel) < 0.15, rel
    assert got[6] < got[1] - 0.5 and got[3] < got[1]
    # ... and bf16's checkpoint of step 6 resumes with float8, all-gather and precompute on.
    torchrun("train.py", *common, *FLOAT8, *all_gather, f"--job.dump_folder={bf16}", "--training.steps=7", nproc=2)
    assert sorted(losses(bf16)) == list(range(1, 8))


def test_float8_tp_styles_replace_the_plain_ones_where_the_linears_are_float8() -> None:
    """On NCCL, tensorwise float8 under TP all-gathers float8 activations. gloo has no float8 dtype (the
    CPU runs keep the plain plan), so what is checked here is the mapping itself."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from parallelisms.float8 import adapt_tp_plan

    with torch.device("meta"):
        model = Transformer(TINY_ARGS)
    apply_float8(model, EMULATE, device=CPU, fsdp_sharded=False)
    plan = {
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(use_local_output=False),  # non-default arguments: kept
        "attention.wk": ColwiseParallel(input_layouts=Shard(1)),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    adapted = adapt_tp_plan(model.layers["0"], plan)
    assert type(adapted["attention"]) is PrepareFloat8ModuleInput
    assert adapted["attention"].desired_input_layouts == (Replicate(), None, None)
    assert [type(adapted[f"attention.{w}"]) for w in ("wq", "wk", "wo")] == [
        Float8ColwiseParallel, Float8ColwiseParallel, Float8RowwiseParallel
    ]  # fmt: skip
    # Every argument of the style replaced, whatever it is: the same attributes, the same values.
    assert all(vars(adapted[fqn]) == vars(plan[fqn]) for fqn in ("attention.wq", "attention.wk", "attention.wo"))
    assert adapted["attention.wq"].use_local_output is False and adapted["attention.wo"].output_layouts == (Shard(1),)
    # A block left in high precision keeps the plain styles.
    with torch.device("meta"):
        plain = Transformer(TINY_ARGS)
    assert all(type(adapt_tp_plan(plain.layers["0"], plan)[k]) is type(v) for k, v in plan.items())


@pytest.mark.parametrize(
    ("recipe", "sharded", "hooks"), [("tensorwise", True, 1), ("tensorwise", False, 0), ("rowwise", True, 0)]
)
def test_scales_are_precomputed_only_where_the_float8_all_gather_is_on(recipe: str, sharded: bool, hooks: int) -> None:
    from parallelisms.float8 import precompute_scales_after_each_step

    model = build_tiny()
    cfg = dataclasses.replace(EMULATE, recipe_name=recipe, enable_fsdp_float8_all_gather=recipe == "tensorwise")
    apply_float8(model, cfg, device=CPU, fsdp_sharded=sharded)
    optimizer = torch.optim.AdamW(model.parameters())
    precompute_scales_after_each_step(optimizer, model)
    assert len(optimizer._optimizer_step_post_hooks) == hooks
