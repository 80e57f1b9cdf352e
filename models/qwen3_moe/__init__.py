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
    hf=hf,
    # torchtitan's Qwen3 rotates halves, as this one does. (Its MoE checkpoints name the router moe.router.gate and
    # hold a load-balancing expert_bias: reading them is for issue 65's later parts.)
    torchtitan_interleaved=lambda args: {},
    config_problems=plans.config_problems,
)

__all__ = ["FAMILY", "FLAVORS", "ModelArgs", "Transformer", "active_params", "num_flops_per_token", "num_params"]
