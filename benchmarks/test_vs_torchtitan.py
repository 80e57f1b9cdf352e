"""benchmarks/vs_torchtitan.py, one short round of FSDP 2: torchtitan's own Trainer runs on CPU ranks through
tests/torchtitan_trainer.py; both trainers' logs give their tokens/s, memory and losses, and one step of
each its kernels (benchmarks/count_kernels.py), a compiled one its kernels' times too; the busy shape (`--shape busy`, a
GPU's run) reaching both trainers as one model, checked on the meta device; and the layouts that give each trainer its
own arguments (this recipe's auto AC), whose shared run runs once a round."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import vs_torchtitan
from tests.torchtitan_trainer import user_folder


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
    # one complex mul forward in torchtitan (interleaved rows); models/rope.py gathers the pairs of q and k
    # together in one cat and multiplies them as complex numbers: 9 forwards of a block (3 of them AC's
    # recomputation) x (cat, a mul for q and one for k: each its own storage), 6 backwards x (cat, one mul, a copy
    # back for q and one for k). torchtitan multiplies q and k apart both ways (6 muls more in backward) and copies
    # each conjugate angle in backward (12 clones).
    more, fewer = fsdp2["kernels_more_here"], fsdp2["kernels_fewer_here"]
    assert sum(more.values()) - sum(fewer.values()) == fsdp2["recipe_kernels"] - fsdp2["torchtitan_kernels"] < 0
    assert not {"aten::roll", "aten::neg"} & set(more), more
    assert more["aten::cat"] == 9 + 6 and fewer["aten::mul.Tensor"] >= 6, (more, fewer)
    assert more["aten::clone"] == 12 + 1 - 12, more  # + 1: one clone elsewhere in this recipe's step
    assert rows[1].metric == "kernels per eager step (ops dispatched but views, step 2), FSDP 2"
    ratio = fsdp2["recipe_tps"] / fsdp2["torchtitan_tps"]  # one round: the per-round ratio is the ratio
    assert rows[0].metric == f"tokens/s per device, FSDP 2; per round {ratio:.3f}x ({ratio:.3f}-{ratio:.3f})"


def test_a_compiled_step_is_counted_as_its_launches(tmp_path: Path) -> None:
    """count_kernels on a compiled step (benchmarks/count_kernels.py, `_profiled`): each kernel inductor generated
    once per call, each op outside them once (the matmuls inductor leaves to aten), nothing nested inside an op or a
    view. Where its time goes: on CPU each of those launches' CPU time, by kind and the top ones; and what
    vs_torchtitan makes of two such profiles (`compare`, its rows and table)."""
    import torch
    import torch._inductor.config

    from benchmarks.count_kernels import TOP, _profiled

    def step(x: torch.Tensor, w: torch.Tensor) -> None:
        (torch.nn.functional.silu(x @ w) * 2 + 1).sum().backward()

    x, w = torch.randn(64, 64), torch.randn(64, 64, requires_grad=True)
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        compiled = torch.compile(step)
        compiled(x, w)  # compiles
        _, counts = _profiled(compiled, x, w)
    # The forward's matmul and fused kernel; backward's seed (ones), fused kernel, matmul and accumulation into w.grad.
    expected = {"aten::mm": 2, "inductor::generated": 2, "aten::ones_like": 1, "aten::add_": 1}
    profile = counts.pop("profile")
    assert counts == {"kernels": 6, "views": 0, "by_op": expected}, counts
    # The same launches timed: the matmuls together, each generated kernel by its own name.
    calls = {k["name"]: k["count"] for k in profile["top"]}
    generated = [name for name in calls if "cpp_fused" in name]
    assert len(generated) == 2 and all(calls[name] == 1 for name in generated), calls
    others = {name: n for name, n in calls.items() if name not in generated}
    assert others == {"aten::mm": 2, "aten::ones_like": 1, "aten::add_": 1}, others
    assert len(profile["top"]) <= TOP and profile["device"] == "cpu"
    assert [k["ms"] for k in profile["top"]] == sorted((k["ms"] for k in profile["top"]), reverse=True)
    assert all(k["share"] == pytest.approx(k["ms"] / profile["step_ms"]) for k in profile["top"])
    assert set(profile["by_kind"]) == {"matmul", "generated", "other"}
    assert sum(profile["by_kind"].values()) == pytest.approx(profile["kernels_ms"])
    assert 0 < profile["kernels_ms"] <= profile["step_ms"]

    # Two such profiles side by side, as vs_torchtitan's results, rows and table give them.
    run = {"tps": 100.0, "mfu": None, "memory_gib": 1.0, "losses": [7.6], "kernels": counts | {"profile": profile}}
    layout = "fsdp2_compile_auto"
    choice = "blocks no AC 0-1; estimated peak 1.2 GiB of the 64.0 GiB budget"  # as train.py prints it
    result = vs_torchtitan.compare(layout, {"recipe": [run | {"ac_choice": choice}], "torchtitan": [run]})
    assert result["recipe_profile"] == result["torchtitan_profile"] == profile
    assert result["own_args"] == vs_torchtitan.OWN_ARGS[layout] and result["recipe_ac_choice"] == choice
    results = {"device": "cpu", "nproc": 1, "rounds": 1, layout: result}
    # The estimate auto chose by, beside the peak the run measured: the estimator's error for the chosen blocks.
    (error,) = [r for r in vs_torchtitan.rows(results) if r.metric.startswith("auto AC's estimated peak")]
    assert (error.broken_value, error.fixed_value) == (1.2, 1.0)
    timed = [r for r in vs_torchtitan.rows(results) if r.unit == "ms"]
    name = "FSDP 1 + compile, auto AC vs torchtitan's op SAC"
    assert [r.metric for r in timed] == [
        f"CPU time in the profiled step 2, {kind} kernels, {name}" for kind in ("all", "matmul", "generated", "other")
    ]
    assert timed[0].fixed_value == timed[0].broken_value == profile["kernels_ms"]
    table = vs_torchtitan.table(results)
    assert f"this recipe's auto AC: {choice}" in table and f"where the time goes, {name}:" in table
    assert table.count("aten::mm\n") == 2 and table.count(f"top {len(profile['top'])} by time:") == 2


@pytest.mark.parametrize("rehearse", [False, True], ids=["busy", "rehearsal"])
def test_the_busy_shape_is_one_model_in_both_trainers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rehearse: bool
) -> None:
    """`--shape busy`: this recipe reads the shape from the config.json the harness writes (model.shape_from_hf_config),
    torchtitan from the flavor the harness registers in its own Llama 3 registry (tests/torchtitan_trainer.py,
    FLAVORS_ENV) and names with --model.flavor: the same parameters, counted on the meta device, with the arguments and
    environment each trainer gets."""
    import json

    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.qwen3 import qwen3_args
    from torchtitan.protocols.train_spec import get_train_spec

    from config import load_config, run_model_args
    from models import family
    from tests.torchtitan_trainer import FLAVORS_ENV, register_flavors, user_folder

    shape = vs_torchtitan.shape_of("busy", cuda=True, rehearse=rehearse)
    folder = user_folder(tmp_path)
    shape.prepare(folder)
    monkeypatch.chdir(folder)
    layout = "fsdp2_compile_full_ac"
    ours = run_model_args(
        load_config(vs_torchtitan.trainer_args("recipe", layout, folder=folder, steps=3, shape=shape))
    )
    titans_argv = vs_torchtitan.trainer_args("torchtitan", layout, folder=folder, steps=3, shape=shape)
    (flavor,) = [a.removeprefix("--model.flavor=") for a in titans_argv if a.startswith("--model.flavor=")]
    assert "--activation_checkpoint.mode=full" in titans_argv
    assert f"--training.seq_len={64 if rehearse else 4096}" in titans_argv
    monkeypatch.setitem(llama3_args, flavor, None)  # put back as they were after the test
    monkeypatch.setitem(qwen3_args, vs_torchtitan.MOE_FLAVOR, None)
    register_flavors(json.loads(shape.env()[FLAVORS_ENV]))
    theirs = get_train_spec("llama3").model_args[flavor]
    with torch.device("meta"):
        n_ours = sum(p.numel() for p in family("llama3").model_cls(ours).parameters())
        n_theirs = sum(p.numel() for p in get_train_spec("llama3").model_cls(theirs).parameters())
    # Llama 3 8B: 218,112,000 per block (attention 41.9M, SwiGLU 176.2M, 2 norms), 2 x 525.3M embedding and output;
    # the rehearsal's dim 64 block: 61,568.
    expected = 2 * 128256 * 64 + 2 * 61_568 + 64 if rehearse else 2 * 128256 * 4096 + 6 * 218_112_000 + 4096
    assert n_ours == n_theirs == family("llama3").num_params(shape.model) == expected, (n_ours, n_theirs)
    assert (ours.vocab_size, theirs.vocab_size, ours.hidden_dim) == (128256, 128256, 256 if rehearse else 14336)
    assert theirs.rope_theta == ours.rope_theta == 500000 and ours.rope_scaling.factor == 8.0
    assert not ours.tie_word_embeddings and (ours.n_heads, ours.n_kv_heads) == ((4, 2) if rehearse else (32, 8))


def test_a_layout_gives_each_trainer_its_own_arguments_and_a_shared_run_runs_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layouts where the two trainers differ (OWN_ARGS): this recipe's auto AC (with a budget on CPU ranks, none with
    a GPU: its default is 90% of the GPU's) against torchtitan's op SAC and its no AC; the other layouts give both the
    same. `schedule`: the auto run of this recipe, the same arguments in two layouts, runs once a round."""
    from config import load_config

    folder = user_folder(tmp_path)
    cpu = vs_torchtitan.shape_of("busy", cuda=False, rehearse=True)
    cpu.prepare(folder)
    monkeypatch.chdir(folder)
    gpu = vs_torchtitan.shape_of("busy", cuda=True, rehearse=False)
    assert (cpu.ac_budget_gib, gpu.ac_budget_gib) == (vs_torchtitan.CPU_AC_BUDGET_GIB, None)

    def args(trainer: str, layout: str, shape: vs_torchtitan.Shape) -> list[str]:
        return vs_torchtitan.trainer_args(trainer, layout, folder=folder, steps=3, shape=shape)

    budget = f"--activation_checkpoint.memory_budget_gib={vs_torchtitan.CPU_AC_BUDGET_GIB:g}"
    for layout in ("fsdp2_compile_auto", "fsdp2_compile_auto_vs_no_ac"):
        assert "--activation_checkpoint.mode=auto" in args("recipe", layout, gpu)
        assert budget in args("recipe", layout, cpu)
        assert not any("memory_budget" in a for a in args("recipe", layout, gpu))
        assert not any(
            a.startswith(("--activation_checkpoint.mode=auto", "--activation_checkpoint.memory_budget"))
            for a in args("torchtitan", layout, cpu)
        )
    assert "--activation_checkpoint.selective_ac_option=op" in args("torchtitan", "fsdp2_compile_auto", gpu)
    assert "--activation_checkpoint.mode=none" in args("torchtitan", "fsdp2_compile_auto_vs_no_ac", gpu)
    for layout in set(vs_torchtitan.DEFAULT_LAYOUTS) - vs_torchtitan.OWN_MODEL:  # the same overrides, no budget
        assert vs_torchtitan.layout_args(layout, "recipe") == vs_torchtitan.layout_args(layout, "torchtitan")
        assert not any("memory_budget" in a for a in args("recipe", layout, cpu))
    # This recipe reads its side: auto with the budget on CPU.
    ac = load_config(args("recipe", "fsdp2_compile_auto", cpu)).activation_checkpoint
    assert (ac.mode, ac.memory_budget_gib) == ("auto", vs_torchtitan.CPU_AC_BUDGET_GIB)

    layouts = ["fsdp2_compile_auto", "fsdp2_compile_auto_vs_no_ac", "fsdp2_compile_full_ac"]
    runs = vs_torchtitan.schedule(layouts, rounds=2)
    assert [(r, layout.removeprefix("fsdp2_compile_"), trainer[0], same) for r, layout, trainer, same in runs] == [
        (0, "auto", "r", None), (0, "auto", "t", None),
        (0, "auto_vs_no_ac", "r", "fsdp2_compile_auto"), (0, "auto_vs_no_ac", "t", None),
        (0, "full_ac", "r", None), (0, "full_ac", "t", None),
        (1, "auto", "t", None), (1, "auto", "r", None),  # the other trainer first in the next round
        (1, "auto_vs_no_ac", "t", None), (1, "auto_vs_no_ac", "r", "fsdp2_compile_auto"),
        (1, "full_ac", "t", None), (1, "full_ac", "r", None),
    ]  # fmt: skip


