"""Pipeline parallel (torch.distributed.pipelining): the model cut by layers into stages.

    stage 0                      stage 1 ...                 stage S-1
    tok_embeddings + blocks  ->  blocks  ->  ...  ->  blocks + norm + output + loss

The stages are the model itself with the modules of other stages deleted (layers live in a
ModuleDict keyed "0", "1", ..., so every parameter keeps its name and checkpoints do not care how
the model was cut: a PP run resumes without PP and back). Each stage then goes through the same
`parallelize_model` as a whole model (TP, AC, compile, FSDP inside the stage's dp x tp ranks).

Stages per pp rank: 1 for 1F1B and GPipe, 2 or more for the interleaved schedules (rank r holds
stages r, r + pp, r + 2pp, ...), which shrink the pipeline bubble by (stages per rank). Layers are
spread evenly, the first and last stages counting `first/last_stage_less_layers` blocks' worth for
the embedding and for norm + output + loss (torchtitan's split, stage for stage).

The loss runs on the last stage, inside its forward as without PP (`head`, loss.py): the schedule
hands every stage the step's keyword tensors split per micro-batch, so the labels travel as one and
a forward pre-hook turns them into the loss head on the last stage. The head hands the schedule the loss's total
(the tensor backward runs on) and keeps its terms (loss.py LossTerms) for `Pipeline.step` to return. Each
micro-batch's mean loss is scaled by 1 / (micro-batches x gradient-accumulation steps), so gradients sum to the
same mean as without PP (scale_grads=False: the schedule adds nothing of its own).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from errors import ConfigError
from loss import Loss, LossTerms

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

    from config import Parallelism


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A schedule of torch.distributed.pipelining, by what the split and the micro-batch check need to know of it.
    torch.distributed.pipelining imports dynamo (about 0.7 s of every process's start): it is imported when a
    pipeline is built, not when a config is checked (tests/test_pp.py checks these facts against torch's classes)."""

    class_name: str
    single: bool  # one stage per rank (a PipelineScheduleSingle)
    in_rounds: bool  # micro-batches run in max(1, micro-batches // pp) rounds of equal size

    def torch_class(self) -> type:
        return getattr(importlib.import_module("torch.distributed.pipelining.schedules"), self.class_name)


SCHEDULES = {
    "1F1B": Schedule("Schedule1F1B", single=True, in_rounds=False),
    "GPipe": Schedule("ScheduleGPipe", single=True, in_rounds=False),
    "Interleaved1F1B": Schedule("ScheduleInterleaved1F1B", single=False, in_rounds=True),
    "InterleavedZeroBubble": Schedule("ScheduleInterleavedZeroBubble", single=False, in_rounds=True),
}


def stage_layers(args: Any, cfg: Parallelism) -> list[list[int]]:
    """The blocks of each stage of a [parallelism] section's pipeline (split_layers)."""
    return split_layers(
        args,
        pp=cfg.pipeline_parallel_degree,
        schedule=cfg.pipeline_parallel_schedule,
        layers_per_stage=cfg.pipeline_parallel_layers_per_stage,
        first_less=cfg.pipeline_parallel_first_stage_less_layers,
        last_less=cfg.pipeline_parallel_last_stage_less_layers,
    )


