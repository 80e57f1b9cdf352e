"""`ModelFamily`: what the generic code needs to know about one architecture (models/__init__.py
describes the skeleton its model keeps). Its own module so that a family folder imports it without
importing the package that looks families up."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ModelFamily:
    """What the generic code needs to know about one architecture."""

    name: str
    flavors: Mapping[str, Any]
    """Flavor name -> ModelArgs (a frozen dataclass with the skeleton's fields)."""
    flavor_aliases: Mapping[str, str]
    """Other names users type for a flavor (torchtitan's "8B"), -> a key of flavors."""
    model_cls: Callable[[Any], nn.Module]
    """ModelArgs -> the module (built on whatever device is current; train.py uses meta)."""
    tp_plan: Callable[[], dict[str, Any]]
    """A fresh tensor-parallel plan of one block: {module name inside the block: ParallelStyle}."""
    sac_saved_linears: tuple[str, ...]
    """Linears (names inside a block) whose matmul outputs selective op-level AC keeps."""
    num_params: Callable[..., int]
    """num_params(args, *, exclude_embedding=False): from the shapes alone."""
    num_flops_per_token: Callable[[Any, int], int]
    """num_flops_per_token(args, seq_len): training FLOPs per token, the MFU numerator."""
    hf: ModuleType
    """The family's hf.py: model_args_from_hf_config, hf_config, TOP_LEVEL, PER_LAYER, STACKED_PER_LAYER, PUBLISHED,
    MODEL_TYPE."""
    torchtitan_interleaved: Callable[[Any], dict[str, int]]
    """The weights torchtitan 0.2.2's model of this family holds in RoPE's interleaved layout, as {name inside a
    block: heads}: within each head their rows are ours permuted (checkpoint/torchtitan.py); {} when none."""
    hidden_matrices: tuple[str, ...]
    """Linears (names inside a block) whose weights Muon orthogonalizes (optimizer.name = "Muon", muon.py); every
    other parameter (embedding, output, norms) takes AdamW."""
    active_params: Callable[..., int] | None = None
    """active_params(args): the parameters one token runs through, where that is fewer than all (a mixture of
    experts); None for a dense family."""
    num_experts: Callable[[Any], int] = lambda args: 0
    """num_experts(args): the routed experts of each MoE block, which expert parallel splits over its ranks; 0 for a
    dense family."""
    experts_per_token: Callable[[Any], int] = lambda args: 0
    """experts_per_token(args): how many experts each token is routed to (top-k), which sets the rows expert
    parallel's all-to-all moves; 0 for a dense family."""
    experts_module: str = ""
    """Where a block holds its routed experts (name inside a block, e.g. "moe.experts"): a module of 3-D weights
    (experts, out, in) and forward(rows sorted by expert, tokens_per_expert), what parallelisms/ep.py splits."""
    config_problems: Callable[[Any], list[str]] = lambda cfg: []
    """config_problems(job_config): what of a run's JobConfig the family cannot train yet, one ConfigError line each
    naming the key and the fix (config validation asks with every other rule); none for a dense family."""
    training_chat_templates: Mapping[str, str] = field(default_factory=dict)
    """Chat templates the family's published tokenizers ship (tokenizer_config.json's chat_template, the exact text)
    -> a training variant of each: the same rendering, with {% generation %} marks around what the assistant says
    (data/chat.py: how a template that renders earlier turns differently once more follow is trained on)."""
    torchtitan_names: Mapping[str, str] = field(default_factory=dict)
    """Weights (names inside a block) that torchtitan 0.2.2's model of this family names otherwise, {ours: theirs}, the
    tensors alike (Qwen3 MoE's router: torchtitan's moe.router.gate.weight); their AdamW moments are renamed with
    them (checkpoint/torchtitan.py)."""
    torchtitan_zero_buffers: Callable[[Any], dict[str, tuple[int, ...]]] = lambda args: {}
    """torchtitan_zero_buffers(args): buffers (names inside a block: shapes) that torchtitan 0.2.2's model of this family
    may hold and that change nothing while zero (Qwen3 MoE's load-balancing moe.expert_bias). Where this recipe's model
    holds none by that name, torchtitan's checkpoint is read only when it holds zeros there, and an export writes
    zeros (float32)."""
