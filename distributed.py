"""The process group of a run and what every rank does together outside the model: start the group (NCCL on CUDA,
gloo on CPU), bound how long a collective may wait, run a step on rank 0 alone or on every rank that stops every rank
if it fails, and average a loss over the ranks that hold one. train.py, eval.py, the optimizer's step gate and the
preparation of raw data share these."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from config import Comm
from errors import RecipeError

T = TypeVar("T")


def init_distributed(cfg: Comm, *, dump_folder: str) -> tuple[torch.device, int, int]:
    """NCCL on CUDA, gloo on CPU; a one-process group when not launched by torchrun."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
        # NCCL's flight recorder: the last trace_buf_size collectives of each rank, dumped when one
        # times out (what every rank was doing when the job hung). Set before the group exists.
        if cfg.trace_buf_size > 0:
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(cfg.trace_buf_size))
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            prefix = Path(dump_folder) / cfg.save_traces_folder / cfg.save_traces_file_prefix
            prefix.parent.mkdir(parents=True, exist_ok=True)
            os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(prefix))
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=cfg.init_timeout_seconds)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device, dist.get_rank(), dist.get_world_size()


def set_collective_timeout(seconds: int, *, groups: list[dist.ProcessGroup | None]) -> None:
    """From now on a collective that waits longer than `seconds` fails the job instead of hanging it."""
    # Private (PyTorch 2.13, as torchtitan uses it): no public API changes a live group's timeout.
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


class CollectiveTimeout:
    """After the first step every rank is past start-up: from then on a collective that waits longer than
    comm.train_timeout_seconds fails the job instead of hanging it (start-up has comm.init_timeout_seconds)."""

    def __init__(self, cfg: Comm, groups: list[dist.ProcessGroup | None]):
        self.seconds, self.groups, self.done = cfg.train_timeout_seconds, groups, False

    def __call__(self, step: int, result: object) -> bool:
        if not self.done:
            set_collective_timeout(self.seconds, groups=self.groups)
            self.done = True
        return False


def collective_on_rank0(fn: Callable[[], T], *, rank: int) -> T | None:
    """A collective: every rank calls it, rank 0 runs `fn`, and a RecipeError there stops every rank with the same
    error. Rank 0 gets the result, the others None."""
    failed: list[tuple[type[RecipeError], list[str]] | None] = [None]
    result = None
    if rank == 0:
        try:
            result = fn()
        except RecipeError as e:
            failed[0] = (type(e), e.problems)
    dist.broadcast_object_list(failed, src=0)
    if failed[0]:
        kind, problems = failed[0]
        raise kind(*problems)
    return result


def collective_on_every_rank(fn: Callable[[], T]) -> T:
    """A collective: every rank runs `fn` (which may do nothing on some), and when it failed on any rank, every rank
    raises. A rank that left alone would leave the others waiting in their next collective until gloo's "Connection
    closed by peer" traceback (NCCL's time-out) ends them.

    A RecipeError is raised on every rank as the lowest failing rank raised it, so that rank 0 prints it once; any
    other exception goes on up its own rank with its traceback, and the others raise a RecipeError naming that rank.
    Without a process group of several ranks it is `fn()`."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    error: Exception | None = None
    try:
        result = fn()
    except Exception as e:
        error = e
    told: tuple[type[RecipeError], list[str]] | None = None
    if isinstance(error, RecipeError):
        told = (type(error), error.problems)
    elif error is not None:
        told = (RecipeError, [f"rank {dist.get_rank()} failed ({type(error).__name__}: {error}); see its traceback"])
    everyone: list[tuple[type[RecipeError], list[str]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, told)
    if error is not None and not isinstance(error, RecipeError):
        raise error
    if found := next((t for t in everyone if t), None):
        kind, problems = found
        raise kind(*problems)
    return result


def mean_over_loss_ranks(value: torch.Tensor, *, pp_degree: int = 1) -> torch.Tensor:
    """The run's mean of a per-rank loss (a float32 device tensor; one all-reduce, no host read).

    Data-parallel ranks hold different losses; TP and CP ranks of a group hold equal ones. Under
    pipeline parallel only the ranks of the last stage hold a loss (the others 0), one rank in
    `pp_degree`: their mean is the sum over the world divided by world / pp_degree."""
    total = value.detach().float().reshape(()).clone()
    dist.all_reduce(total)  # SUM: gloo has no AVG
    return total * pp_degree / dist.get_world_size()


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor as the plain tensor it stands for (its shards gathered, its partial sums reduced: the same on every
    rank of its mesh), a plain tensor as it is. The one place a DTensor is unwrapped this way (the loss's sums over
    vocabulary shards, the gradient norm's per-mesh norms)."""
    return value.full_tensor() if isinstance(value, DTensor) else value
