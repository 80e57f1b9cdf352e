"""Distillation (distill.py) against the tools that define its losses, on the same tensors: TRL's
generalized_jsd_loss (GKDTrainer's) and torchtune's ForwardKLLoss and ReverseKLLoss; the loss's mix of terms, its
chunks, and the refusals. Its layouts (FSDP, TP with loss parallel, CP, FSDP x TP, a Qwen3 MoE student and teacher
with EP) are tests/parity_worker.py's DISTILL_LAYOUTS, in the parity launches."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch import nn

from config import REPO, Distill, load_config
from data.chat import IGNORE_INDEX
from distill import DistillLoss, check_vocabulary, divergence, teacher_config
from errors import ConfigError
from loss import Loss
from tests.conftest import TINY
from tests.launch import python, torchrun

VOCAB, ROWS, SEQ = 96, 3, 11


class Head(nn.Module):
    """A model's last projection alone, as the loss sees a model: `project` and `args.vocab_size`."""

    def __init__(self, dim: int, *, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.output = nn.Linear(dim, VOCAB, bias=False)
        nn.init.normal_(self.output.weight, std=1.0)
        self.args = SimpleNamespace(vocab_size=VOCAB)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(h)


def tensors() -> tuple[Head, Head, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A student (dim 16) and a teacher (dim 24: another width) with their final hidden states, and chat labels."""
    gen = torch.Generator().manual_seed(0)
    student, teacher = Head(16, seed=1), Head(24, seed=2).requires_grad_(False)
    h, teacher_h = torch.randn(ROWS, SEQ, 16, generator=gen), torch.randn(ROWS, SEQ, 24, generator=gen)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    labels[torch.rand(ROWS, SEQ, generator=gen) < 0.4] = IGNORE_INDEX
    return student, teacher, h, teacher_h, labels


def ours(settings: Distill, *, chunk_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """distill.py's divergence term as a mean over the counted labels, and the student's gradient of it."""
    student, teacher, h, teacher_h, labels = tensors()
    loss = DistillLoss(chunk_tokens, settings=settings, teacher=teacher)
    terms = loss(student, h, labels, teacher_h=teacher_h)
    scale = labels.numel() / (labels != IGNORE_INDEX).sum()  # the terms are over the label positions (loss.py)
    (terms.total * scale).backward()
    return terms.extras["kd_loss"] * scale, student.output.weight.grad, terms.cross_entropy * scale


def whole_logits() -> tuple[Head, torch.Tensor, torch.Tensor, torch.Tensor]:
    student, teacher, h, teacher_h, labels = tensors()
    return student, student.project(h), teacher.project(teacher_h), labels


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_divergence_is_trls_generalized_jsd_value_and_gradient(beta: float, temperature: float) -> None:
    """beta 0 (forward KL), 0.5 (JSD), 1 (reverse KL), at two temperatures: TRL's generalized_jsd_loss of the whole
    logits, its batchmean over the counted labels, equals the chunked loss's term within 1e-6 relative, gradient too."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    settings = Distill(enable=True, beta=beta, temperature=temperature, kd_ratio=1.0)
    kd, grad, _ = ours(settings, chunk_tokens=7)  # 33 tokens: chunks of 7, 7, 7, 7, 5
    student, s, t, labels = whole_logits()
    theirs = GKDTrainer.generalized_jsd_loss(s, t, labels, beta=beta, temperature=temperature)
    theirs.backward()
    assert relative(kd, theirs) <= 1e-6, (float(kd), float(theirs))
    assert relative(grad, student.output.weight.grad) <= 1e-5


def torchtune_kd_losses() -> ModuleType:
    """torchtune's module of distillation losses (torchtune/modules/loss/kd_losses), read alone: its package's
    __init__ imports a torchao API this torchao no longer has, and these losses need nothing but torch."""
    spec = importlib.util.find_spec("torchtune")
    assert spec is not None and spec.origin is not None, "torchtune is in the dev extra (pyproject.toml)"
    path = Path(spec.origin).parent / "modules" / "loss" / "kd_losses.py"
    module_spec = importlib.util.spec_from_file_location("torchtune_kd_losses", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_the_forward_and_reverse_kl_are_torchtunes() -> None:
    """torchtune's ForwardKLLoss is the cross-entropy of the student under the teacher, -sum p_t log p_s: the forward
    KL less the teacher's entropy, which the student cannot change, so the gradients are equal and the values differ
    by exactly that entropy. Its ReverseKLLoss is the reverse KL. Both within 1e-6 relative."""
    tt = torchtune_kd_losses()
    student, s, t, labels = whole_logits()
    forward = tt.ForwardKLLoss()(s.flatten(0, 1), t.flatten(0, 1), labels.flatten())
    forward.backward()
    kd, grad, _ = ours(Distill(enable=True, beta=0.0, kd_ratio=1.0), chunk_tokens=5)
    p_t = torch.softmax(t.flatten(0, 1), dim=-1)
    counted = labels.flatten() != IGNORE_INDEX
    entropy = -(p_t * torch.log_softmax(t.flatten(0, 1), dim=-1)).sum(-1)[counted].mean()
    assert relative(kd + entropy, forward) <= 1e-6
    assert relative(grad, student.output.weight.grad) <= 1e-5
    student, s, t, labels = whole_logits()
    reverse = tt.ReverseKLLoss()(s.flatten(0, 1), t.flatten(0, 1), labels.flatten())
    kd, _, _ = ours(Distill(enable=True, beta=1.0, kd_ratio=1.0))
    assert relative(kd, reverse) <= 1e-6


def test_the_loss_mixes_the_labels_and_the_teacher_by_kd_ratio_and_logs_the_cross_entropy() -> None:
    """(1 - kd_ratio) x cross-entropy + kd_ratio x divergence (+ the weighted z-loss), the logged loss the plain
    cross-entropy, a term in chunks equal to the whole; validation scores the cross-entropy alone."""
    student, teacher, h, teacher_h, labels = tensors()
    plain = Loss(z_loss_weight=1e-2)(student, h, labels)
    settings = Distill(enable=True, beta=0.5, temperature=2.0, kd_ratio=0.3)
    for chunk in (0, 4):
        terms = DistillLoss(chunk, z_loss_weight=1e-2, settings=settings, teacher=teacher)(student, h, labels,
                                                                                       teacher_h=teacher_h)  # fmt: skip
        kd, z = terms.extras["kd_loss"], terms.extras["z_loss"]
        assert torch.allclose(terms.cross_entropy, plain.cross_entropy, rtol=1e-6)
        assert torch.allclose(z, plain.extras["z_loss"], rtol=1e-6)
        assert torch.allclose(terms.total, 0.7 * terms.cross_entropy + 0.3 * kd + 1e-2 * z, rtol=1e-6)
    assert DistillLoss(settings=settings, teacher=teacher).extras == ("kd_loss",)
    assert type(DistillLoss(settings=settings, teacher=teacher).cross_entropy_only()) is Loss


def test_a_teacher_equal_to_the_student_diverges_by_nothing() -> None:
    """The same logits: every divergence 0 (to fp32 rounding), whatever beta and temperature."""
    logits = torch.randn(20, VOCAB) * 4
    for beta in (0.0, 0.25, 1.0):
        assert divergence(logits, logits.clone(), beta=beta, temperature=1.5).abs().max() < 1e-5


def test_distillations_settings_are_refused_in_one_line_each() -> None:
    """No teacher, beta or kd_ratio out of range, a non-positive temperature, pipeline parallel, DPO beside it."""
    problems = Distill(enable=True, beta=1.5, temperature=0.0, kd_ratio=2.0).problems(pp=2, dpo=True)
    keys = [p.split(":")[0] for p in problems]
    assert keys == ["distill.teacher_path", "distill.beta", "distill.temperature", "distill.kd_ratio",
                    "distill.enable", "distill.enable"], problems  # fmt: skip
    assert "pipeline parallel" in problems[4] and "DPO" in problems[5]
    assert Distill(enable=False, beta=3.0).problems(pp=2, dpo=True) == []


def test_the_teacher_is_the_model_its_folder_names_and_its_vocabulary_must_be_the_students(tmp_path: Path) -> None:
    """A step folder's config.toml gives the teacher's family, flavor and tokenizer; a teacher whose tokenizer gives
    two tokens each other's ids (the same size, the same texts) is refused in one line that names
    distill.teacher_path, as is Qwen3's shipped tokenizer (its chat tokens are other added tokens); a copy of the
    student's passes."""
    step, swapped = tmp_path / "checkpoint" / "step-10", tmp_path / "swapped"
    step.mkdir(parents=True)
    shutil.copytree(REPO / "assets" / "tokenizer", swapped)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["e"], vocab["t"] = vocab["t"], vocab["e"]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    toml = '[model]\nname = "llama3"\nflavor = "debugmodel"\ntokenizer_path = "{}"\n'
    (step.parent / "config.toml").write_text(toml.format(swapped))
    cfg = load_config(["--config", "configs/debug.toml", "--distill.enable=true", f"--distill.teacher_path={step}"])
    tcfg = teacher_config(cfg)
    assert (tcfg.model.name, tcfg.model.flavor, tcfg.checkpoint.initial_load_path) == (
        "llama3",
        "debugmodel",
        str(step),
    )
    assert tcfg.activation_checkpoint.mode == "none" and not tcfg.checkpoint.initial_load_in_hf
    with pytest.raises(ConfigError) as refused:
        check_vocabulary(cfg, tcfg)
    assert str(refused.value).startswith("distill.teacher_path: the teacher") and "\n" not in str(refused.value)
    (step.parent / "config.toml").write_text(toml.format(REPO / "assets" / "tokenizer_qwen3"))
    with pytest.raises(ConfigError):
        check_vocabulary(cfg, teacher_config(cfg))
    shutil.copytree(REPO / "assets" / "tokenizer", tmp_path / "copy")
    (step.parent / "config.toml").write_text(toml.format(tmp_path / "copy"))
    check_vocabulary(cfg, teacher_config(cfg))


def test_a_teacher_read_from_a_step_folder_or_a_hugging_face_folder_in_any_layout_is_the_model_it_saved(
    seed: Path, tmp_path: Path
) -> None:
    """The student started from the seed checkpoint, the teacher the same weights: read from the step folder (its
    config.toml names the model) on one process and under TP 2 (sharded and loaded as the student is), or from its
    Hugging Face export, the teacher's distribution is the student's at step 1, so kd_loss is 0 to fp32 rounding and
    the loss is the run's without a teacher."""
    hf = tmp_path / "hf"
    proc = python("scripts/convert_hf.py", "to-hf", str(seed), str(hf), "--flavor", "debugmodel", "--tokenizer-path",
                  "assets/tokenizer", "--dtype", "float32")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    common = [*TINY, "--training.steps=1", f"--checkpoint.initial_load_path={seed}", "--distill.enable=true"]
    runs = {
        "alone": python("train.py", *common[:-1], f"--job.dump_folder={tmp_path / 'alone'}"),
        "step": python("train.py", *common, f"--distill.teacher_path={seed}", f"--job.dump_folder={tmp_path / 'step'}"),
        "hf": python("train.py", *common, f"--distill.teacher_path={hf}", f"--job.dump_folder={tmp_path / 'hf_run'}"),
        "tp2": torchrun(
            "train.py",
            *common,
            f"--distill.teacher_path={seed}",
            f"--job.dump_folder={tmp_path / 'tp2'}",
            "--parallelism.tensor_parallel_degree=2",
            "--parallelism.data_parallel_shard_degree=1",
            nproc=2,
        ),  # fmt: skip
    }
    for name, run in runs.items():
        assert run.returncode == 0, (name, run.stderr[-3000:])
    logged = {
        name: json.loads((tmp_path / folder / "metrics.jsonl").read_text().splitlines()[0])
        for name, folder in (("alone", "alone"), ("step", "step"), ("hf", "hf_run"), ("tp2", "tp2"))
    }
    for name in ("step", "hf", "tp2"):
        assert abs(logged[name]["kd_loss"]) < 1e-5, (name, logged[name])
        assert logged[name]["loss"] == pytest.approx(logged["alone"]["loss"], rel=1e-6), name
    assert (
        "distill: teacher llama3 debugmodel" in runs["step"].stdout
        and "distill: teacher llama3 hf" in runs["hf"].stdout
    )


def test_the_readmes_distillation_commands_train_a_student_from_random_init_and_pruned(
    seed: Path, tmp_path: Path
) -> None:
    """README's distillation lines as written, the seed checkpoint as the teacher instead of `make train`'s step 100,
    2 steps instead of 100, into a temporary folder: the teacher is named, each step logs kd_loss, the held-out loss is
    scored, and the pruned student is the teacher's 2 blocks. The figures the README states are its results row's."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Distill a smaller model") :]
    lines = re.search(r"```bash\n(.*?)```", section, flags=re.S)[1].strip().splitlines()
    scratch, prune, pruned = lines
    assert scratch.endswith("train.py --config configs/debug_distill.toml"), scratch
    student = tmp_path / "student"
    prune = prune.replace("outputs/debug/checkpoint/step-100", str(seed)).replace("outputs/student", str(student))
    nproc, *_ = shlex.split(scratch.removeprefix(".venv/bin/torchrun "))
    for name, line in (("scratch", scratch), ("prune", prune), ("pruned", pruned)):
        args = shlex.split(line.replace("outputs/student", str(student)))
        if name == "prune":
            proc = python(*args[1:])
            assert proc.returncode == 0 and "2 of 6 blocks" in proc.stdout, proc.stderr[-3000:]
            continue
        dump = tmp_path / name
        proc = torchrun(
            *args[2:], f"--distill.teacher_path={seed}", "--training.steps=2", "--validation.freq=2",
            f"--job.dump_folder={dump}", "--metrics.log_freq=1", nproc=int(nproc.removeprefix("--nproc_per_node=")),
        )  # fmt: skip
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        assert f"distill: teacher llama3 debugmodel (6.2M parameters) from {seed}, frozen" in proc.stdout
        assert "kd_loss" in next(line for line in proc.stdout.splitlines() if line.startswith("step 2/2"))
        assert "validation at step 2" in proc.stdout and (dump / "checkpoint" / "step-2").is_dir()
    stated = re.search(r"held-out loss at step 100 is ([\d.]+), ([\d.]+)", " ".join(section.split())).groups()
    rows = [json.loads(line) for line in (REPO / "docs/results/cpu.jsonl").read_text().splitlines()]
    figures = " ".join(next(row for row in rows if row["id"] == "distill-1")["figures"])
    assert all(value in figures for value in stated), stated