def split_layers(
    args: Any, *, pp: int, schedule: str, layers_per_stage: int | None, first_less: int, last_less: int
) -> list[list[int]]:
    """The blocks of each stage (virtual stages in order; stage 0 also holds the embedding, the last
    norm + output), from the parallelism.pipeline_parallel_* keys. Every problem of the PP keys for this
    model in one ConfigError."""
    name, per_stage = schedule, layers_per_stage
    key = "parallelism.pipeline_parallel"
    if name not in SCHEDULES:
        raise ConfigError(f"{key}_schedule: {name!r} is not one of {', '.join(SCHEDULES)}")
    single = SCHEDULES[name].single
    problems = []
    if args.tie_word_embeddings:
        problems.append(
            f"{key}_degree: {pp} with a flavor that ties the output projection to the embedding (first and last "
            "stage would share a matrix); use an untied flavor or no pipeline parallel"
        )
    if first_less < 0 or last_less < 0:
        problems.append(f"{key}_first/last_stage_less_layers: expected >= 0, got {first_less} and {last_less}")
    weighted = args.n_layers + max(first_less, 0) + max(last_less, 0)  # the embedding / the loss count as layers
    if per_stage is None:
        stages = pp * (1 if single else 2)
    elif per_stage < 1:
        problems.append(f"{key}_layers_per_stage: expected >= 1, got {per_stage}")
        stages = pp
    else:
        stages = math.ceil(weighted / per_stage)
        per_rank = stages // pp
        if stages % pp:
            problems.append(
                f"{key}_layers_per_stage: {per_stage} makes {stages} stages ({args.n_layers} blocks + "
                f"{first_less} + {last_less} for embedding and output), not a multiple of pipeline_parallel_degree {pp}"
            )
        elif single and per_rank != 1:
            problems.append(
                f"{key}_layers_per_stage: {per_stage} makes {per_rank} stages per rank, but {name} runs one; "
                f"raise it to {math.ceil(weighted / pp)} or use Interleaved1F1B"
            )
        elif not single and per_rank < 2:
            problems.append(
                f"{key}_layers_per_stage: {per_stage} makes 1 stage per rank, but {name} interleaves 2 or more; "
                f"lower it to {weighted // (2 * pp)} or less, or use 1F1B"
            )
    per, extra = divmod(weighted, stages)
    if not problems and per < max(first_less, last_less, 1):
        problems.append(
            f"{key}_degree: {stages} stages of {args.n_layers} blocks leave {per} per stage, fewer than the "
            f"first/last_stage_less_layers ({first_less}, {last_less}); use fewer stages or lower those"
        )
    if problems:
        raise ConfigError(*problems)
    layers, next_layer = [], 0
    for stage in range(stages):
        n = per + (stage < extra) - (first_less if stage == 0 else 0) - (last_less if stage == stages - 1 else 0)
        n = min(n, args.n_layers - next_layer) if stage < stages - 1 else args.n_layers - next_layer
        layers.append(list(range(next_layer, next_layer + n)))
        next_layer += n
    return layers


def rank_stages(pp_rank: int, *, pp: int, stages: int) -> list[int]:
    """The stages pp rank `pp_rank` runs: r, r + pp, r + 2pp, ... (the looped layout of the interleaved schedules)."""
    return list(range(pp_rank, stages, pp))


