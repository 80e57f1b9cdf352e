"""Qwen3 MoE (30B-A3B, 235B-A22B): the family as the generic code sees it (models/__init__.py)."""

from models.family import ModelFamily
from models.qwen3_moe import hf, plans
from models.qwen3_moe.model import FLAVORS, ModelArgs, Transformer, active_params, num_flops_per_token, num_params

FAMILY = ModelFamily(
    name="qwen3_moe",
    flavors=FLAVORS,
    flavor_aliases={  # torchtitan's names (its qwen3 model's MoE flavors; its debugmodel_moe is shaped otherwise)
        "debugmodel_moe": "debugmodel",
        "30B-A3B": "qwen3_moe_30b_a3b",
        "235B-A22B": "qwen3_moe_235b_a22b",
    },
    model_cls=Transformer,
    tp_plan=plans.tp_plan,
    sac_saved_linears=plans.SAC_SAVED_LINEARS,
    hidden_matrices=plans.HIDDEN_MATRICES,
    num_params=num_params,
    num_flops_per_token=num_flops_per_token,
    active_params=active_params,
    num_experts=lambda args: args.num_experts,
    experts_per_token=lambda args: args.top_k,
    experts_module="moe.experts",
    hf=hf,
    # torchtitan 0.2.2's Qwen3 (torchtitan/models/qwen3, its MoE from torchtitan/models/moe) rotates halves, as this one
    # does; its experts' w1, w2, w3 are these (experts, out, in), its router an nn.Linear named gate (the same
    # (experts, dim) weight), and its blocks hold a float32 expert_bias (experts,) for load balancing, added to the
    # scores the top-k picks from, as models/moe.py's: zero, it changes no choice (tests/test_torchtitan_moe.py).
    torchtitan_interleaved=lambda args: {},
    torchtitan_names={"moe.router.weight": "moe.router.gate.weight", "moe.balance.expert_bias": "moe.expert_bias"},
    torchtitan_zero_buffers=lambda args: {"moe.expert_bias": (args.num_experts,)},
    config_problems=plans.config_problems,
)

__all__ = ["FAMILY", "FLAVORS", "ModelArgs", "Transformer", "active_params", "num_flops_per_token", "num_params"]
