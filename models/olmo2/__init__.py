"""OLMo 2 (7B, 13B): the family as the generic code sees it (models/__init__.py)."""

from models.family import ModelFamily
from models.olmo2 import hf, plans
from models.olmo2.model import FLAVORS, ModelArgs, Transformer, num_flops_per_token, num_params

FAMILY = ModelFamily(
    name="olmo2",
    flavors=FLAVORS,
    flavor_aliases={},  # the aliases are torchtitan's flavor names, and torchtitan 0.2.2 has no OLMo 2
    model_cls=Transformer,
    tp_plan=plans.tp_plan,
    sac_saved_linears=plans.SAC_SAVED_LINEARS,
    hidden_matrices=plans.HIDDEN_MATRICES,
    num_params=num_params,
    num_flops_per_token=num_flops_per_token,
    hf=hf,
    torchtitan_interleaved=lambda args: {},  # torchtitan 0.2.2 has no OLMo 2 model: no checkpoint of its to read
)

__all__ = ["FAMILY", "FLAVORS", "ModelArgs", "Transformer", "num_flops_per_token", "num_params"]
