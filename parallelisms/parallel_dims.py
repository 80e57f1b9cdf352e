"""Parallel degrees -> one named DeviceMesh.

The mesh always has the five dimensions ("pp", "dp_replicate", "dp_shard", "cp", "tp"), size 1
where a technique is off, so every `apply_*` function can take the sub-mesh it needs by name:

    world = pp x dp_replicate x dp_shard x cp x tp
    "pp"                          pipeline stages (outermost: only activations cross it, point to point)
    ("dp_replicate", "dp_shard")  HSDP: replicate across the outer dim, shard the inner one
    "dp_shard"                    FSDP alone
    "cp"                          context parallel: the ranks that split each window's tokens
    "tp"                          tensor + sequence parallel (innermost: the fastest links)

FSDP shards parameters over dp_shard x cp (`fsdp_mesh`, torchtitan's rule): the CP ranks of a group
compute on different tokens with the same weights, so their gradients are averaged like data
parallel's, and sharding over them costs nothing more.

Expert parallel (ep, parallelisms/ep.py) is not a sixth dimension: its ranks are ranks that hold different tokens at
a mixture of experts, the dp_shard x cp x tp ranks of a replica (under sequence parallel each TP rank holds its own
part of the sequence there). `expert_meshes` lays those out again as ("efsdp", "ep"), ep innermost: each rank holds
experts / ep of every block's experts, and FSDP shards them over the efsdp = dp_shard x cp x tp / ep ranks left
(torchtitan's layout with expert_tensor_parallel_degree 1).

A rank's data-parallel index is `dp_rank(mesh)`; the TP ranks of one group, the CP ranks of one
group and the PP ranks of one pipeline share it and so read the same micro-batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from config import model_args
from errors import ConfigError
from models import family
from parallelisms.cp import check_cp
from parallelisms.ep import check_ep
from parallelisms.pp import check_microbatches, split_layers
from parallelisms.tp import check_tp

if TYPE_CHECKING:
    from config import JobConfig, Parallelism


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @classmethod
    def from_config(cls, cfg: Parallelism, *, world_size: int) -> ParallelDims:
        """The layout of a [parallelism] section on world_size ranks (resolve)."""
        return cls.resolve(
            world_size=world_size,
            pp=cfg.pipeline_parallel_degree,
            dp_replicate=cfg.data_parallel_replicate_degree,
            dp_shard=cfg.data_parallel_shard_degree,
            cp=cfg.context_parallel_degree,
            tp=cfg.tensor_parallel_degree,
            ep=cfg.expert_parallel_degree,
        )

    @classmethod
    def resolve(
        cls, *, world_size: int, pp: int, dp_replicate: int, dp_shard: int, cp: int, tp: int, ep: int = 1
    ) -> ParallelDims:
        """Resolve dp_shard = -1 (parallelism.data_parallel_shard_degree) and check that the degrees fill the world."""
        rep, shard = dp_replicate, dp_shard
        if shard == -1:
            if world_size % (pp * rep * cp * tp):
                raise ConfigError(
                    f"parallelism: pipeline_parallel_degree ({pp}) x data_parallel_replicate_degree ({rep}) x "
                    f"context_parallel_degree ({cp}) x tensor_parallel_degree ({tp}) does not divide the world size "
                    f"{world_size}; change the degrees or the number of processes"
                )
            shard = world_size // (pp * rep * cp * tp)
        if pp * rep * shard * cp * tp != world_size:
            raise ConfigError(
                f"parallelism: pipeline {pp} x replicate {rep} x shard {shard} x context {cp} x tensor {tp} = "
                f"{pp * rep * shard * cp * tp} ranks, but the world size is {world_size}; make the degrees multiply "
                "to the number of processes (data_parallel_shard_degree = -1 takes whatever is left)"
            )
        if (shard * cp * tp) % ep:
            raise ConfigError(
                f"parallelism.expert_parallel_degree: {ep} does not divide data_parallel_shard_degree {shard} x "
                f"context_parallel_degree {cp} x tensor_parallel_degree {tp} = {shard * cp * tp}, the ranks of a "
                f"replica that hold their own tokens at the experts; use a divisor of {shard * cp * tp}"
            )
        return cls(pp=pp, dp_replicate=rep, dp_shard=shard, tp=tp, world_size=world_size, cp=cp, ep=ep)

    def describe(self) -> str:
        """The layout as start-up and the dry run print it: "replicate R x shard S x [cp C x ]tp T[ (ep E)]"."""
        cp = f"cp {self.cp} x " if self.cp_enabled else ""
        ep = f" (ep {self.ep})" if self.ep_enabled else ""
        return f"replicate {self.dp_replicate} x shard {self.dp_shard} x {cp}tp {self.tp}{ep}"

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (or replicated, HSDP) over more than one rank."""
        return self.dp * self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """The ranks of a replica that shard each expert parallel rank's experts with FSDP (the module docstring)."""
        return self.dp_shard * self.cp * self.tp // self.ep

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
        )

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards over: dp_shard (x cp, flattened into "dp_shard_cp"), under dp_replicate for HSDP."""
        if not self.cp_enabled:
            return mesh["dp_replicate", "dp_shard"] if self.hsdp_enabled else mesh["dp_shard"]
        flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # (private, PyTorch 2.13, as torchtitan uses it)
        if not self.hsdp_enabled:
            return flat
        with warnings.catch_warnings():  # 2.13 warns that slicing a flattened dimension will change; no other way yet
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return mesh["dp_replicate", "dp_shard_cp"]

    def expert_meshes(self, mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
        """(the "ep" mesh the experts are split over, the mesh FSDP shards them over: "efsdp", under "dp_replicate"
        for HSDP), from `mesh`'s dp_shard x cp x tp ranks laid out again as ("efsdp", "ep") (the module docstring).
        Private DeviceMesh methods of PyTorch 2.13 (_flatten, _unflatten, _concatenate), as torchtitan uses them; the
        meshes share `mesh`'s root, so FSDP composes with the experts' ep sharding as with TP's."""
        tokens = mesh["dp_shard", "cp", "tp"]._flatten("dp_shard_cp_tp")
        sparse = tokens._unflatten(0, (self.efsdp, self.ep), ("efsdp", "ep"))
        efsdp = (
            DeviceMesh._concatenate([mesh["dp_replicate"], sparse["efsdp"]]) if self.hsdp_enabled else sparse["efsdp"]
        )
        return sparse["ep"], efsdp

    def dp_rank(self, mesh: DeviceMesh) -> int:
        """This rank's index among the dp_replicate x dp_shard data-parallel ranks."""
        return mesh["dp_replicate"].get_local_rank() * self.dp_shard + mesh["dp_shard"].get_local_rank()


