"""A trained model outside training, for generate.py and eval.py --tasks alike: `load_model`, the model of a DCP step
folder written by train.py (any step, saved on any number of ranks and any layout) or of a Hugging Face folder, in
eval mode, split over a tensor-parallel mesh when given; and `hf_tokenizer`, transformers' tokenizer of a tokenizer
folder (its chat template; lm-eval's encoding). Its own module so that generation and evaluation each load through it
and neither imports the other: a fork deletes either one (docs/development.md, "Removing a part")."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from errors import ConfigError


def load_model(
    path: Path, *, config: Path | None, device: torch.device, dtype: torch.dtype, tp_mesh: DeviceMesh | None = None
) -> tuple[nn.Module, str | None]:
    """The model of a DCP step folder or a Hugging Face folder, in eval mode (split over `tp_mesh` when given), and
    its tokenizer path (None: an HF folder without tokenizer.json). Built on the meta device, the weights read once."""
    from models import family

    if (path / "config.json").is_file():  # a Hugging Face folder
        from models.hf import family_of_hf_config, model_args_from_hf

        fam = family_of_hf_config(path)
        args = model_args_from_hf(fam, path)
        tokenizer_path = str(path) if (path / "tokenizer.json").is_file() else None
    else:
        from checkpoint import refuse_folder_of_steps
        from config import load_config, model_args

        refuse_folder_of_steps(path, key="--checkpoint")  # a run folder or its checkpoint folder, not a step
        config = config or path.parent / "config.toml"
        if not config.is_file():
            raise ConfigError(
                f"--config: no config.toml beside {path} (train.py writes one when it checkpoints); pass the TOML it "
                "was trained with, --config FILE"
            )
        cfg = load_config(["--config", str(config)])
        fam, args, tokenizer_path = family(cfg.model.name), model_args(cfg.model), cfg.model.tokenizer_path
    with torch.device("meta"):
        model = fam.model_cls(args)
    if tp_mesh is not None:
        from parallelisms.tp import apply_tp_inference

        apply_tp_inference(model, tp_mesh, block_plan=fam.tp_plan)
    model.to_empty(device=device)
    if (path / "config.json").is_file():
        from models.hf import load_hf_weights

        load_hf_weights(model, path, fam, args)
    else:
        from checkpoint import load_model_weights

        load_model_weights(path, model, key="--checkpoint")  # DCP reshards onto this layout
    model.to(dtype)
    model.init_buffers(device)  # the RoPE table stays float32 whatever the weights' dtype
    return model.eval(), tokenizer_path


def hf_tokenizer(tokenizer_path: str) -> Any:
    """transformers' tokenizer of a tokenizer folder (or tokenizer.json): its chat template, lm-eval's encoding."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(tokenizer_path)
    if path.is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    return AutoTokenizer.from_pretrained(str(path))
