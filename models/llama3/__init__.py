from models.llama3.model import (
    FLAVORS,
    ModelArgs,
    Transformer,
    TransformerBlock,
    num_flops_per_token,
    num_params,
)

__all__ = [
    "FLAVORS",
    "ModelArgs",
    "Transformer",
    "TransformerBlock",
    "num_flops_per_token",
    "num_params",
]
