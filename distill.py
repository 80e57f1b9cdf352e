"""Knowledge distillation ([distill] enable = true): a frozen teacher in the same job, whose next-token distributions
are the student's token-level targets beside the labels, as Llama 3.2's 1B and 3B were pretrained on the logits of
Llama 3.1 8B and 70B.

The loss of a micro-batch, per counted label (labels of IGNORE_INDEX count for nothing, as in the cross-entropy):

    (1 - kd_ratio) x cross-entropy(student, label) + kd_ratio x D(teacher, student)

with D TRL's generalized Jensen-Shannon divergence of distill.beta (GKDTrainer.generalized_jsd_loss) at
distill.temperature, both logits divided by it before the softmax and the result not rescaled:

    beta 0    KL(p_t || p_s)                                   the forward KL (torchtune's ForwardKLLoss, Llama 3.2's)
    beta 1    KL(p_s || p_t)                                   the reverse KL
    between   beta KL(p_t || m) + (1 - beta) KL(p_s || m),     m = beta p_t + (1 - beta) p_s

Every term is summed over the counted labels and divided by the label positions, so that train.py's divisor makes
each the mean over the global batch's counted labels, as the cross-entropy is (loss.py); the z-loss, when weighted,
is added to the student's as it is without a teacher. The logged `loss` stays the cross-entropy against the labels
(the number a run without a teacher logs), the divergence is logged as `kd_loss`. tests/test_distill.py checks D
against TRL's function and torchtune's ForwardKLLoss on the same logits (torchtune's leaves out the teacher's
entropy, a constant of the student: their gradients are equal, their values differ by it).

Memory: at Llama 3's 128,256 entries the two models' fp32 logits of 8,192 tokens are 8 GiB before any gradient.
The teacher's forward stops at its final norm (its hidden states, tokens x its dim, are what the micro-batch keeps
of it); both projections then run `chunk_tokens` tokens at a time under activation checkpointing, as the chunked
cross-entropy does, so forward and backward hold one chunk's logits of each model (benchmarks/distill_memory.py
measures the peak). The teacher's root unit (final norm and output projection) stays gathered after its first
forward: FSDP reshards a root only in backward, which the teacher never runs (planning/memory.py counts it).
Under loss parallel each TP rank holds a vocabulary shard of both logits: the log-softmax of each is formed over the
shards (the maximum and the normalizer all-reduced by `divergence` itself, not torch's loss-parallel log_softmax,
whose backward assumes an nll_loss after it) and the divergence's sum over the vocabulary is one more all-reduce. Under context parallel each rank scores its part of
every window with the teacher run in the same layout.

The teacher (`build_teacher`): a checkpoint step folder of this repo (its config.toml names the model) or a Hugging
Face folder of any family in models/, built and sharded as the student is (FSDP, TP, CP, EP), frozen, in eval mode,
with no optimizer state, not in checkpoints, its forward under no_grad. Its vocabulary must be the student's.
Not yet: pipeline parallel (refused in one line, config/distill.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomllib
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from config import Distill, model_args
from data.chat import IGNORE_INDEX
from distributed import full_tensor
from errors import ConfigError, is_rank0
from loss import Loss, LossTerms, chunk_tokens_for, summed_losses

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from config import JobConfig
    from data.loader import Batch
    from parallelisms.parallel_dims import ParallelDims


def divergence(student: torch.Tensor, teacher: torch.Tensor, *, beta: float, temperature: float) -> torch.Tensor:
    """Per token, TRL's generalized JSD of `beta` between the teacher's and the student's next-token distributions at
    `temperature` (module docstring): (tokens, vocab) logits of each, fp32 whatever they come in, to (tokens,).

    Under loss parallel the logits are vocabulary-sharded DTensors (Shard(-1) over the TP ranks), and the arithmetic
    runs on each rank's shard: the log-softmax's maximum and normalizer, and the sum over the vocabulary, are
    all-reduced (Megatron's vocabulary-parallel KL does the same). Not torch's loss-parallel log_softmax: its backward
    is written for the nll_loss that follows it in a cross-entropy and gives wrong gradients to anything else
    (tests/test_distill.py checks both gradients against one process). A plain tensor is returned either way."""
    group = None
    if isinstance(student, DTensor):
        assert student.device_mesh.ndim == 1 and student.placements[0].is_shard(student.ndim - 1), student.placements
        group, student, teacher = student.device_mesh.get_group(), student.to_local(), teacher.to_local()
    s = _log_softmax(student.float() / temperature, group)
    with torch.no_grad():
        t = _log_softmax(teacher.float() / temperature, group)
    if beta == 0:
        d = (t.exp() * (t - s)).sum(-1)
    elif beta == 1:
        d = (s.exp() * (s - t)).sum(-1)
    else:
        m = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))  # log(beta p_t + (1 - beta) p_s)
        d = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    return d if group is None else _SumOfShards.apply(d, group)


def _log_softmax(x: torch.Tensor, group: Any) -> torch.Tensor:
    """log_softmax over the last dimension, which is split over `group`'s ranks (None: whole here)."""
    if group is None:
        return F.log_softmax(x, dim=-1)
    peak = x.detach().amax(-1, keepdim=True)  # a constant of the result: no gradient
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    # Each rank's share of the normalizer feeds every rank's log-probabilities: its gradient is the sum of theirs.
    normalizer = dist_fn.all_reduce(torch.exp(x - peak).sum(-1, keepdim=True), group=group)
    return x - peak - normalizer.log()


class _SumOfShards(torch.autograd.Function):
    """The sum over `group` of each rank's part of a value every rank then uses alike (the loss): the gradient of a
    part is the value's, passed through (Megatron's reduce from the model-parallel region)."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: Any) -> torch.Tensor:
        whole = part.clone()
        dist.all_reduce(whole, group=group)
        return whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def chunk_sums(
    project: Callable[[torch.Tensor], torch.Tensor],
    teacher_project: Callable[[torch.Tensor], torch.Tensor],
    settings: Distill,
    z: bool,
    h: torch.Tensor,
    teacher_h: torch.Tensor,
    labels: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's summed cross-entropy, divergence and (with `z`) z-loss over its counted labels: both models'
    logits of these tokens only, the teacher's without autograd."""
    logits = project(h)
    with torch.no_grad():
        teacher_logits = teacher_project(teacher_h)
    ce, z_sum = summed_losses(logits, labels, z=z)
    d = divergence(
        logits.flatten(0, -2), teacher_logits.flatten(0, -2), beta=settings.beta, temperature=settings.temperature
    )
    kd = (d * (labels.flatten() != IGNORE_INDEX)).sum()
    return full_tensor(ce), kd, full_tensor(z_sum) if z else None


@dataclass(frozen=True)
class DistillLoss(Loss):
    """The student's loss against the labels and the teacher (module docstring): `loss(model, h, labels,
    teacher_h=...)` as LossTerms, the cross-entropy apart and the divergence as the extra `kd_loss` for the metrics.
    `given` runs the teacher's forward on a micro-batch before the student's (forward.py). The cross-entropy's
    settings are Loss's."""

    _: KW_ONLY
    settings: Distill = field(default_factory=lambda: Distill(enable=True))  # [distill]
    teacher: torch.nn.Module | None = None  # frozen, in eval mode, laid out as the student is (build_teacher)

    @property
    def extras(self) -> tuple[str, ...]:
        return ("kd_loss", *(("z_loss",) if self.z_loss_weight > 0 else ()))

    def cross_entropy_only(self) -> Loss:
        """What validation scores: the student's cross-entropy of the held-out data, no teacher."""
        return Loss(self.chunk_tokens, vocab_shards=self.vocab_shards, summed=self.summed)

    def given(self, batch: Batch, inputs: torch.Tensor, labels: torch.Tensor, segments: Any) -> dict[str, Any]:
        """The teacher's final hidden states of the micro-batch (its norm's output, before its projection), in the
        run's layout, without autograd."""
        with torch.no_grad():
            return {"teacher_h": self.teacher(inputs, segments=segments, head=_hidden)}

    def __call__(
        self, model: torch.nn.Module, h: torch.Tensor, labels: torch.Tensor, *, teacher_h: torch.Tensor
    ) -> LossTerms:
        vocab = model.args.vocab_size // self.vocab_shards
        chunk = chunk_tokens_for(self.chunk_tokens, tokens=labels.numel(), vocab=vocab) or labels.numel()
        if isinstance(h, DTensor):  # sequence parallel: the final norms' outputs gathered once, as in loss.chunked_sums
            h = h.redistribute(placements=[Replicate()] * h.device_mesh.ndim)
        if isinstance(teacher_h, DTensor):
            teacher_h = teacher_h.redistribute(placements=[Replicate()] * teacher_h.device_mesh.ndim)
        z = self.z_loss_weight > 0
        part = functools.partial(chunk_sums, model.project, self.teacher.project, self.settings, z)
        chunks = zip(
            h.flatten(0, 1).split(chunk),
            teacher_h.flatten(0, 1).split(chunk),
            labels.flatten().split(chunk),
            strict=True,
        )
        if chunk >= labels.numel():  # one chunk: nothing to recompute
            sums = [part(*next(chunks))]
        else:
            sums = [checkpoint(part, *c, use_reentrant=False) for c in chunks]
        n = labels.numel()
        ce, kd = sum(s[0] for s in sums) / n, sum(s[1] for s in sums) / n
        r = self.settings.kd_ratio
        total = (1 - r) * ce + r * kd
        extras = {"kd_loss": kd.detach()}
        if z:
            z_loss = sum(s[2] for s in sums) / n
            total, extras["z_loss"] = total + self.z_loss_weight * z_loss, z_loss.detach()
        return LossTerms(total, ce.detach(), extras)


def _hidden(h: torch.Tensor) -> torch.Tensor:
    return h


def build_loss(cfg: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh, device: torch.device, **loss: Any) -> Loss:
    """The distillation loss of `[distill]` with its teacher built, sharded and loaded (`build_teacher`); `loss`: the
    cross-entropy's settings (chunk_tokens, z_loss_weight, vocab_shards)."""
    return DistillLoss(settings=cfg.distill, teacher=build_teacher(cfg, dims=dims, mesh=mesh, device=device), **loss)


# ------------------------------------------------------------------ the teacher


def teacher_config(cfg: JobConfig) -> JobConfig:
    """The run's config with the teacher as its model: the family and shape its folder names (a step folder's
    config.toml, a Hugging Face folder's config.json), else distill.teacher_name / teacher_flavor, else the
    student's; its weights as the initial weights; no activation checkpointing (no backward)."""
    d, m = cfg.distill, cfg.model
    folder = Path(d.teacher_path or "")
    hf = (folder / "config.json").is_file()
    saved = folder.parent / "config.toml"
    changes: dict[str, Any] = {}
    if hf:
        from models.hf import family_of_hf_config

        changes = {
            "name": family_of_hf_config(folder).name,
            "hf_assets_path": str(folder),
            "shape_from_hf_config": True,
            "tokenizer_path": str(folder),
        }
    elif saved.is_file():
        own = tomllib.loads(saved.read_text()).get("model", {})
        keys = ("name", "flavor", "hf_assets_path", "shape_from_hf_config", "tokenizer_path")
        changes = {k: own[k] for k in keys if k in own}
    changes.setdefault("name", d.teacher_name or m.name)
    if not hf:
        changes.setdefault("flavor", d.teacher_flavor or m.flavor)
    model = dataclasses.replace(m, **changes)
    checkpoint = dataclasses.replace(cfg.checkpoint, initial_load_path=str(folder), initial_load_in_hf=hf)
    ac = dataclasses.replace(cfg.activation_checkpoint, mode="none")
    lora = dataclasses.replace(cfg.lora, enable=False)  # a student's adapters are its own
    return dataclasses.replace(cfg, model=model, checkpoint=checkpoint, activation_checkpoint=ac, lora=lora)


def build_teacher(cfg: JobConfig, *, dims: ParallelDims, mesh: DeviceMesh, device: torch.device) -> torch.nn.Module:
    """The teacher, parallelized as the student is, its weights read from distill.teacher_path, frozen and in eval
    mode; refused in one line where its vocabulary is not the student's. The random numbers its initialization draws
    (overwritten by its weights) are not the run's."""
    from checkpoint import CheckpointManager, ModelInterop
    from config import run_model_args
    from models import family
    from parallelisms.parallelize import build_model, init_model

    tcfg = teacher_config(cfg)
    check_vocabulary(cfg, tcfg)
    args = run_model_args(tcfg)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        teacher, _ = build_model(tcfg, args, dims=dims, mesh=mesh, loss_fn=Loss(), device=device)
        init_model(teacher, None, device=device)
    teacher.eval().requires_grad_(False)
    CheckpointManager(
        tcfg.checkpoint, dump_folder=cfg.job.dump_folder, model=teacher, optimizer=None, stateful={},
        interop=ModelInterop.from_config(tcfg.model),
    ).load_initial(what="the teacher's weights")  # fmt: skip
    if is_rank0():
        fam = family(tcfg.model.name)
        print(
            f"distill: teacher {tcfg.model.name} {Path(tcfg.model.hf_assets_path or '').name or tcfg.model.flavor} "
            f"({fam.num_params(args) / 1e6:,.1f}M parameters) from {cfg.distill.teacher_path}, frozen; beta "
            f"{cfg.distill.beta}, temperature {cfg.distill.temperature}, kd_ratio {cfg.distill.kd_ratio}",
            flush=True,
        )
    return teacher


PROBE = "The quick brown fox: 3.14159 naïve café 日本語 def f(x):\n\treturn x ** 2  # ok"


def check_vocabulary(cfg: JobConfig, tcfg: JobConfig) -> None:
    """The teacher's next-token distribution is over its own vocabulary: the student's must be the same ids for the
    same tokens (special tokens and chat framing may differ: Qwen3's shipped tokenizer beside the shipped one). Refused
    in one line where the embedding sizes or the tokenizers' vocabularies differ."""
    from data.tokenizers import build_tokenizer

    student, teacher = model_args(cfg.model).vocab_size, model_args(tcfg.model).vocab_size
    theirs = tcfg.model.tokenizer_path  # teacher_config's: its folder's, else the student's (nothing to compare)
    same = student == teacher
    known = theirs and theirs != cfg.model.tokenizer_path and (theirs == "byte" or Path(theirs).exists())
    if same and known and cfg.model.tokenizer_path:
        a, b = build_tokenizer(cfg.model.tokenizer_path), build_tokenizer(theirs, key="distill.teacher_path")
        if hasattr(a, "vocab") and hasattr(b, "vocab"):  # Hugging Face tokenizers: token for token
            same = a.vocab() == b.vocab()
        else:  # the byte tokenizer beside another: by how they split a text
            same = a.vocab_size == b.vocab_size and a.encode_batch([PROBE]) == b.encode_batch([PROBE])
    if not same:
        raise ConfigError(
            f"distill.teacher_path: the teacher ({tcfg.model.name}, {teacher:,} embeddings, tokenizer {theirs}) and the "
            f"student ({cfg.model.name}, {student:,} embeddings, tokenizer {cfg.model.tokenizer_path}) have different "
            "vocabularies, and the divergence compares their distributions id by id; distill from a teacher that "
            "shares the student's tokenizer"
        )
