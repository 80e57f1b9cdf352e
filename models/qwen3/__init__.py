"""Qwen3 dense (0.6B to 32B): the family as the generic code sees it (models/__init__.py)."""

from models.family import ModelFamily
from models.qwen3 import chat, hf, plans
from models.qwen3.model import FLAVORS, ModelArgs, Transformer, num_flops_per_token, num_params

FAMILY = ModelFamily(
    name="qwen3",
    flavors=FLAVORS,
    flavor_aliases={  # torchtitan's names
        "0.6B": "qwen3_0.6b",
        "1.7B": "qwen3_1.7b",
        "4B": "qwen3_4b",
        "8B": "qwen3_8b",
        "14B": "qwen3_14b",
        "32B": "qwen3_32b",
    },
    model_cls=Transformer,
    tp_plan=plans.tp_plan,
    sac_saved_linears=plans.SAC_SAVED_LINEARS,
    hidden_matrices=plans.HIDDEN_MATRICES,
    num_params=num_params,
    num_flops_per_token=num_flops_per_token,
    hf=hf,
    torchtitan_interleaved=lambda args: {},  # torchtitan's Qwen3 rotates halves, as this one does
    training_chat_templates=chat.TRAINING_CHAT_TEMPLATES,  # its chat template re-renders earlier turns
)

__all__ = ["FAMILY", "FLAVORS", "ModelArgs", "Transformer", "num_flops_per_token", "num_params"]
