"""LoRA (lora.py): which linears get adapters, their start and placement, the frozen base, checkpoints that hold the
adapters alone and resume exactly on the base read again, and the refusals. Parity against one process in every
layout: tests/parity_worker.py's LORA_LAYOUTS (tests/test_parallelisms.py); PEFT's format: tests/test_lora_peft.py."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor, Replicate, Shard

import models
from config import JobConfig, Lora, load_config
from data.inputs import input_problems
from errors import ConfigError
from lora import LoRAMixin, apply_lora, scaling, target_names, targets
from models.llama3 import FAMILY as LLAMA3
from models.llama3 import FLAVORS
from parallelisms.float8 import apply_float8
from parallelisms.tp import apply_tp
from tests.conftest import TINY, losses
from tests.launch import python
from tests.parity_worker import FLOAT8, build_tiny, random_batch

QV = Lora(enable=True, r=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj"])
ALL = Lora(enable=True, r=4, lora_alpha=8.0)


def with_adapters(cfg: Lora, *, family: str = "llama3", base_dtype: torch.dtype = torch.float32) -> nn.Module:
    model = build_tiny(family=family)
    apply_lora(model, cfg, models.family(family), base_dtype=base_dtype)
    model.init_weights()
    return model


def test_the_targets_are_named_by_hugging_face_and_all_linear_is_every_linear_of_a_block_not_the_head() -> None:
    block = build_tiny().layers["0"]
    assert targets(block, LLAMA3, QV) == ["attention.wq", "attention.wv"]
    linears = ["attention.wq", "attention.wk", "attention.wv", "attention.wo"]
    assert targets(block, LLAMA3, ALL) == [*linears, "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    model = with_adapters(ALL)
    assert not isinstance(model.output, LoRAMixin) and type(model.output) is nn.Linear
    assert target_names(LLAMA3, model.args, ALL) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj"] + ["gate_proj", "up_proj", "down_proj"]
    )
    # A mixture of experts' grouped experts are no nn.Linear: attention and the router take adapters, the experts none.
    moe = models.family("qwen3_moe")
    moe_block = build_tiny(family="qwen3_moe").layers["0"]
    assert not any("experts" in name for name in targets(moe_block, moe, ALL)), targets(moe_block, moe, ALL)
    with pytest.raises(ConfigError, match=r"lora.target_modules: qkv_proj is no linear of a llama3 block; choose from"):
        targets(block, LLAMA3, dataclasses.replace(QV, target_modules=["q_proj", "qkv_proj"]))


def test_the_adapters_start_as_peft_starts_them_and_the_base_is_frozen_in_the_compute_dtype() -> None:
    model = with_adapters(QV, base_dtype=torch.bfloat16)
    wq = model.layers["0"].attention.wq
    assert type(wq).__name__ == "LoRALinear" and wq.lora_scaling == 2.0
    assert wq.lora_A.weight.shape == (4, wq.in_features) and wq.lora_B.weight.shape == (wq.out_features, 4)
    assert torch.count_nonzero(wq.lora_B.weight) == 0  # B at zero: step 1 is the base
    # A as nn.Linear initializes its weight (Kaiming-uniform, a = sqrt(5)): uniform in +-1/sqrt(in_features).
    bound = 1 / math.sqrt(wq.in_features)
    assert wq.lora_A.weight.abs().max() <= bound and wq.lora_A.weight.abs().max() > 0.8 * bound
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"layers.{i}.attention.w{w}.lora_{ab}.weight" for i in "01" for w in "qv" for ab in "AB"}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert scaling(dataclasses.replace(QV, use_rslora=True)) == 8.0 / 2  # lora_alpha / sqrt(r)


def test_the_adapter_adds_scale_b_a_x_and_switched_off_the_model_is_its_base() -> None:
    tokens = random_batch()[:, :-1]
    base = build_tiny()
    model = with_adapters(ALL)
    model.load_state_dict(base.state_dict(), strict=False)
    torch.testing.assert_close(model(tokens), base(tokens), rtol=0, atol=0)  # B = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(std=0.05)
    assert (model(tokens) - base(tokens)).abs().max() > 1e-3
    with model.adapters_off():
        torch.testing.assert_close(model(tokens), base(tokens), rtol=0, atol=0)
    assert (model(tokens) - base(tokens)).abs().max() > 1e-3  # back on
    wq = model.layers["0"].attention.wq
    x = torch.randn(3, wq.in_features)
    expected = x @ wq.weight.T + 2.0 * (x @ wq.lora_A.weight.T) @ wq.lora_B.weight.T
    torch.testing.assert_close(wq(x), expected)
    # Only the adapters take gradients.
    model(tokens).sum().backward()
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())


def test_float8_converts_the_base_linears_and_leaves_the_adapters_plain() -> None:
    model = build_tiny()
    apply_float8(model, FLOAT8, device=torch.device("cpu"), fsdp_sharded=False)
    apply_lora(model, QV, LLAMA3, base_dtype=torch.float32)
    wq = model.layers["0"].attention.wq
    assert type(wq).__mro__[2].__name__ == "Float8Linear", type(wq).__mro__
    assert type(wq.lora_A) is nn.Linear and type(wq.lora_B) is nn.Linear


def test_under_tp_the_adapters_follow_pefts_rule_for_parallel_layers() -> None:
    """Column-parallel (W split by rows): A whole, B split like W; row-parallel: A split like W, B whole; the
    adapters' own placements read off each weight's (one rank's mesh: the placements are what matters)."""
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        model = build_tiny()
        apply_tp(model, mesh, block_plan=LLAMA3.tp_plan, loss_parallel=True, seq_len=32)
        apply_lora(model, ALL, LLAMA3, base_dtype=torch.float32)
        block = model.layers["0"]
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            m = block.get_submodule(name)
            assert m.weight.placements == (Shard(0),)
            assert (m.lora_A.weight.placements, m.lora_B.weight.placements) == ((Replicate(),), (Shard(0),)), name
        for name in ("attention.wo", "feed_forward.w2"):
            m = block.get_submodule(name)
            assert m.weight.placements == (Shard(1),)
            assert (m.lora_A.weight.placements, m.lora_B.weight.placements) == ((Shard(1),), (Replicate(),)), name
        assert all(isinstance(p, DTensor) for p in block.parameters())
    finally:
        dist.destroy_process_group()


def test_loras_settings_are_refused_in_one_line_each() -> None:
    def problems(**lora: object) -> list[str]:
        cfg = JobConfig()
        cfg.lora = Lora(enable=True, **lora)  # type: ignore[arg-type]
        return cfg.lora.problems(optimizer=cfg.optimizer.name, seed_checkpoint=False)

    assert problems() == []
    assert problems(r=0) == ["lora.r: the adapters' rank must be >= 1, got 0"]
    assert problems(lora_dropout=1.0)[0].startswith("lora.lora_dropout: must lie in [0, 1)")
    assert problems(target_modules=[])[0].startswith("lora.target_modules: empty")
    assert problems(target_modules=["all-linear", "q_proj"])[0].startswith('lora.target_modules: "all-linear" stands')
    assert Lora(enable=True).problems(optimizer="Muon", seed_checkpoint=True) == [
        "checkpoint.create_seed_checkpoint: a seed holds a model's initial weights, and a LoRA run's base comes from "
        "checkpoint.initial_load_path; create the seed with lora.enable = false",
        'optimizer.name: Muon orthogonalizes whole weight matrices, not adapters; use "AdamW" with LoRA',
    ]
    assert (
        Lora(enable=True)
        .problems(optimizer="AdamW", seed_checkpoint=False, last_save_in_hf=True)[0]
        .startswith(
            "checkpoint.last_save_in_hf: a LoRA run's steps hold its adapters; set it to false and write them after the run"
        )
    )
    with pytest.raises(ConfigError, match=r"lora.adapter_path: /nonexistent has no adapter_config.json"):
        load_config(
            ["--config", "configs/debug.toml", "--lora.enable", "--lora.adapter_path=/nonexistent"],
            input_checks=input_problems,
        )


def test_a_checkpoint_holds_the_adapters_and_resumes_exactly_on_the_base_read_again(tmp_path: Path, seed: Path) -> None:
    """4 steps saved at 2 and 4; step 4 deleted and trained again from step 2's checkpoint: the same losses to the
    bit. The step folder holds the adapters and their AdamW moments, no weight of the base; the base is recorded by
    its files, and a resume on another base is refused in one line."""
    dump = tmp_path / "run"
    run = [*TINY, f"--job.dump_folder={dump}", "--lora.enable", "--lora.r=4", "--optimizer.lr=1e-2"]
    run += [f"--checkpoint.initial_load_path={seed}", "--checkpoint.enable", "--checkpoint.interval=2"]
    first = python("train.py", *run, "--training.steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"initialized the frozen base from {seed}" in first.stdout
    assert "M train, the rest frozen)" in first.stdout.splitlines()[1], first.stdout
    before = losses(dump)
    step = dump / "checkpoint" / "step-2"
    stored = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    weights = [
        k.removeprefix("model_and_optimizer.model.") for k in stored if k.startswith("model_and_optimizer.model.")
    ]
    moments = [k for k in stored if k.startswith("model_and_optimizer.optimizer.state.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), weights
    assert len(weights) == 2 * 7 * FLAVORS["debugmodel"].n_layers  # every linear of every block, A and B
    assert moments and all(".lora_" in k for k in moments), moments  # AdamW's state of the adapters alone
    shutil.rmtree(dump / "checkpoint" / "step-4")
    (dump / "metrics.jsonl").unlink()
    again = python("train.py", *run, "--training.steps=4")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {step}" in again.stdout
    assert losses(dump) == {k: v for k, v in before.items() if k > 2}
    # Another base under the same adapters: refused, nothing trained or saved.
    shutil.rmtree(dump / "checkpoint" / "step-4")
    other = [a for a in run if not a.startswith("--checkpoint.initial_load_path")]
    refused = python("train.py", *other, "--training.steps=4")
    assert refused.returncode == 2, refused.stderr[-3000:]
    lines = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        f"error: checkpoint.initial_load_path: a random init (no checkpoint.initial_load_path) is not the frozen base "
        f"{step} was trained on ({seed}; its files differ, e.g. .metadata); point checkpoint.initial_load_path (or "
        "model.hf_assets_path) at that base"
    ], refused.stderr[-2000:]
    assert not (dump / "checkpoint" / "step-4").exists()


def test_op_sac_keeps_the_named_linears_outputs_and_recomputes_the_adapters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Selective op AC keeps the matmul outputs of the family's named linears (SAC_SAVED_LINEARS) and not those of the
    adapters they hold: lora_B's output is as wide as the linear's, and keeping it would cost what the linear's costs
    again, where recomputing an adapter is r wide."""
    from config import ActivationCheckpoint
    from parallelisms import ac

    decisions: list[object] = []
    real = ac.create_selective_checkpoint_contexts

    def recording(policy, *args, **kwargs):  # type: ignore[no-untyped-def]
        def record(ctx, op, *a, **k):  # type: ignore[no-untyped-def]
            decision = policy(ctx, op, *a, **k)
            if op in ac._MATMUL_OPS and not ctx.is_recompute:
                decisions.append(decision)
            return decision

        return real(record, *args, **kwargs)

    monkeypatch.setattr(ac, "create_selective_checkpoint_contexts", recording)
    op_sac = ActivationCheckpoint(mode="selective", selective_ac_option="op")
    saved = {}
    for adapted in (False, True):
        decisions.clear()
        model = with_adapters(ALL) if adapted else build_tiny()
        ac.apply_ac(model, op_sac, saved_linears=LLAMA3.sac_saved_linears)
        model(random_batch()[:, :-1]).sum().backward()
        kept = sum(d == ac.CheckpointPolicy.MUST_SAVE for d in decisions)
        saved[adapted] = (kept, len(decisions))
    assert saved[True][0] == saved[False][0] > 0, saved  # the same outputs kept
    assert saved[True][1] == saved[False][1] + 2 * 7 * 2, saved  # and each adapter's two matmuls recomputed


def test_the_readmes_lora_line_trains_adapters_on_the_chat_fine_tune_and_generate_reads_its_step(
    tmp_path: Path, seed: Path
) -> None:
    """README's "Fine-tune on chat data" with the flags its LoRA paragraph adds, for 2 steps instead of 40, on the seed
    checkpoint instead of `make train`'s step 100: the banner says what trains, the step folder holds adapters, and
    the README's generate.py line reads it (the base per the run's config.toml, the adapters merged)."""
    import re
    import shlex
    import subprocess
    import sys

    from tests.launch import REPO, torchrun

    text = (REPO / "README.md").read_text()
    section = text[text.index("## Fine-tune on chat data") :]
    train, ask = re.search(r"```bash\n(.*?)```", section, flags=re.S)[1].strip().splitlines()
    flags = re.search(r"\*\*LoRA\.\*\* Add `([^`]+)`", section)[1]
    assert flags == "--lora.enable --optimizer.lr=1e-2", flags
    dump = tmp_path / "debug_chat_lora"
    train = (
        train.replace("outputs/debug/checkpoint/step-100", str(seed))
        .replace("--training.steps=40", "--training.steps=2")
        .replace("outputs/debug_chat", str(dump))
    )
    nproc, script, *args = shlex.split(train.removeprefix(".venv/bin/torchrun "))
    run = torchrun(script, *args, *shlex.split(flags), nproc=int(nproc.removeprefix("--nproc_per_node=")))
    assert f"initialized the frozen base from {seed}" in run.stdout and "M train, the rest frozen)" in run.stdout
    ask = (
        ask.replace(".venv/bin/python", sys.executable)
        .replace("outputs/debug_chat", str(dump))
        .replace("step-40", "step-2")
    )
    proc = subprocess.run(["bash", "-c", ask], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("What does a cow say?"), proc.stderr[-3000:]
