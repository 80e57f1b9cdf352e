"""Parallel degrees -> one named DeviceMesh.

The mesh always has the four dimensions ("pp", "dp_replicate", "dp_shard", "tp"), size 1 where a
technique is off, so every `apply_*` function can take the sub-mesh it needs by name:

    world = pp x dp_replicate x dp_shard x tp
    "pp"                          pipeline stages (outermost: only activations cross it, point to point)
    ("dp_replicate", "dp_shard")  HSDP: replicate across the outer dim, shard the inner one
    "dp_shard"                    FSDP alone
    "tp"                          tensor + sequence parallel (innermost: the fastest links)

A rank's data-parallel index is `dp_rank(mesh)`; the TP ranks of one group and the PP ranks of
one pipeline share it and so read the same micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from config import Parallelism
from errors import ConfigError
from parallelisms.pp import check_microbatches, stage_layers
from parallelisms.tp import check_tp


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    pp: int = 1

    @classmethod
    def from_config(cls, cfg: Parallelism, *, world_size: int) -> ParallelDims:
        """Resolve data_parallel_shard_degree = -1 and check that the degrees fill the world."""
        pp, rep, shard, tp = (
            cfg.pipeline_parallel_degree,
            cfg.data_parallel_replicate_degree,
            cfg.data_parallel_shard_degree,
            cfg.tensor_parallel_degree,
        )
        if shard == -1:
            if world_size % (pp * rep * tp):
                raise ConfigError(
                    f"parallelism: pipeline_parallel_degree ({pp}) x data_parallel_replicate_degree ({rep}) x "
                    f"tensor_parallel_degree ({tp}) does not divide the world size {world_size}; change the degrees "
                    "or the number of processes"
                )
            shard = world_size // (pp * rep * tp)
        if pp * rep * shard * tp != world_size:
            raise ConfigError(
                f"parallelism: pipeline {pp} x replicate {rep} x shard {shard} x tensor {tp} = "
                f"{pp * rep * shard * tp} ranks, but the world size is {world_size}; make the degrees multiply to "
                "the number of processes (data_parallel_shard_degree = -1 takes whatever is left)"
            )
        return cls(pp=pp, dp_replicate=rep, dp_shard=shard, tp=tp, world_size=world_size)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
        )

    def dp_rank(self, mesh: DeviceMesh) -> int:
        """This rank's index among the dp_replicate x dp_shard data-parallel ranks."""
        return mesh["dp_replicate"].get_local_rank() * self.dp_shard + mesh["dp_shard"].get_local_rank()


def layout_problems(par: Parallelism, *, world_size: int, args: Any, seq_len: int, local_batch_size: int) -> list[str]:
    """Every problem of the parallel layout for this world and model, from the rules where they live: the degrees
    (ParallelDims), what TP needs of the shape (check_tp), the pipeline's split and micro-batches (pp.py). The run
    (load_config) and the memory estimator ask the same rules."""
    rules = [lambda: ParallelDims.from_config(par, world_size=world_size)]
    if par.tensor_parallel_degree > 1:
        rules.append(lambda: check_tp(args, tp_degree=par.tensor_parallel_degree, seq_len=seq_len))
    if par.pipeline_parallel_degree > 1:
        rules.append(lambda: stage_layers(args, par))
        rules.append(lambda: check_microbatches(par, local_batch_size=local_batch_size))
    problems: list[str] = []
    for rule in rules:
        try:
            rule()
        except ConfigError as e:
            problems += e.problems
    return problems