def test_a_rehearsal_of_the_busy_shape(tmp_path: Path) -> None:
    """What the GPU run's rehearsal does (`--shape busy --rehearse`), eager, in the GPU's bf16 (`--bf16`): the busy
    shape, tiny, reaches both trainers' processes (torchtitan's through FLAVORS_ENV: `run` checks the flavor and size
    its Trainer logs), one round of 3 steps at seq_len 64; MFU is a GPU's figure, n/a here. On one rank neither
    trainer applies FSDP (parallelisms/fsdp.py applies_fsdp): both train under autocast, and this recipe's step
    dispatches no more ops than torchtitan's."""
    out = tmp_path / "vs_torchtitan.json"
    argv = ["--shape", "busy", "--nproc", "1", "--layouts", "fsdp2", "--rounds", "3", "--rehearse", "--bf16"]
    assert vs_torchtitan.main([*argv, "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert (results["rounds"], results["steps"], results["seq_len"], results["nproc"]) == (1, 3, 64, 1)
    assert results["model"].startswith("Llama 3 8B block x 2 (dim 64") and results["rehearsal"]
    fsdp = results["fsdp2"]
    assert fsdp["recipe_mfu"] is None and fsdp["torchtitan_mfu"] is None
    # Both start near ln(128256) = 11.8 (the 8B's vocabulary; the shipped tokenizer's 2048 ids are all it sees).
    assert all(11.0 < loss < 13.0 for loss in fsdp["recipe_losses"] + fsdp["torchtitan_losses"])
    units = [r.unit for r in vs_torchtitan.rows(results)]
    assert units == ["tok/s", "ops", "GiB"]
    assert fsdp["recipe_kernels"] <= fsdp["torchtitan_kernels"], (fsdp["kernels_more_here"], fsdp["kernels_fewer_here"])
    # Memory is not compared here: on CPU both figures are the process's peak resident memory (ru_maxrss), at this
    # size mostly the interpreter and its libraries, and torchtitan's moved from 0.78 to 0.88 GiB between runs; a GPU
    # run compares the allocators' peaks (make bench-gpu).


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "gpu"])
def test_the_moe_layout_is_one_model_in_both_trainers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cuda: bool
) -> None:
    """`moe_fsdp2`: this recipe reads qwen3_moe's debugmodel, torchtitan (its own config parser, from the same argv but
    the model's name) its qwen3 model with the flavor the harness registers: the same parameters on the meta device,
    balancing off, and its experts as the loop over experts on CPU, its grouped matmuls on a GPU. The busy shape
    leaves the layout out."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.qwen3 import qwen3_args
    from torchtitan.protocols.train_spec import get_train_spec

    from config import load_config, run_model_args
    from models import family
    from tests.torchtitan_trainer import FLAVORS_ENV, register_flavors

    folder = user_folder(tmp_path)
    monkeypatch.chdir(folder)
    shape = vs_torchtitan.shape_of("debug", cuda=cuda, rehearse=False)
    layout = "moe_fsdp2"
    ours = load_config(vs_torchtitan.trainer_args("recipe", layout, folder=folder, steps=3, shape=shape))
    titans = ConfigManager().parse_args(vs_torchtitan.trainer_args("torchtitan", layout, folder=folder, steps=3,
                                                                   shape=shape))  # fmt: skip
    assert (ours.model.name, ours.model.flavor) == ("qwen3_moe", "debugmodel")
    assert (titans.model.name, titans.model.flavor) == ("qwen3", vs_torchtitan.MOE_FLAVOR)
    monkeypatch.setitem(qwen3_args, vs_torchtitan.MOE_FLAVOR, None)  # put back as it was after the test
    register_flavors(json.loads(shape.env()[FLAVORS_ENV]))
    spec = get_train_spec("qwen3")
    theirs = spec.model_args[vs_torchtitan.MOE_FLAVOR]
    assert (theirs.moe_args.use_grouped_mm, theirs.moe_args.load_balance_coeff) == (cuda, None)
    with torch.device("meta"):
        n_ours = sum(p.numel() for p in family("qwen3_moe").model_cls(run_model_args(ours)).parameters())
        n_theirs = sum(p.numel() for p in spec.model_cls(theirs).parameters())
    assert n_ours == n_theirs == family("qwen3_moe").num_params(run_model_args(ours)) == 5_777_920
    if not cuda:  # the busy shape names its model itself: the layout is left out, said so, nothing run
        out = tmp_path / "busy.json"
        argv = ["--shape", "busy", "--rehearse", "--nproc", "1", "--layouts", layout, "--out", str(out)]
        assert vs_torchtitan.main(argv) == 0
        assert layout not in json.loads(out.read_text())["results"]
        assert f"{layout}: left out, a layout with its own model is the debug shape's" in capsys.readouterr().out
