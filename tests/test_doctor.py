"""The recipe doctor: each check fires on its pitfall and stays quiet without it; shipped configs are
clean on the machines they are written for."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from config import JobConfig, load_config, resolve
from errors import ConfigError
from planning import doctor
from planning.doctor import Finding, Machine, check_recipe
from tests.conftest import Launch
from tests.launch import REPO

CPU = Machine(cuda=False, cpu_has_bf16=True, environ={})
GPUS = Machine(cuda=True, gpus_per_node=8, environ={})


def recipe(**keys: Any) -> JobConfig:
    """A clean CPU recipe (float32, one rank) with `section__key=value` changes."""
    cfg = JobConfig()
    cfg.training.mixed_precision_param = "float32"
    cfg.training.steps = 1  # inside one pass over the shipped corpus, even on many ranks
    for dotted, value in keys.items():
        section, key = dotted.split("__")
        assert hasattr(getattr(cfg, section), key), dotted
        setattr(getattr(cfg, section), key, value)
    resolve(cfg)  # the tokenizer and data that unset keys stand for, as load_config does
    return cfg


def check(cfg: JobConfig, *, world_size: int = 1, machine: Machine = CPU, **changes: Any) -> list[Finding]:
    return check_recipe(cfg, world_size=world_size, machine=Machine(**{**machine.__dict__, **changes}))


def keys(findings: list[Finding]) -> list[tuple[str, str]]:
    return [(f.severity, f.key) for f in findings]


def test_clean_recipe_has_no_findings_and_errors_come_first() -> None:
    assert check(recipe()) == []
    findings = check(
        recipe(training__mixed_precision_reduce="bfloat16", compile__enable=True), environ={"CXX": "no-cc"}
    )
    assert keys(findings) == [("error", "compile.enable"), ("warning", "training.mixed_precision_reduce")]
    assert str(findings[0]).startswith("error: compile.enable: inductor's CPU backend needs a C++ compiler")
    assert all("\n" not in f.message for f in findings)


def test_the_runs_layout_rule_is_reported_not_copied() -> None:
    # ParallelDims.from_config's own message, as the run would raise it.
    findings = check(recipe(parallelism__data_parallel_shard_degree=2), world_size=4)
    assert keys(findings) == [("error", "parallelism")]
    assert "but the world size is 4" in findings[0].message
    assert check(recipe(parallelism__data_parallel_shard_degree=2), world_size=2) == []


# ------------------------------------------------------------------ nodes (failure #3)


def test_hsdp_inside_one_node_is_a_warning() -> None:
    hsdp = recipe(parallelism__data_parallel_replicate_degree=2)
    assert keys(check(hsdp, world_size=8, machine=GPUS)) == [("warning", "parallelism.data_parallel_replicate_degree")]
    # Across 2 nodes of 8 with a shard group per node: what docs/failures.md #3 recommends.
    assert check(hsdp, world_size=16, machine=GPUS) == []
    # Unknown node size, or CPU ranks (pretend nodes): nothing to say.
    assert check(hsdp, world_size=8, machine=GPUS, gpus_per_node=None) == []
    assert check(hsdp, world_size=8, gpus_per_node=8) == []


def test_hsdp_shard_groups_that_are_not_one_node_are_a_warning() -> None:
    spans = recipe(parallelism__data_parallel_replicate_degree=2, parallelism__data_parallel_shard_degree=16)
    findings = check(spans, world_size=32, machine=GPUS)
    assert keys(findings) == [("warning", "parallelism.data_parallel_shard_degree")]
    assert "data_parallel_replicate_degree = 4, data_parallel_shard_degree = 8" in findings[0].message
    small = recipe(parallelism__data_parallel_replicate_degree=4, parallelism__data_parallel_shard_degree=2)
    assert keys(check(small, world_size=8, machine=GPUS, gpus_per_node=4)) == [
        ("warning", "parallelism.data_parallel_shard_degree")
    ]
    ok = recipe(parallelism__data_parallel_replicate_degree=2, parallelism__tensor_parallel_degree=4)
    assert check(ok, world_size=16, machine=GPUS) == []


def test_fsdp_across_nodes_suggests_hsdp_unless_tp_fills_the_node() -> None:
    findings = check(recipe(), world_size=16, machine=GPUS)
    assert keys(findings) == [("warning", "parallelism.data_parallel_replicate_degree")]
    assert "data_parallel_replicate_degree = 2, data_parallel_shard_degree = 8" in findings[0].message
    assert check(recipe(), world_size=8, machine=GPUS) == []
    # TP 8 fills each node: the FSDP groups must cross nodes, HSDP would leave nothing to shard.
    assert check(recipe(parallelism__tensor_parallel_degree=8), world_size=64, machine=GPUS) == []


def test_tp_group_across_nodes_is_a_warning() -> None:
    tp4 = recipe(parallelism__tensor_parallel_degree=4, training__seq_len=256)
    for world, per_node in [(8, 2), (24, 6)]:  # TP larger than a node; TP groups straddling two nodes
        findings = check(tp4, world_size=world, machine=GPUS, gpus_per_node=per_node)
        assert keys(findings) == [("warning", "parallelism.tensor_parallel_degree")]
    # TP 4 inside nodes of 8, FSDP across 2 nodes: only the HSDP suggestion remains.
    assert keys(check(tp4, world_size=16, machine=GPUS)) == [("warning", "parallelism.data_parallel_replicate_degree")]


def test_cp_groups_stay_inside_a_node_and_count_in_the_shard_group() -> None:
    cp16 = recipe(parallelism__context_parallel_degree=16, training__seq_len=8192)
    findings = check(cp16, world_size=16, machine=GPUS)
    assert keys(findings) == [("warning", "parallelism.context_parallel_degree")]
    assert "all-gather of keys and values crosses the inter-node link" in findings[0].message
    # CP 8 fills each node: the shard group (dp_shard 1 x cp 8) is a node, the replicas span nodes.
    long = recipe(
        parallelism__context_parallel_degree=8,
        parallelism__data_parallel_replicate_degree=2,
        parallelism__data_parallel_shard_degree=1,
        training__seq_len=8192,
    )
    assert check(long, world_size=16, machine=GPUS) == []


def test_gpus_per_node_comes_from_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert Machine.this(cuda=True, device_memory_gib=80).gpus_per_node == 8


# ------------------------------------------------------- precision, toolchain, offload


def test_bf16_on_a_cpu_without_bf16_instructions_is_a_warning() -> None:
    bf16 = recipe(training__mixed_precision_param="bfloat16")
    assert keys(check(bf16, cpu_has_bf16=False)) == [("warning", "training.mixed_precision_param")]
    assert check(bf16, cpu_has_bf16=True) == []  # AVX512-BF16 / AMX: bf16 is the faster one
    assert check(bf16, machine=GPUS, cpu_has_bf16=False) == []


def test_bf16_gradient_reduction_is_a_warning() -> None:
    reduce_bf16 = recipe(training__mixed_precision_reduce="bfloat16")
    assert keys(check(reduce_bf16)) == [("warning", "training.mixed_precision_reduce")]


def test_compile_needs_a_cxx_compiler_on_cpu() -> None:
    cfg = recipe(compile__enable=True)
    assert keys(check(cfg, environ={"CXX": "/nonexistent/c++"})) == [("error", "compile.enable")]
    assert check(cfg, machine=GPUS, environ={"CXX": "/nonexistent/c++"}) == []
    if shutil.which("g++"):
        assert check(cfg) == []


def test_deterministic_compile_on_cuda_is_a_warning() -> None:
    cfg = recipe(debug__deterministic=True, compile__enable=True)
    assert keys(check(cfg, machine=GPUS)) == [("warning", "debug.deterministic")]
    assert check(cfg, machine=GPUS, environ={"TORCHINDUCTOR_DETERMINISTIC": "1"}) == []
    assert check(recipe(debug__deterministic=True), machine=GPUS) == []


def test_rowwise_float8_under_async_tp_is_a_warning() -> None:
    def findings(recipe_name: str | None, *, async_tp: bool = True) -> list[Finding]:
        cfg = recipe(
            model__converters=["quantize.linear.float8"],
            parallelism__tensor_parallel_degree=2,
            parallelism__enable_async_tensor_parallel=async_tp,
            compile__enable=True,
        )
        cfg.quantize.linear.float8.recipe_name = recipe_name
        return check(cfg, world_size=2, machine=GPUS)

    for name in ("rowwise", "rowwise_with_gw_hp"):
        (found,) = [f for f in findings(name) if f.key == "quantize.linear.float8.recipe_name"]
        assert found.severity == "warning" and "pytorch/pytorch#149990" in found.message, found
    for quiet in (findings("tensorwise"), findings(None), findings("rowwise", async_tp=False)):
        assert "quantize.linear.float8.recipe_name" not in [f.key for f in quiet], quiet


def test_cpu_offload_without_cuda_is_a_warning() -> None:
    offload = recipe(training__enable_cpu_offload=True)
    assert keys(check(offload)) == [("warning", "training.enable_cpu_offload")]
    assert check(offload, machine=GPUS) == []


# ----------------------------------------------------------------------- memory


def llama3_8b(stand_ins: tuple[Path, Path]) -> list[str]:
    """configs/llama3_8b.toml with stand-ins for the tokenizer and corpus it downloads and prepares."""
    tokenizer, corpus = stand_ins
    return ["--config", "configs/llama3_8b.toml", f"--model.tokenizer_path={tokenizer}", f"--data.path={corpus}"]


def test_8b_does_not_fit_this_24_gib_cpu_machine(llama3_stand_ins: tuple[Path, Path]) -> None:
    """The issue's case: llama3_8b on one CPU process of a 24 GiB machine is flagged before allocation."""
    cfg = load_config(llama3_8b(llama3_stand_ins))
    findings = check(cfg, device_memory_gib=24.0)
    assert keys(findings) == [("error", "memory")]
    # 16 bytes of state per parameter alone: 8.03e9 x 16 B = 120 GiB on one rank.
    need = float(findings[0].message.split("about ")[1].split(" GiB")[0])
    assert 120 < need < 200, findings[0].message
    assert "24.0 GiB of host memory shared by 1 rank(s)" in findings[0].message
    # Two ranks share the same host memory: still far too much.
    two = recipe(model__flavor="llama3_8b", training__seq_len=512, training__local_batch_size=1)
    two.model.tokenizer_path = str(llama3_stand_ins[0])
    assert keys(check(two, world_size=2, device_memory_gib=24.0)) == [("error", "memory")]