def check_microbatches(*, pp: int, schedule: str, microbatch_size: int, local_batch_size: int) -> int:
    """Micro-batches per step of the pipeline: local_batch_size / microbatch_size (the parallelism.pipeline_parallel_*
    keys)."""
    mb = microbatch_size
    if mb < 1 or local_batch_size % mb:
        raise ConfigError(
            f"parallelism.pipeline_parallel_microbatch_size: {mb} does not divide training.local_batch_size "
            f"{local_batch_size}; the pipeline splits each local batch into micro-batches of this many sequences"
        )
    n = local_batch_size // mb
    if schedule == "1F1B" and n < pp:
        raise ConfigError(
            f"parallelism.pipeline_parallel_microbatch_size: {mb} makes {n} micro-batches of "
            f"local_batch_size {local_batch_size}, fewer than the {pp} stages 1F1B needs (more shrink the bubble); "
            f"lower it or raise training.local_batch_size"
        )
    if schedule in SCHEDULES and SCHEDULES[schedule].in_rounds and n % (rounds := max(1, n // pp)):
        raise ConfigError(
            f"parallelism.pipeline_parallel_microbatch_size: {mb} makes {n} micro-batches of local_batch_size "
            f"{local_batch_size}; {schedule} runs them in rounds, {n} // {pp} stages = "
            f"{rounds} of them, so their number must divide by {rounds}: make it a multiple of {pp} (or below {2 * pp})"
        )
    return n


def stage_module(model: nn.Module, layers: list[int], *, first: bool, last: bool) -> nn.Module:
    """A copy of the (meta) model with only these blocks, the embedding if first, norm + output if last."""
    stage = copy.deepcopy(model)
    keep = {str(i) for i in layers}
    for name in [n for n in stage.layers if n not in keep]:
        del stage.layers[name]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm, stage.output = None, None
    return stage


class Pipeline:
    """This rank's stages and the schedule that runs them, one `step` per micro-batch of the loader.

    `module` is this rank's stages as one module with the whole model's parameter names (the
    optimizer, gradient clipping and checkpoints use it); with one stage per rank, that stage.
    """

    def __init__(
        self,
        parts: list[nn.Module],
        stages: list[PipelineStage],
        *,
        pp_group: Any,
        n_microbatches: int,
        extras: tuple[str, ...],
        terms: list[LossTerms],
    ):
        self.parts, self.pp_group, self.n_microbatches = parts, pp_group, n_microbatches
        self.extras = extras  # the names of the loss's extra terms, which the stages before the last return as zeros
        self.terms = terms  # what the last stage's loss head computed, micro-batch by micro-batch, during `step`
        self.schedule: Any = None  # set by pipeline_model: the schedule needs `scaled` as its loss function
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.module = parts[0] if len(parts) == 1 else _union(parts)

    def step(
        self, inputs: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor | None, *, scale: float
    ) -> LossTerms:
        """Forward and backward of one local batch through every stage; returns this batch's mean loss terms x scale
        on ranks with the last stage (detached), zeros elsewhere."""
        self._scale = scale / self.n_microbatches  # the mean over the micro-batches
        kwargs = {"labels": labels} | ({"segments": segments} if segments is not None else {})
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        self.terms.clear()
        self.schedule.step(
            *args, target=labels if self.has_last else None, losses=losses, return_outputs=False, **kwargs
        )
        if not self.has_last:
            return LossTerms.zeros(self.extras, device=labels.device)
        # The schedule's first step also runs the stages once to infer their shapes (on data of no meaning): the
        # last stage's head ran once more then, before the micro-batches. The step's terms are the last ones.
        terms = self.terms[-len(losses) :]
        return LossTerms(
            torch.stack([loss.detach() for loss in losses]).sum(),
            self._summed([t.cross_entropy for t in terms]),
            {name: self._summed([t.extras[name] for t in terms]) for name in self.extras},
        )

    @torch.no_grad()
    def eval(
        self, inputs: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor | None, *, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only (evaluation/validation.py): the sum over this local batch's first `rows` sequences of each one's mean
        loss, and how many were scored, on ranks with the last stage (zeros elsewhere). Rows past `rows` run
        through the stages (the pipeline needs whole micro-batches) and score nothing."""
        self._scale = 1.0
        valid = torch.arange(len(labels), device=labels.device) < rows  # split into micro-batches with the labels
        kwargs = {"labels": labels, "valid": valid} | ({"segments": segments} if segments is not None else {})
        losses: list[torch.Tensor] = []
        self.schedule.eval(
            *((inputs,) if self.has_first else ()),
            target=labels if self.has_last else None,
            losses=losses,
            return_outputs=False,
            **kwargs,
        )
        if not self.has_last:
            return torch.zeros((), device=labels.device), torch.zeros((), device=labels.device)
        # Each micro-batch's loss is the mean over its valid rows (0 when it has none): weigh it by their number.
        counts = valid.float().reshape(len(losses), -1).sum(dim=1)
        return (torch.stack(losses).float() * counts).sum(), counts.sum()

    def _summed(self, values: list[torch.Tensor]) -> torch.Tensor:
        """A term of each micro-batch scaled as the schedule scales the total it is handed (`scaled`), summed."""
        return torch.stack([value * self._scale for value in values]).sum()

    def scaled(self, loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the last stage's forward already returned the micro-batch's mean loss."""
        return loss * self._scale


def pipeline_model(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    cfg: Parallelism,
    local_batch_size: int,
    loss_fn: Loss,
    parallelize: Callable[[nn.Module], nn.Module],
    device: torch.device,
    score_fn: Loss | None = None,
) -> Pipeline:
    """Cut the (meta) model into this rank's stages, parallelize each with `parallelize`, build the schedule.
    `loss_fn` is what training minimises, `score_fn` what validation reports (default: the same)."""
    from torch.distributed.pipelining import PipelineStage

    pp = mesh["pp"].size()
    layers = stage_layers(model.args, cfg)
    n_microbatches = check_microbatches(
        pp=pp,
        schedule=cfg.pipeline_parallel_schedule,
        microbatch_size=cfg.pipeline_parallel_microbatch_size,
        local_batch_size=local_batch_size,
    )
    pp_group = mesh["pp"].get_group()
    stages, parts, terms = [], [], []
    for index in rank_stages(mesh["pp"].get_local_rank(), pp=pp, stages=len(layers)):
        first, last = index == 0, index == len(layers) - 1
        part = parallelize(stage_module(model, layers[index], first=first, last=last))
        head = functools.partial(_labels_to_loss_head, loss_fn, score_fn or loss_fn, last, terms)
        part.register_forward_pre_hook(head, with_kwargs=True)
        stages.append(PipelineStage(part, index, len(layers), device, group=pp_group))
        parts.append(part)
    schedule = SCHEDULES[cfg.pipeline_parallel_schedule]
    pipeline = Pipeline(
        parts, stages, pp_group=pp_group, n_microbatches=n_microbatches, extras=loss_fn.extras, terms=terms
    )
    pipeline.schedule = schedule.torch_class()(
        stages if len(stages) > 1 or not schedule.single else stages[0],
        n_microbatches=n_microbatches,
        loss_fn=pipeline.scaled,
        scale_grads=False,
    )
    return pipeline


def _labels_to_loss_head(
    loss_fn: Loss,
    score_fn: Loss,
    last: bool,
    terms: list[LossTerms],
    module: nn.Module,
    args: tuple,
    kwargs: dict,
) -> tuple[tuple, dict]:
    """The schedule passes the micro-batch's labels to every stage: the last one scores with them, the others drop them.
    Validation also passes which rows to score (`valid`)."""
    labels, valid = kwargs.pop("labels"), kwargs.pop("valid", None)
    if last and valid is None:
        kwargs["head"] = functools.partial(_loss_total, loss_fn, terms, module, labels)
    elif last:
        kwargs["head"] = functools.partial(_score_rows, score_fn, module, labels, valid)
    return args, kwargs


def _loss_total(
    loss_fn: Loss, terms: list[LossTerms], module: nn.Module, labels: torch.Tensor, h: torch.Tensor
) -> torch.Tensor:
    """The micro-batch's loss total, the tensor the schedule scales and runs backward on; its terms kept for
    `Pipeline.step`."""
    loss = loss_fn(module, h, labels=labels)
    terms.append(loss.detached())
    return loss.total


def _score_rows(
    loss_fn: Loss, module: nn.Module, labels: torch.Tensor, valid: torch.Tensor, h: torch.Tensor
) -> torch.Tensor:
    """The mean cross-entropy over the valid rows of a micro-batch, a prefix of them (0 when none is)."""
    rows = int(valid.sum())  # a host sync per micro-batch: validation only
    if rows == 0:
        return torch.zeros((), device=labels.device)
    return loss_fn(module, h[:rows], labels=labels[:rows]).cross_entropy


def _union(parts: list[nn.Module]) -> nn.Module:
    """One module over several stages, holding the same submodules under the whole model's names."""
    union = nn.Module()
    union.tok_embeddings = next((p.tok_embeddings for p in parts if p.tok_embeddings is not None), None)
    union.layers = nn.ModuleDict({name: block for p in parts for name, block in p.layers.items()})
    union.norm = next((p.norm for p in parts if p.norm is not None), None)
    union.output = next((p.output for p in parts if p.output is not None), None)
    return union