def layout_problems(cfg: JobConfig, *, world_size: int) -> list[str]:
    """Every problem of cfg's parallel layout on world_size ranks, from the rules where they live: the degrees
    (ParallelDims), what TP needs of the model's shape and the sequence (check_tp), how CP cuts a window (check_cp),
    what expert parallel needs of the experts and the run (check_ep),
    the pipeline's split and micro-batches (pp.py). The run (train.py passes layout_checks to load_config) and the
    memory estimator ask the same rules."""
    par, seq_len = cfg.parallelism, cfg.training.seq_len
    pp, rep, cp, tp, ep = (
        par.pipeline_parallel_degree,
        par.data_parallel_replicate_degree,
        par.context_parallel_degree,
        par.tensor_parallel_degree,
        par.expert_parallel_degree,
    )
    if min(pp, rep, cp, tp, ep) < 1:
        return []  # config.validate names the degree; no layout rule can divide by it
    args = model_args(cfg.model)
    rules = [lambda: ParallelDims.from_config(par, world_size=world_size)]
    if cp > 1:
        seq_lens = {"training.seq_len": seq_len} | (
            {"validation.seq_len": cfg.validation.seq_len} if cfg.validation.enable else {}
        )
        rules.append(
            lambda: check_cp(cp=cp, tp=tp, load_balancer=par.context_parallel_load_balancer, seq_lens=seq_lens)
        )
    if tp > 1:
        rules.append(lambda: check_tp(args, tp_degree=tp, seq_len=seq_len))
    if ep > 1 and (experts := family(cfg.model.name).num_experts(args)):  # a dense family is refused with the config
        compiled = cfg.compile.enable and "model" in cfg.compile.components
        rules.append(lambda: check_ep(ep=ep, num_experts=experts, compiled=compiled))
    if pp > 1:
        rules.append(
            lambda: split_layers(
                args,
                pp=pp,
                schedule=par.pipeline_parallel_schedule,
                layers_per_stage=par.pipeline_parallel_layers_per_stage,
                first_less=par.pipeline_parallel_first_stage_less_layers,
                last_less=par.pipeline_parallel_last_stage_less_layers,
            )
        )
        rules.append(
            lambda: check_microbatches(
                pp=pp,
                schedule=par.pipeline_parallel_schedule,
                microbatch_size=par.pipeline_parallel_microbatch_size,
                local_batch_size=cfg.training.local_batch_size,
            )
        )
    problems: list[str] = []
    for rule in rules:
        try:
            rule()
        except ConfigError as e:
            problems += e.problems
    return problems


def layout_checks(world_size: int) -> Callable[[JobConfig], list[str]]:
    """config.load_config's extra_checks for a run on world_size ranks: the layout's rules, in the config's round."""
    return lambda cfg: layout_problems(cfg, world_size=world_size)


def uses_loss_parallel(cfg: JobConfig, dims: ParallelDims) -> bool:
    """Whether the loss runs on vocabulary-sharded logits: under TP, unless parallelism.disable_loss_parallel."""
    return dims.tp_enabled and not cfg.parallelism.disable_loss_parallel