def test_train_py_stops_8b_on_this_machine_before_allocating(
    tmp_path: Path, llama3_stand_ins: tuple[Path, Path]
) -> None:
    """The command users type, from another folder: one line, exit 2, nothing written, in seconds."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            *llama3_8b(llama3_stand_ins)[:1],
            "llama3_8b.toml",
            *llama3_8b(llama3_stand_ins)[2:],
        ],  # fmt: skip
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors[0].startswith("error: memory: the job needs about") and "GiB per rank" in errors[0]
    assert not (tmp_path / "outputs").exists()
    # docs/planning.md quotes this line: the estimate it shows is today's.
    quoted = re.search(r"error: memory: the job needs about ([\d.]+) GiB", (REPO / "docs" / "planning.md").read_text())
    assert quoted and f"needs about {quoted[1]} GiB per rank" in errors[0], errors[0]


def test_memory_fit_on_gpus(llama3_stand_ins: tuple[Path, Path]) -> None:
    cfg = load_config(llama3_8b(llama3_stand_ins))
    assert check(cfg, world_size=8, machine=GPUS, device_memory_gib=80.0) == []
    # The same job without activation checkpointing at batch 4: tens of GiB of saved activations more.
    cfg.activation_checkpoint.mode, cfg.training.local_batch_size = "none", 4
    findings = check(cfg, world_size=8, machine=GPUS, device_memory_gib=80.0)
    assert keys(findings) == [("error", "memory")] and "one GPU's 80 GiB" in findings[0].message


def test_a_teacher_counts_in_the_memory_check(llama3_stand_ins: tuple[Path, Path]) -> None:
    """[distill]: configs/llama3_8b.toml fits 8 GPUs of 80 GiB; with Llama 3 70B as its teacher it does not, its
    frozen fp32 shards alone 4 B x 70.6e9 / 8 = 33 GiB a rank (planning/memory.py counts its terms)."""
    from planning.job import Job
    from planning.memory import estimate

    cfg = load_config(llama3_8b(llama3_stand_ins))
    plain = estimate(Job.of(cfg, GPUS, world_size=8))
    cfg.distill = dataclasses.replace(cfg.distill, enable=True, teacher_path="step-0", teacher_flavor="llama3_70b")
    findings = check(cfg, world_size=8, machine=GPUS, device_memory_gib=80.0)
    assert keys(findings) == [("error", "memory")] and "one GPU's 80 GiB" in findings[0].message
    need = float(findings[0].message.split("about ")[1].split(" GiB")[0])
    assert need > plain["total"] / 2**30 + 4 * 70.55e9 / 8 / 2**30, (need, plain["total"])


def test_the_debug_model_fits() -> None:
    cfg = load_config(["--config", "configs/debug.toml"])
    assert check(cfg, world_size=2, device_memory_gib=4.0) == []


# ------------------------------------------------------------------ expert parallel


def moe(**keys: Any) -> JobConfig:
    """recipe() of the Qwen3 MoE debug model (8 experts, 2 per token; 8 x 2048 tokens a rank)."""
    return recipe(model__name="qwen3_moe", model__flavor="debugmodel", **keys)


def test_expert_parallel_groups_across_nodes_are_a_warning() -> None:
    """Expert parallel's groups are consecutive ranks: on nodes of 4 GPUs, ep 8 sends every MoE block's all-to-alls
    over the inter-node link, ep 4 and 2 keep them in a node. CPU ranks (pretend nodes): nothing to say."""
    ep = ("warning", "parallelism.expert_parallel_degree")
    nodes_of_4 = dict(machine=GPUS, gpus_per_node=4)
    across = check(moe(parallelism__expert_parallel_degree=8), world_size=8, **nodes_of_4)
    (finding,) = [f for f in across if (f.severity, f.key) == ep]
    assert finding.message.startswith("expert-parallel groups of 8 ranks cross the nodes of 4 GPUs, so every MoE")
    assert "use a divisor of 4" in finding.message
    for degree in (4, 2):
        assert ep not in keys(check(moe(parallelism__expert_parallel_degree=degree), world_size=8, **nodes_of_4))
    assert ep not in keys(check(moe(parallelism__expert_parallel_degree=8), world_size=8, gpus_per_node=4))


def test_routing_beyond_what_a_rank_has_room_for_is_a_warning() -> None:
    """No token is dropped under expert parallel: a rank that routing sends its whole ep group's rows holds them all.
    Where balanced routing fits and that does not, a warning says how far from balanced routing may go (the largest
    Job.ep_load that fits, to a tenth); where even that fits, nothing; where balanced routing does not fit, the
    memory error alone. Two CPU ranks share the host's memory."""
    from planning.job import CPU, Job
    from planning.memory import GiB, estimate

    cfg = moe(parallelism__expert_parallel_degree=2)
    job = Job.of(cfg, CPU, world_size=2)
    total = lambda load: estimate(dataclasses.replace(job, ep_load=load))["total"] / GiB  # noqa: E731
    balanced, worst = total(1.0), total(2.0)
    have = (balanced + worst) / 2  # a rank's share of the host
    (finding,) = check(cfg, world_size=2, device_memory_gib=2 * have)
    assert (finding.severity, finding.key) == ("warning", "parallelism.expert_parallel_degree")
    assert finding.message.startswith(
        f"no token is dropped (no capacity factor), so a rank holds what routing sends its experts: about "
        f"{balanced:.1f} GiB balanced, {worst:.1f} GiB with all 2 ranks' tokens x top_k on its experts"
    )
    room = float(re.search(r"room for ([\d.]+)x the balanced rows", finding.message)[1])
    assert total(room - 0.1) <= have < total(room + 0.2)  # the bisection's tenth, rounded
    assert "model.moe.router_aux_loss_coef" in finding.message and "\n" not in finding.message
    assert check(cfg, world_size=2, device_memory_gib=2 * worst + 0.1) == []
    assert keys(check(cfg, world_size=2, device_memory_gib=2 * balanced - 0.1)) == [("error", "memory")]


