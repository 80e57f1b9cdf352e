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
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from config import validation_path
from data.corpus import open_corpus
from data.loader import GlobalBatchLoader
from data.tokenizers import Tokenizer

if TYPE_CHECKING:
    from config import JobConfig
    from forward import ForwardBackward


class Validator:
    """The held-out loss of the model that `forward` runs, on this rank's share of the held-out data."""

    def __init__(self, cfg: JobConfig, *, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, forward: ForwardBackward):
        v = cfg.validation
        path = validation_path(v)
        assert path is not None, "config.validate checks that the held-out data is local"
        # Raw files are prepared into the same cache as training data; a prepared folder is read as it is.
        held_out = dataclasses.replace(cfg.data, path=path, format="auto", split=v.split, shuffle=False)
        corpus = open_corpus(held_out, tokenizer, cfg.model.tokenizer_path, key="validation.dataset_path")
        global_batch = v.local_batch_size * dp_degree
        self.loader = GlobalBatchLoader(
            corpus,
            window=v.seq_len + 1,
            local_batch_size=v.local_batch_size,
            global_batch_size=global_batch,
            dp_rank=dp_rank,
            dp_degree=dp_degree,
            pad_samples=cfg.data.pad_samples,
        )
        windows = self.loader.num_windows
        self.sequences = windows if v.steps == -1 else min(v.steps * global_batch, windows)
        self.steps = -(-self.sequences // global_batch)
        self.first_row = dp_rank * v.local_batch_size  # this rank's rows of each global batch
        self.local_batch_size, self.global_batch = v.local_batch_size, global_batch
        self.tokens = self.sequences * v.seq_len
        self.forward = forward
        self.seconds = 0.0  # how long the last validation took

    def validate(self) -> tuple[float, int, float]:
        """(mean loss over the held-out sequences, tokens read, seconds). Every rank calls it. With pipeline
        parallel the stages run forward only (the schedule's eval), as torchtitan's validator does."""
        begin = time.perf_counter()
        self.loader.sample_index = 0  # the same sequences every time
        total = torch.zeros(2, device=self.forward.device)  # [cross-entropy summed over counted labels, their count]
        with self.forward.scoring():
            for step in range(self.steps):
                # Rows of this rank's micro-batch that lie inside the held-out data (all but in a last, partial batch).
                rows = min(max(self.sequences - step * self.global_batch - self.first_row, 0), self.local_batch_size)
                (batch,) = self.loader.next_step()
                total += self.forward.score(batch, rows=rows)
        dist.all_reduce(total)  # ForwardBackward.score says why a plain sum over all ranks is right
        self.seconds = time.perf_counter() - begin
        loss_sum, counted = total.tolist()
        return loss_sum / counted, self.tokens, self.seconds


class ValidateStep:
    """After step 1, every validation.freq steps and after the last: the held-out loss, logged."""

    def __init__(self, validator: Validator, *, freq: int, total_steps: int, logger: Any):
        self.validator, self.freq, self.total_steps, self.logger = validator, freq, total_steps, logger

    @classmethod
    def for_run(
        cls,
        cfg: JobConfig,
        *,
        forward: ForwardBackward,
        tokenizer: Tokenizer,
        dp_rank: int,
        dp_degree: int,
        logger: Any,
    ) -> ValidateStep:
        """The run's validation: its held-out data read as this data-parallel rank's share, scored through `forward`."""
        validator = Validator(cfg, tokenizer=tokenizer, dp_rank=dp_rank, dp_degree=dp_degree, forward=forward)
        return cls(validator, freq=cfg.validation.freq, total_steps=cfg.training.steps, logger=logger)

    def __call__(self, step: int, result: Any) -> bool:
        if step == 1 or step % self.freq == 0 or step == self.total_steps:
            self.logger.log_validation(step, *self.validator.validate())
        return False
