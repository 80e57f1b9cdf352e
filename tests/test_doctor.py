"""The recipe doctor: each check fires on its pitfall and stays quiet without it; shipped configs are clean."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import doctor
from config import ConfigError, JobConfig, load_config
from doctor import Finding, check_recipe, format_findings
from models.llama3 import FLAVORS, Transformer
from parallelisms.ac import checkpoint_module, transformer_blocks
from tests.launch import REPO

CONFIGS = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.toml"))


def recipe(**keys: Any) -> JobConfig:
    """A clean CPU recipe (float32, one rank) with `section__key=value` changes."""
    cfg = JobConfig()
    cfg.training.mixed_precision_param = "float32"
    for dotted, value in keys.items():
        section, key = dotted.split("__")
        assert hasattr(getattr(cfg, section), key), dotted
        setattr(getattr(cfg, section), key, value)
    return cfg


def check(cfg: JobConfig, **kwargs: Any) -> list[Finding]:
    """check_recipe on a CPU machine with nothing read from this one, unless kwargs say otherwise."""
    machine = dict(
        world_size=1, cuda_available=False, nccl_available=False, gpus_per_node=None, cpu_has_bf16=True, environ={}
    )
    return check_recipe(cfg, **{**machine, **kwargs})


def found(findings: list[Finding], severity: str, key: str) -> bool:
    return any(f.severity == severity and f.key == key for f in findings)


def hf_model(**config: Any) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        **config,
    )
    return LlamaForCausalLM(cfg)


def hf_checkpointing_on(model: LlamaForCausalLM, *, use_reentrant: bool) -> None:
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def our_model() -> Transformer:
    with torch.device("meta"):
        return Transformer(FLAVORS["debugmodel"])


# ------------------------------------------------------------------ the API


def test_clean_recipe_has_no_findings_and_format_is_one_line_each() -> None:
    assert check(recipe()) == []
    assert check(recipe(), model=our_model()) == []
    assert check(recipe(), model=hf_model(use_cache=False)) == []
    findings = check(recipe(training__mixed_precision_param="float16", training__mixed_precision_reduce="bfloat16"))
    assert [f.severity for f in findings] == ["error", "warning"]  # errors first
    lines = format_findings(findings).splitlines()
    assert lines[0].startswith("error: training.mixed_precision_param: float16 needs loss scaling")
    assert lines[1].startswith("warning: training.mixed_precision_reduce: ")
    assert all("\n" not in f.message for f in findings)


# ------------------------------------------------- 1. nested checkpointing


def test_hf_gradient_checkpointing_under_our_ac_is_an_error() -> None:
    model = hf_model(use_cache=False)
    hf_checkpointing_on(model, use_reentrant=False)
    findings = check(recipe(activation_checkpoint__mode="full"), model=model)
    assert found(findings, "error", "model.gradient_checkpointing")
    assert "PROBLEMS.md #1" in findings[0].message and "gradient_checkpointing_disable()" in findings[0].message
    # One mechanism only, non-reentrant: fine.
    assert check(recipe(), model=model) == []


def test_hf_reentrant_gradient_checkpointing_alone_is_a_warning() -> None:
    model = hf_model(use_cache=False)
    hf_checkpointing_on(model, use_reentrant=True)
    assert found(check(recipe(), model=model), "warning", "model.gradient_checkpointing")


@pytest.mark.parametrize("wrap", ["ours", "checkpoint_wrapper"])
def test_blocks_already_checkpointed_is_an_error(wrap: str) -> None:
    model = our_model()
    blocks = transformer_blocks(model)
    if wrap == "ours":
        checkpoint_module(blocks["0"])
    else:
        blocks["0"] = checkpoint_wrapper(blocks["0"])
    findings = check(
        recipe(activation_checkpoint__mode="selective", activation_checkpoint__selective_ac_option="2"), model=model
    )
    assert found(findings, "error", "model.layers.0")
    assert check(recipe(activation_checkpoint__mode="full"), model=our_model()) == []


# ---------------------------------------------------------- 2. KV cache on


def test_hf_use_cache_is_an_error_under_ac_and_a_warning_without() -> None:
    model = hf_model()  # LlamaConfig's default: use_cache=True
    assert found(check(recipe(activation_checkpoint__mode="full"), model=model), "error", "model.config.use_cache")
    assert found(check(recipe(), model=model), "warning", "model.config.use_cache")
    model.config.use_cache = False
    assert check(recipe(activation_checkpoint__mode="full"), model=model) == []


# -------------------------------------------------------- 3. reentrant AC


def test_reentrant_ac_is_a_warning_and_an_error_with_op_sac() -> None:
    full = recipe(activation_checkpoint__mode="full", activation_checkpoint__use_reentrant=True)
    assert found(check(full), "warning", "activation_checkpoint.use_reentrant")
    # Under FSDP it trains correctly (measured: loss and parameter parity with one process), so still a warning.
    full.parallelism.data_parallel_shard_degree = 2
    findings = check(full, world_size=2)
    assert [(f.severity, f.key) for f in findings] == [("warning", "activation_checkpoint.use_reentrant")]
    op = recipe(activation_checkpoint__mode="selective", activation_checkpoint__use_reentrant=True)
    assert found(check(op), "error", "activation_checkpoint.use_reentrant")
    assert check(recipe(activation_checkpoint__mode="full")) == []
    assert check(recipe(activation_checkpoint__use_reentrant=True)) == []  # mode none: nothing is checkpointed


# ---------------------------------------------------------------- 4. async TP


def test_async_tp_needs_compile_cuda_nccl_and_tp() -> None:
    ok = recipe(
        parallelism__tensor_parallel_degree=2, parallelism__enable_async_tensor_parallel=True, compile__enable=True
    )
    assert check(ok, world_size=2, cuda_available=True, nccl_available=True) == []
    cpu = check(ok, world_size=2)
    assert found(cpu, "error", "parallelism.enable_async_tensor_parallel")
    assert "the TP group runs on cpu with gloo" in cpu[0].message  # the wording of parallelisms.tp
    no_compile = recipe(parallelism__tensor_parallel_degree=2, parallelism__enable_async_tensor_parallel=True)
    findings = check(no_compile, world_size=2, cuda_available=True, nccl_available=True)
    assert found(findings, "error", "parallelism.enable_async_tensor_parallel")
    assert "compile.enable is false" in findings[0].message
    tp1 = recipe(parallelism__enable_async_tensor_parallel=True, compile__enable=True)
    assert "tensor_parallel_degree is 1" in check(tp1, cuda_available=True, nccl_available=True)[0].message


# ---------------------------------------------------------- 6. nodes (HSDP)


def test_hsdp_inside_one_node_is_a_warning() -> None:
    hsdp = recipe(parallelism__data_parallel_replicate_degree=2)
    findings = check(hsdp, world_size=8, cuda_available=True, nccl_available=True, gpus_per_node=8)
    assert found(findings, "warning", "parallelism.data_parallel_replicate_degree")
    # Across 2 nodes of 8 with a shard group per node: what PROBLEMS.md #3 recommends.
    assert check(hsdp, world_size=16, cuda_available=True, nccl_available=True, gpus_per_node=8) == []
    # Unknown node size, or CPU ranks (pretend nodes): nothing to say.
    assert check(hsdp, world_size=8, cuda_available=True, nccl_available=True) == []
    assert check(hsdp, world_size=8, gpus_per_node=8) == []


def test_gpus_per_node_comes_from_local_world_size() -> None:
    hsdp = recipe(parallelism__data_parallel_replicate_degree=2)
    env = {"LOCAL_WORLD_SIZE": "8"}
    findings = check(hsdp, world_size=8, cuda_available=True, nccl_available=True, environ=env)
    assert found(findings, "warning", "parallelism.data_parallel_replicate_degree")


def test_hsdp_shard_groups_that_are_not_one_node_are_a_warning() -> None:
    spans = recipe(parallelism__data_parallel_replicate_degree=2, parallelism__data_parallel_shard_degree=16)
    findings = check(spans, world_size=32, cuda_available=True, nccl_available=True, gpus_per_node=8)
    assert found(findings, "warning", "parallelism.data_parallel_shard_degree")
    assert "data_parallel_replicate_degree = 4, data_parallel_shard_degree = 8" in findings[0].message
    small = recipe(parallelism__data_parallel_replicate_degree=4, parallelism__data_parallel_shard_degree=2)
    findings = check(small, world_size=8, cuda_available=True, nccl_available=True, gpus_per_node=4)
    assert found(findings, "warning", "parallelism.data_parallel_shard_degree")
    ok = recipe(parallelism__data_parallel_replicate_degree=2, parallelism__tensor_parallel_degree=4)
    assert check(ok, world_size=16, cuda_available=True, nccl_available=True, gpus_per_node=8) == []


def test_fsdp_across_nodes_suggests_hsdp_unless_tp_fills_the_node() -> None:
    findings = check(recipe(), world_size=16, cuda_available=True, nccl_available=True, gpus_per_node=8)
    assert found(findings, "warning", "parallelism.data_parallel_replicate_degree")
    assert "data_parallel_replicate_degree = 2, data_parallel_shard_degree = 8" in findings[0].message
    assert check(recipe(), world_size=8, cuda_available=True, nccl_available=True, gpus_per_node=8) == []
    # TP 8 fills each node: the FSDP groups must cross nodes, HSDP would leave nothing to shard.
    tp8 = recipe(parallelism__tensor_parallel_degree=8)
    assert check(tp8, world_size=64, cuda_available=True, nccl_available=True, gpus_per_node=8) == []


def test_tp_group_across_nodes_is_a_warning() -> None:
    gpu = dict(cuda_available=True, nccl_available=True)
    tp4 = recipe(parallelism__tensor_parallel_degree=4, training__seq_len=256)
    for world, per_node in [(8, 2), (24, 6)]:  # TP larger than a node; TP groups straddling two nodes
        findings = check(tp4, world_size=world, gpus_per_node=per_node, **gpu)
        assert [(f.severity, f.key) for f in findings] == [("warning", "parallelism.tensor_parallel_degree")]
    # TP 4 inside nodes of 8, FSDP across 2 nodes: only the HSDP suggestion remains.
    findings = check(tp4, world_size=16, gpus_per_node=8, **gpu)
    assert [f.key for f in findings] == ["parallelism.data_parallel_replicate_degree"]


# -------------------------------------------------------------- 7. offload


def test_cpu_offload_without_cuda_is_a_warning() -> None:
    offload = recipe(training__enable_cpu_offload=True)
    assert found(check(offload), "warning", "training.enable_cpu_offload")
    assert check(offload, cuda_available=True, nccl_available=True) == []


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_pinned_offload_on_a_sharded_model_without_cuda_is_an_error() -> None:
    mesh = init_device_mesh("cpu", (1,))
    with torch.device("meta"):  # fully_shard accepts the pinned policy here; to_empty would fail
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=True))
    fully_shard(model, mesh=mesh)
    assert found(check(recipe(), model=model), "error", "model.0")
    assert check(recipe(), model=model, cuda_available=True, nccl_available=True) == []

    with torch.device("meta"):
        unpinned = nn.Sequential(nn.Linear(4, 4))
    fully_shard(unpinned, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    assert check(recipe(), model=unpinned) == []


# --------------------------------------------------------- 8, 9. precision


def test_bf16_on_a_cpu_without_bf16_instructions_is_a_warning() -> None:
    bf16 = recipe(training__mixed_precision_param="bfloat16")
    assert found(check(bf16, cpu_has_bf16=False), "warning", "training.mixed_precision_param")
    assert check(bf16, cpu_has_bf16=True) == []  # AVX512-BF16 / AMX: bf16 is the faster one
    assert check(bf16, cpu_has_bf16=False, cuda_available=True, nccl_available=True) == []


def test_bf16_gradient_reduction_is_a_warning() -> None:
    assert found(
        check(recipe(training__mixed_precision_reduce="bfloat16")), "warning", "training.mixed_precision_reduce"
    )
    assert check(recipe(training__mixed_precision_reduce="float32")) == []


def test_float16_without_loss_scaling_is_an_error() -> None:
    fp16 = recipe(training__mixed_precision_param="float16")
    assert found(check(fp16, cuda_available=True, nccl_available=True), "error", "training.mixed_precision_param")


def test_low_precision_master_weights() -> None:
    assert found(check(recipe(), model=hf_model(use_cache=False).bfloat16()), "warning", "model.parameters")
    assert found(check(recipe(), model=hf_model(use_cache=False).half()), "error", "model.parameters")


# ------------------------------------------------------ 10, 11. layout, shapes


def test_shapes_tp_cannot_split_are_errors() -> None:
    # debugmodel: 16 heads, 8 KV heads; TP 16 splits the heads but not the KV heads, TP 3 neither nor seq_len 256.
    findings = check(recipe(parallelism__tensor_parallel_degree=16, training__seq_len=256), world_size=16)
    assert [f.key for f in findings] == ["parallelism.tensor_parallel_degree"]
    findings = check(recipe(parallelism__tensor_parallel_degree=3, training__seq_len=256), world_size=3)
    assert [f.key for f in findings] == ["parallelism.tensor_parallel_degree"] * 2 + ["training.seq_len"]
    # From an HF model's config too, and even when the degrees do not fill the world.
    findings = check(
        recipe(parallelism__tensor_parallel_degree=4, training__seq_len=256), model=hf_model(use_cache=False)
    )
    assert {f.key for f in findings} == {"parallelism", "parallelism.tensor_parallel_degree"}
    assert check(recipe(parallelism__tensor_parallel_degree=2, training__seq_len=256), world_size=2) == []


def test_world_size_the_degrees_do_not_fill_is_an_error() -> None:
    findings = check(recipe(parallelism__data_parallel_shard_degree=2), world_size=4)
    assert [(f.severity, f.key) for f in findings] == [("error", "parallelism")]
    assert check(recipe(parallelism__data_parallel_shard_degree=2), world_size=2) == []


def test_global_batch_not_a_multiple_of_the_micro_batch_is_an_error() -> None:
    cfg = recipe(training__local_batch_size=2, training__global_batch_size=6)
    assert found(check(cfg, world_size=2), "error", "training.global_batch_size")
    assert check(cfg, world_size=1) == []  # 6 = 3 micro-batches of 2


def test_tied_embeddings_under_tp_is_an_error() -> None:
    tied = recipe(model__flavor="llama3_1b", parallelism__tensor_parallel_degree=2, training__seq_len=256)
    assert found(check(tied, world_size=2), "error", "parallelism.tensor_parallel_degree")
    assert check(recipe(model__flavor="llama3_1b", training__seq_len=256)) == []
    assert found(
        check(
            recipe(parallelism__tensor_parallel_degree=2),
            world_size=2,
            model=hf_model(use_cache=False, tie_word_embeddings=True),
        ),
        "error",
        "parallelism.tensor_parallel_degree",
    )


# ------------------------------------------------------------------ 12. compile


def test_deterministic_compile_on_cuda_is_a_warning() -> None:
    cfg = recipe(training__deterministic=True, compile__enable=True)
    gpu = dict(cuda_available=True, nccl_available=True)
    assert found(check(cfg, **gpu), "warning", "training.deterministic")
    assert check(cfg, **gpu, environ={"TORCHINDUCTOR_DETERMINISTIC": "1"}) == []
    assert check(recipe(training__deterministic=True), **gpu) == []


def test_compile_on_cpu_without_a_cxx_compiler_is_an_error() -> None:
    cfg = recipe(compile__enable=True)
    assert found(check(cfg, environ={"CXX": "/nonexistent/c++"}), "error", "compile.enable")
    if shutil.which("g++"):
        assert check(cfg) == []


# ------------------------------------------------------------- shipped configs


def _launch_from_header(path: Path) -> tuple[int, int | None, bool]:
    """(world size, GPUs per node, meant for CUDA) from a config's header comment, e.g.
    "on 64 GPUs (8 nodes x 8)", "on one node of 8 GPUs", "2 nodes x 8 GPUs", "--nproc_per_node=2", "Needs CUDA"."""
    header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    gpus = re.search(r"on (\d+) GPUs", header) or re.search(r"one node of (\d+) GPUs", header)
    nodes = re.search(r"(\d+) nodes x (\d+)", header)
    nproc = re.search(r"--nproc_per_node=(\d+)", header)
    if gpus:
        world = int(gpus.group(1))
    elif nodes:
        world = int(nodes.group(1)) * int(nodes.group(2))
    else:
        world = int(nproc.group(1)) if nproc else 1
    cuda = bool(re.search(r"\d+ GPUs|[Nn]eeds CUDA", header))
    per_node = int(nodes.group(2)) if nodes else world if cuda else None
    return world, per_node, cuda


@pytest.mark.parametrize("path", CONFIGS)
def test_shipped_configs_have_no_errors(path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # configs name repo-relative data and tokenizer paths
    overrides = []
    if "hf_assets_path" in (REPO / path).read_text():
        # The downloaded HF folder and its converted checkpoint are not here: a tiny random stand-in.
        from tests.tiny_hf import tiny_hf_folder

        hf = tiny_hf_folder(tmp_path / "hf")
        (tmp_path / "ckpt").mkdir()
        overrides = [
            f"--model.hf_assets_path={hf}",
            f"--model.tokenizer_path={hf}",
            f"--checkpoint.initial_load_path={tmp_path / 'ckpt'}",
            "--training.seq_len=256",
        ]
    cfg = load_config(["--config", path, *overrides])
    world, per_node, gpu = _launch_from_header(REPO / path)
    if cfg.compile.enable and not gpu and shutil.which("g++") is None:
        pytest.skip("inductor's CPU backend needs g++")
    findings = check(cfg, world_size=world, gpus_per_node=per_node, cuda_available=gpu, nccl_available=gpu)
    assert [f for f in findings if f.severity == "error"] == [], format_findings(findings)
    if gpu:  # the GPU recipes are meant to be clean on their machines
        assert findings == [], format_findings(findings)


def test_header_parsing() -> None:
    assert _launch_from_header(REPO / "configs/llama3_70b.toml") == (64, 8, True)
    assert _launch_from_header(REPO / "configs/llama3_405b.toml") == (512, 8, True)
    assert _launch_from_header(REPO / "configs/llama3_8b.toml") == (8, 8, True)
    assert _launch_from_header(REPO / "configs/debug_hsdp.toml") == (4, None, False)
    assert _launch_from_header(REPO / "configs/debug.toml") == (2, None, False)


# ----------------------------------------------------------------- entry points


def test_main_exit_codes(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("RANK", raising=False)
    assert doctor.main(["--config", "configs/debug.toml", "--world-size", "2"]) == 0
    assert "no known pitfalls found" in capsys.readouterr().out
    assert doctor.main(["--config", "configs/debug.toml", "--training.mixed_precision_param=float16"]) == 1
    assert "error: training.mixed_precision_param: float16" in capsys.readouterr().out
    assert doctor.main(["--config", "configs/llama3_70b.toml", "--world-size=64", "--gpus-per-node=8", "--cuda"]) == 0
    assert doctor.main(["--config", "configs/debug.toml", "--training.stepz=3"]) == 2
    assert "error: training.stepz: unknown key" in capsys.readouterr().err
    assert doctor.main(["--config", "configs/debug.toml", "--world-size", "two"]) == 2


def test_startup_checks_print_warnings_on_rank_0_and_raise_errors(capsys: pytest.CaptureFixture[str]) -> None:
    cpu = torch.device("cpu")
    doctor.run_startup_checks(recipe(training__enable_cpu_offload=True), world_size=1, rank=0, device=cpu)
    assert capsys.readouterr().err.startswith("warning: training.enable_cpu_offload: ")
    doctor.run_startup_checks(recipe(training__enable_cpu_offload=True), world_size=1, rank=1, device=cpu)
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match=r"^training.mixed_precision_param: float16 needs loss scaling"):
        doctor.run_startup_checks(recipe(training__mixed_precision_param="float16"), world_size=1, rank=0, device=cpu)