# ------------------------------------------------------------------------- data


def test_a_run_that_repeats_its_corpus_is_a_warning() -> None:
    # 628,705 tokens shipped; 100 steps x 8 x 2049 = 1.6M tokens is 2.6 epochs: fine; 10x that is not.
    assert check(recipe(training__steps=100)) == []
    findings = check(recipe(training__steps=1000))
    assert keys(findings) == [("warning", "data.path")]
    message = findings[0].message.replace(f"{REPO}/", "")
    assert "from assets/corpus/stories.jsonl, a corpus of 628,705: 26 epochs" in message


def test_a_mixture_warns_of_the_source_it_repeats(tmp_path: Path) -> None:
    for name, tokens in (("big", 10**9), ("small", 100_000)):  # prepared folders, as far as their size goes
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(f'{{"tokens": {tokens}}}')
    mixture = {"data__mixture": [str(tmp_path / "big"), str(tmp_path / "small")], "data__mixture_weights": [9, 1]}
    assert check(recipe(training__steps=100, **mixture)) == []  # the small source read 1.6 times
    (finding,) = check(recipe(training__steps=1000, **mixture))
    assert (finding.key, finding.message) == (
        "data.mixture",
        f"the run reads 1,639,200 tokens (10% of 1,000 steps x 8 x 2049) from {tmp_path / 'small'}, a corpus of "
        "100,000: 16 epochs; point data.mixture at more data or train fewer steps",
    )


