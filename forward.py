"""One micro-batch through the run's layout, written once for every caller: training's forward and backward
(`ForwardBackward.__call__`, train.py's train_step) and scoring's forward alone (`ForwardBackward.score`:
evaluation/validation.py's held-out loss, and any later evaluation during training).

What both need of the layout is here and nowhere else: context parallel shards each micro-batch over the "cp"
ranks (each rank computes its part of every window's tokens; `segments` stays whole), the tensors move to the
device, loss parallel keeps the logits sharded over the vocabulary (cross-entropy and its backward under
`loss_parallel_context`; loss.py returns plain tensors), a job of one rank with a bf16 compute dtype runs its
forward under autocast (parallelisms/fsdp.py `autocast`), and the pipeline schedule replaces the model call under
pipeline parallel (the loss is then on the ranks of the last stage, 0 elsewhere).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from data.chat import IGNORE_INDEX
from data.loader import Batch
from loss import Loss, LossTerms, document_logprobs, target_logprobs
from optimizer import clip_grad_norm_
from parallelisms.cp import ContextParallel, context_parallel
from parallelisms.fsdp import autocast, autocast_dtype, sync_gradients_on
from parallelisms.parallel_dims import ParallelDims, uses_loss_parallel
from parallelisms.pp import Pipeline
from parallelisms.tp import loss_parallel_context

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from config import JobConfig


class ForwardBackward:
    """Micro-batches through the model as build() laid it out, or through the pipeline schedule's stages
    (parallelisms/pp.py, which holds the loss function). Each training micro-batch returns its loss terms
    (loss.py LossTerms); after the step's micro-batches, `clip_grad_norm` gives the norm of the gradients they left."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: Loss,
        *,
        device: torch.device,
        loss_parallel: bool = False,
        cp: ContextParallel | None = None,
        pipeline: Pipeline | None = None,
        defer_reduce_scatter: bool = False,
        autocast_to: torch.dtype | None = None,
    ):
        # One line each: a fork that removes context parallel or pipelines deletes its line (docs/development.md,
        # "Removing a part").
        self.model, self.loss_fn, self.device = model, loss_fn, device
        self.score_fn = loss_fn.cross_entropy_only()  # what scoring reports: the cross-entropy, no z-loss
        self.loss_parallel = loss_parallel
        self.cp = cp
        self.pipeline = pipeline
        self.defer_reduce_scatter = defer_reduce_scatter  # parallelism.fsdp_defer_reduce_scatter (sync_gradients_on)
        self.autocast_to = autocast_to  # one rank's compute dtype where FSDP's mixed precision does not apply
        self._syncing = True  # FSDP's own default: gradients reduced by every backward

    @classmethod
    def for_run(
        cls,
        cfg: JobConfig,
        model: torch.nn.Module,
        pipeline: Pipeline | None,
        loss_fn: Loss,
        *,
        dims: ParallelDims,
        mesh: DeviceMesh,
        device: torch.device,
    ) -> ForwardBackward:
        """The forward path of a run built from `cfg` (train.py, eval.py)."""
        return cls(
            model,
            loss_fn,
            device=device,
            loss_parallel=uses_loss_parallel(cfg, dims),
            cp=context_parallel(mesh, cfg.parallelism),
            pipeline=pipeline,
            defer_reduce_scatter=cfg.parallelism.fsdp_defer_reduce_scatter,
            autocast_to=autocast_dtype(dims, cfg.training),
        )

    def __call__(self, batch: Batch, *, last: bool) -> LossTerms:
        """Training: the micro-batch's loss terms over its loss divisor (detached); its gradients added to the
        parameters'. `last`: the step's last micro-batch, whose backward reduces the step's gradients."""
        inputs, labels, segments, divisor = self._placed(batch)
        with loss_parallel_context(self.loss_parallel):  # cross-entropy on vocabulary shards, backward included
            if self.pipeline is not None:
                return self.pipeline.step(inputs, labels, segments, scale=1 / divisor)
            if last != self._syncing:  # gradients cross replicas once per step: off before the last micro-batch
                sync_gradients_on(self.model, last_microbatch=last, defer_reduce_scatter=self.defer_reduce_scatter)
                self._syncing = last
            with autocast(self.autocast_to, self.device.type):
                # The loss applies the output projection itself, inside the model's forward (loss.py), with what it
                # computes first (DPO's reference log-probabilities, a teacher's forward: Loss.given).
                given = self.loss_fn.given(batch, inputs, labels, segments)
                head = functools.partial(self.loss_fn, self.model, labels=labels, **given)
                terms = self.model(inputs, segments=segments, head=head).divided(divisor)
            terms.total.backward()
        return terms.detached()

    @contextlib.contextmanager
    def scoring(self) -> Iterator[None]:
        """Around `score` calls: the model in eval mode and no autograd, back in training mode afterwards."""
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train()

    def score(self, batch: Batch, *, rows: int) -> torch.Tensor:
        """Forward only (inside `scoring()`): [cross-entropy summed over the counted labels of the first `rows`
        rows, their count] on this rank, a device tensor. Every rank calls it for every batch (FSDP, TP and the
        pipeline need all of them), `rows` 0 where a rank's rows lie past the end of the data; the sums of the
        ranks of a TP group are equal, those of a CP group are parts of each window, and under PP only the last
        stage's ranks hold any: all-reduced, they count alike in numerator and denominator."""
        inputs, labels, segments, _ = self._placed(batch)
        # The losses are sums over the counted labels divided by the label positions (loss.py): times the
        # positions, the sums. Chat data counts a few labels of each row; the count stays on the device.
        positions, counted = labels.shape[1], (labels[:rows] != IGNORE_INDEX).sum()
        with loss_parallel_context(self.loss_parallel):
            if self.pipeline is not None:  # the schedule's eval; the sum of each micro-batch's loss x scored rows
                loss_rows, _ = self.pipeline.eval(inputs, labels, segments, rows=rows)
                summed, counted = loss_rows * positions, counted * self.pipeline.has_last
            else:
                head = functools.partial(self._scored, rows, labels[:rows])
                with autocast(self.autocast_to, self.device.type):
                    summed = self.model(inputs, segments=segments, head=head) * (rows * positions)
        return torch.stack([summed.float(), counted.float()])

    def score_tokens(self, inputs: torch.Tensor, targets: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        """Forward only (inside `scoring()`): per row of `inputs` (bs, seqlen), the log-probabilities of `targets` at
        the `counted` positions summed, and how many of them greedy decoding would have missed (loss.py
        `target_logprobs`): a (bs, 2) device tensor. Under context parallel each rank sums its own positions of every
        row (the caller adds the ranks' parts); the ranks of a TP group hold equal rows. Not under pipeline parallel,
        whose schedule carries a loss, not per-row scores (evaluation/downstream.py refuses it)."""
        assert self.pipeline is None, "downstream.py refuses lm-eval tasks under pipeline parallel"
        inputs, targets, _, _ = self._placed(Batch(inputs, targets, None, 1.0))  # (seqlen a multiple of 2 x cp)
        counted = (self.cp.shard(counted) if self.cp is not None else counted).to(self.device)
        head = functools.partial(target_logprobs, self.model, targets=targets, counted=counted)
        with loss_parallel_context(self.loss_parallel), autocast(self.autocast_to, self.device.type):
            return self.model(inputs, head=head)

    def score_documents(self, batch: Batch, *, documents: int) -> torch.Tensor:
        """Forward only (inside `scoring()`): per row of the batch, the log-probabilities of its counted labels summed
        over each of its first `documents` documents (loss.py `document_logprobs`): a (bs, documents) fp32 device tensor,
        equal on the ranks of a TP group. Not under context or pipeline parallel (dpo.py refuses both)."""
        assert self.cp is None and self.pipeline is None, "dpo.py refuses context and pipeline parallel"
        inputs, labels, segments, _ = self._placed(batch)
        head = functools.partial(document_logprobs, self.model, labels=labels, segments=segments, documents=documents)
        with loss_parallel_context(self.loss_parallel), autocast(self.autocast_to, self.device.type):
            return self.model(inputs, segments=segments, head=head)

    def _scored(self, rows: int, labels: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if not rows:
            return torch.zeros((), device=self.device)
        return self.score_fn(self.model, h[:rows], labels).cross_entropy

    def _placed(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float]:
        """The micro-batch as this rank computes it: its context-parallel part, on the device."""
        inputs, labels, segments, divisor, _ = batch
        if self.cp is not None:
            inputs, labels = self.cp.shard(inputs), self.cp.shard(labels)
        segments = segments.to(self.device) if segments is not None else None
        return inputs.to(self.device), labels.to(self.device), segments, divisor

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm, the gradients clipped to `max_norm` (pipeline stages add their norms up)."""
        pp_group = self.pipeline.pp_group if self.pipeline is not None else None
        return clip_grad_norm_(self.model.parameters(), max_norm, pp_group=pp_group)
