"""The held-out loss ([validation]): after step 1, every `validation.freq` steps and after the last
one, the model's mean loss on data it does not train on.

The held-out data is read like the training data (data/loader.py), from its first window every time,
without shuffling, in global batches of validation.local_batch_size x data-parallel degree sequences
split over the data-parallel ranks. It runs under `torch.no_grad()`: no gradients, no optimizer, no
effect on the training stream or its RNG.

`validation.steps = -1` reads every window of the held-out data once: the same sequences whatever the
number of ranks, so the loss is the same on 1 or 64 GPUs (up to summation order). The last global
batch may be partial: every rank still runs its forward (FSDP and TP need all of them), and the rows
past the end count for nothing. `validation.steps = k` reads the first k global batches, as torchtitan
does: k x local_batch_size x data-parallel degree sequences, which depends on the number of ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from config import Data, Validation, validation_path
from data.chat import IGNORE_INDEX
from data.corpus import open_corpus
from data.loader import GlobalBatchLoader
from data.tokenizers import Tokenizer
from loss import Loss
from parallelisms.cp import ContextParallel
from parallelisms.pp import Pipeline
from parallelisms.tp import loss_parallel_context


class Validator:
    def __init__(
        self,
        cfg: Validation,
        *,
        data: Data,
        tokenizer: Tokenizer,
        tokenizer_path: str,
        dp_rank: int,
        dp_degree: int,
        device: torch.device,
        loss_fn: Loss,
        loss_parallel: bool,
        cp: ContextParallel | None = None,
    ):
        path = validation_path(cfg)
        assert path is not None, "config.validate checks that the held-out data is local"
        # Raw files are prepared into the same cache as training data; a prepared folder is read as it is.
        held_out = dataclasses.replace(data, path=path, format="auto", split=cfg.split, shuffle=False)
        corpus = open_corpus(held_out, tokenizer, tokenizer_path, key="validation.dataset_path")
        global_batch = cfg.local_batch_size * dp_degree
        self.loader = GlobalBatchLoader(
            corpus,
            window=cfg.seq_len + 1,
            local_batch_size=cfg.local_batch_size,
            global_batch_size=global_batch,
            dp_rank=dp_rank,
            dp_degree=dp_degree,
            pad_samples=data.pad_samples,
        )
        windows = self.loader.num_windows
        self.sequences = windows if cfg.steps == -1 else min(cfg.steps * global_batch, windows)
        self.steps = -(-self.sequences // global_batch)
        self.first_row = dp_rank * cfg.local_batch_size  # this rank's rows of each global batch
        self.local_batch_size, self.global_batch = cfg.local_batch_size, global_batch
        self.tokens = self.sequences * cfg.seq_len
        self.device, self.loss_fn, self.loss_parallel = device, loss_fn, loss_parallel
        self.cp = cp  # context parallel: each rank scores its part of every window (parallelisms/cp.py)
        self.seconds = 0.0  # how long the last validation took

    @torch.no_grad()
    def validate(self, model: torch.nn.Module, pipeline: Pipeline | None = None) -> tuple[float, int, float]:
        """(mean loss over the held-out sequences, tokens read, seconds). Every rank calls it. With pipeline
        parallel `pipeline` runs the stages forward only (the schedule's eval), as torchtitan's validator does."""
        begin = time.perf_counter()
        self.loader.sample_index = 0  # the same sequences every time
        model.eval()
        total = torch.zeros(2, device=self.device)  # [cross-entropy summed over the counted labels, counted labels]
        for step in range(self.steps):
            # Rows of this rank's micro-batch that lie inside the held-out data (all but in a last, partial batch).
            rows = min(max(self.sequences - step * self.global_batch - self.first_row, 0), self.local_batch_size)
            (batch,) = self.loader.next_step()
            inputs, labels, segments, _ = batch
            if self.cp is not None:
                inputs, labels = self.cp.shard(inputs), self.cp.shard(labels)
            # The losses are sums over the counted labels divided by the label positions (loss.py): times the
            # positions, the sums. Counted on the host, from the labels before they move (chat data counts a few).
            positions, counted = labels.shape[1], int((labels[:rows] != IGNORE_INDEX).sum())
            with loss_parallel_context(self.loss_parallel):
                segments = segments.to(self.device) if segments is not None else None
                if pipeline is not None:
                    # The sum over the micro-batches of each one's loss times its scored rows (0 but on the last stage).
                    loss_rows, _ = pipeline.eval(inputs.to(self.device), labels.to(self.device), segments, rows=rows)
                    counted *= pipeline.has_last
                    total += torch.stack([loss_rows * positions, torch.tensor(float(counted), device=self.device)])
                    continue
                labels = labels[:rows].to(self.device)
                # Every rank runs the model (its collectives); only rows inside the held-out data are scored.
                loss = model(
                    inputs.to(self.device), segments=segments, head=functools.partial(self._loss, model, rows, labels)
                )
                if rows:
                    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
                    total += torch.stack([loss * (rows * positions), torch.tensor(float(counted), device=self.device)])
        model.train()
        # The ranks of a TP group hold the same sums, those of a CP group the sums of their parts of each window,
        # and under PP only the last stage's ranks hold any: they count alike in numerator and denominator.
        dist.all_reduce(total)
        self.seconds = time.perf_counter() - begin
        loss_sum, counted = total.tolist()
        return loss_sum / counted, self.tokens, self.seconds

    def _loss(self, model: torch.nn.Module, rows: int, labels: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(model, h[:rows], labels) if rows else torch.zeros((), device=self.device)


class ValidateStep:
    """After step 1, every validation.freq steps and after the last: the held-out loss, logged, its time
    left out of the training throughput."""

    def __init__(
        self,
        validator: Validator,
        *,
        model: torch.nn.Module,
        pipeline: Pipeline | None,
        freq: int,
        total_steps: int,
        logger: Any,
        throughput: Any,
    ):
        self.validator, self.model, self.pipeline = validator, model, pipeline
        self.freq, self.total_steps, self.logger, self.throughput = freq, total_steps, logger, throughput

    def __call__(self, step: int, result: Any) -> bool:
        if step == 1 or step % self.freq == 0 or step == self.total_steps:
            self.logger.log_validation(step, *self.validator.validate(self.model, self.pipeline))
            self.throughput.pause(self.validator.seconds)
        return False