def test_a_tokenizer_far_smaller_than_the_embedding_is_a_warning(llama3_stand_ins: tuple[Path, Path]) -> None:
    small = recipe(model__flavor="llama3_1b", training__seq_len=256)  # the shipped 2,048-token tokenizer
    findings = check(small, device_memory_gib=None)
    assert ("warning", "model.tokenizer_path") in keys(findings)
    assert "98% of the embedding and output rows are never trained" in findings[0].message
    tokenizer, corpus = llama3_stand_ins
    llama = recipe(model__flavor="llama3_1b", training__seq_len=256, model__tokenizer_path=str(tokenizer))
    llama.data.path = str(corpus)
    assert check(llama) == []


# ------------------------------------------------------------- shipped configs

# What the doctor says about a shipped config on its own machine, where that is not nothing.
EXPECTED = {
    # Shows what CPU offload would move off a GPU; on CPU ranks it only adds copies.
    "configs/fixes/5_memory.toml": [("warning", "training.enable_cpu_offload")],
}


def test_shipped_configs_have_no_findings_on_their_machines(shipped_config: tuple[str, Launch, list[str]]) -> None:
    path, launch, overrides = shipped_config
    cfg = load_config(["--config", path, *overrides])
    gpu = launch.gpus_per_node is not None
    machine = Machine(
        cuda=gpu,
        gpus_per_node=launch.gpus_per_node,
        cpu_has_bf16=True,
        device_memory_gib=80.0 if gpu else 24.0,
        environ={},
    )
    if cfg.compile.enable and not gpu and shutil.which("g++") is None:
        pytest.skip("inductor's CPU backend needs g++")
    findings = check_recipe(cfg, world_size=launch.world_size, machine=machine)
    assert keys(findings) == EXPECTED.get(path, []), "\n".join(map(str, findings))


