"""Llama 3 (3.0, 3.1, 3.2 text): the family as the generic code sees it (models/__init__.py)."""

from models.family import ModelFamily
from models.llama3 import hf, plans
from models.llama3.model import (
    FLAVORS,
    ModelArgs,
    Transformer,
    num_flops_per_token,
    num_params,
    torchtitan_interleaved,
)

FAMILY = ModelFamily(
    name="llama3",
    flavors=FLAVORS,
    flavor_aliases={"8B": "llama3_8b", "70B": "llama3_70b", "405B": "llama3_405b"},  # torchtitan's names
    model_cls=Transformer,
    tp_plan=plans.tp_plan,
    sac_saved_linears=plans.SAC_SAVED_LINEARS,
    hidden_matrices=plans.HIDDEN_MATRICES,
    num_params=num_params,
    num_flops_per_token=num_flops_per_token,
    hf=hf,
    torchtitan_interleaved=torchtitan_interleaved,
)

__all__ = ["FAMILY", "FLAVORS", "ModelArgs", "Transformer", "num_flops_per_token", "num_params"]