# ----------------------------------------------------------------- entry points


def test_main_exit_codes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, llama3_stand_ins: tuple[Path, Path]
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert doctor.main(["--config", "configs/debug.toml", "--world-size", "2"]) == 0
    assert "no known pitfalls found" in capsys.readouterr().out
    assert doctor.main(["--config", "configs/debug.toml", "--training.mixed_precision_reduce=bfloat16"]) == 0
    assert "warning: training.mixed_precision_reduce: " in capsys.readouterr().out
    assert doctor.main([*llama3_8b(llama3_stand_ins), "--device-memory-gib=24"]) == 1
    assert "error: memory: " in capsys.readouterr().out
    args = ["--config", "configs/llama3_70b.toml", *llama3_8b(llama3_stand_ins)[2:], "--world-size=64",
            "--gpus-per-node=8", "--cuda"]  # fmt: skip
    assert doctor.main(args) == 0
    assert capsys.readouterr().out == "no known pitfalls found\n"
    # README.md's command, without the corpus and the tokenizer here: two notes, which are no pitfall, and it says so.
    assert doctor.main(["--config", "configs/llama3_70b.toml", "--world-size=64", "--gpus-per-node=8", "--cuda"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.partition(": ")[0] for line in out] == ["note", "note", "no known pitfalls found"], out
    assert doctor.main(["--config", "configs/debug.toml", "--training.stepz=3"]) == 2
    assert "error: training.stepz: unknown key" in capsys.readouterr().err
    assert doctor.main(["--config", "configs/debug.toml", "--world-size", "two"]) == 2
    assert capsys.readouterr().err == "error: --world-size: expected a positive integer, got 'two'\n"
    # Rules of the layout are the config's: exit 2, one line on stderr, nothing on stdout.
    assert (
        doctor.main(["--config", "configs/debug.toml", "--world-size", "3", "--parallelism.tensor_parallel_degree=2"])
        == 2
    )
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: parallelism:") and err.count("\n") == 1, err
    # A job planned for machines that have its files: what this one lacks are notes.
    assert doctor.main(["--config", "configs/llama3_70b.toml", "--world-size=64", "--gpus-per-node=8", "--cuda"]) == 0
    out = capsys.readouterr().out
    assert "note: data.path: data/fineweb-edu-10BT-llama3 not found" in out and "note: model.tokenizer_path: " in out


def test_startup_check_warns_on_rank_0_only_and_raises_errors(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setenv("RANK", "1")
    doctor.check_startup(recipe(training__mixed_precision_reduce="bfloat16"), world_size=1, device=cpu)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    doctor.check_startup(recipe(training__mixed_precision_reduce="bfloat16"), world_size=1, device=cpu)
    assert capsys.readouterr().err.startswith("warning: training.mixed_precision_reduce: ")
    with pytest.raises(ConfigError, match=r"^memory: the job needs about"):
        doctor.check_startup(recipe(model__flavor="llama3_70b", training__seq_len=256), world_size=1, device=cpu)


def test_deferred_reduce_scatters_say_what_they_hold(llama3_stand_ins: tuple[Path, Path]) -> None:
    """parallelism.fsdp_defer_reduce_scatter on Llama 3 8B, 8 GPUs, 8 micro-batches: a note with the float32
    gradients it holds (estimate_memory's accumulators: 4 B x 8.03B parameters = 29.9 GiB), and nothing without
    accumulation."""
    argv = [*llama3_8b(llama3_stand_ins), "--parallelism.fsdp_defer_reduce_scatter", "--training.global_batch_size=64"]
    findings = check(load_config(argv), world_size=8, machine=GPUS, device_memory_gib=80.0)
    assert keys(findings) == [("note", "parallelism.fsdp_defer_reduce_scatter")], findings
    assert "8 micro-batches reduce-scatter once per step, for 29.9 GiB per rank" in findings[0].message
    single = load_config([*argv[:-1], "--training.global_batch_size=8"])
    assert check(single, world_size=8, machine=GPUS, device_memory_gib=80.0) == []


def test_auto_ac_is_said_as_a_note_or_refused_as_an_error(llama3_stand_ins: tuple[Path, Path]) -> None:
    """Mode "auto" on the 8B job of 8 GPUs: the doctor says what train.py will choose there (a note: its blocks, the
    estimated peak against 90% of the GPU), and finds nothing else; on 40 GiB GPUs at batch 4 nothing fits, one error
    with both numbers; on CPU ranks without a budget, one error naming memory_budget_gib."""
    cfg = load_config(llama3_8b(llama3_stand_ins))
    cfg.activation_checkpoint.mode = "auto"
    findings = check(cfg, world_size=8, machine=GPUS, device_memory_gib=80.0)
    assert keys(findings) == [("note", "activation_checkpoint.mode")]
    assert findings[0].message.startswith("auto: blocks ") and "of the 72.0 GiB budget" in findings[0].message
    cfg.training.local_batch_size = 4
    findings = check(cfg, world_size=8, machine=GPUS, device_memory_gib=40.0)
    assert keys(findings) == [("error", "activation_checkpoint.memory_budget_gib")]
    assert "even with full AC on every block, over the budget of 36 GiB" in findings[0].message
    assert keys(check(cfg, world_size=8)) == [("error", "activation_checkpoint.memory_budget_gib")]
