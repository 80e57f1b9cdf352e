"""A trained model outside training, for generate.py and eval.py --tasks alike: `load_model`, the model of a DCP step
folder written by train.py (any step, saved on any number of ranks and any layout) or of a Hugging Face folder, in
eval mode, split over a tensor-parallel mesh when given; and `hf_tokenizer`, transformers' tokenizer of a tokenizer
folder (its chat template; lm-eval's encoding). Its own module so that generation and evaluation each load through it
and neither imports the other: a fork deletes either one (docs/development.md, "Removing a part").

LoRA: a step folder of a [lora] run holds the adapters (the base is the run's checkpoint.initial_load_path or
model.hf_assets_path, as its config.toml names it: `lora_base`); `load_model` reads that base and merges the step's
adapters into its weights (W + s B A, lora.merge_adapters), so what generates and evaluates is a plain model that
computes what the run's model with adapters does. A PEFT adapter folder (`adapter=`) is merged into any base alike."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from errors import ConfigError


def load_model(
    path: Path,
    *,
    config: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    tp_mesh: DeviceMesh | None = None,
    adapter: Path | None = None,
    base: Path | None = None,
) -> tuple[nn.Module, str | None]:
    """The model of a DCP step folder or a Hugging Face folder, in eval mode (split over `tp_mesh` when given), and
    its tokenizer path (None: an HF folder without tokenizer.json). Built on the meta device, the weights read once.
    A LoRA run's step: its base (`base`, else the one its config names) with the step's adapters merged; `adapter`:
    a PEFT adapter folder merged in."""
    import lora
    from models import family

    cfg = None
    if (path / "config.json").is_file():  # a Hugging Face folder
        from models.hf import family_of_hf_config, model_args_from_hf

        fam = family_of_hf_config(path)
        args = model_args_from_hf(fam, path)
        tokenizer_path = str(path) if (path / "tokenizer.json").is_file() else None
    else:
        from checkpoint import refuse_folder_of_steps
        from config import model_args

        refuse_folder_of_steps(path, key="--checkpoint")  # a run folder or its checkpoint folder, not a step
        cfg, config = step_config(path, config)
        fam, args, tokenizer_path = family(cfg.model.name), model_args(cfg.model), cfg.model.tokenizer_path
    key = "--checkpoint"  # what named the weights' folder (a LoRA step's: its base)
    path, key, merges = weights_and_adapters(path, cfg, config=config, fam=fam, adapter=adapter, base=base)
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

        load_model_weights(path, model, key=key)  # DCP reshards onto this layout
    for adapters, s in merges:
        lora.merge_adapters(model, adapters, s)
    model.to(dtype)
    model.init_buffers(device)  # the RoPE table stays float32 whatever the weights' dtype
    return model.eval(), tokenizer_path


def step_config(step: Path, config: Path | None) -> tuple[Any, Path]:
    """The JobConfig a DCP step was trained with (config.toml beside the step folders, or `config`), and its path."""
    from config import load_config

    config = config or step.parent / "config.toml"
    if not config.is_file():
        raise ConfigError(
            f"--config: no config.toml beside {step} (train.py writes one when it checkpoints); pass the TOML it "
            "was trained with, --config FILE"
        )
    return load_config(["--config", str(config)]), config


def weights_and_adapters(
    path: Path, cfg: Any, *, config: Path | None, fam: Any, adapter: Path | None, base: Path | None
) -> tuple[Path, str, list[tuple[dict[str, torch.Tensor], float]]]:
    """Where the weights of --checkpoint `path` come from, the option that named it, and the (adapters, scale) to merge
    into them: a LoRA run's DCP step (`cfg` its config) is its base (`base`, else `lora_base`) and the step's
    adapters; `adapter`, a PEFT folder, adds its own. load_model and eval.py's held-out loss read a checkpoint so."""
    from lora import read_peft_folder, scaling

    merges, key = [], "--checkpoint"
    if cfg is not None and cfg.lora.enable and not (path / "config.json").is_file():  # the step holds the adapters
        merges.append((step_adapters(path, key="--checkpoint"), scaling(cfg.lora)))
        path, key = (base, "--base") if base else (lora_base(cfg, config=config), f"the base of {path}")
    if adapter is not None:
        merges.append(read_peft_folder(adapter, fam, key="--adapter"))
    return path, key, merges


def add_adapter_arguments(parser: Any) -> None:
    """--adapter and --base, as generate.py and eval.py take them."""
    parser.add_argument(
        "--adapter",
        type=Path,
        help="a PEFT LoRA adapter folder to apply to --checkpoint (merged into its weights in memory)",
    )
    parser.add_argument(
        "--base",
        type=Path,
        help="a LoRA step's base, a DCP step or HF folder (default: its config's checkpoint.initial_load_path, else "
        "model.hf_assets_path)",
    )


def step_adapters(step: Path, *, key: str) -> dict[str, torch.Tensor]:
    """The adapters a LoRA run's DCP step folder holds (`model_and_optimizer.model.<adapter name>`, whole, float32
    as trained), and nothing else of it: the base, if the step holds one too, is read from the run's base path."""
    import torch.distributed.checkpoint as dcp

    from checkpoint import MODEL_PREFIX, verify, verify_contents
    from lora import is_adapter

    metadata = verify(step, key=key)
    names = [k for k in metadata.state_dict_metadata if k.startswith(MODEL_PREFIX) and is_adapter(k)]
    if not names:
        raise ConfigError(
            f"{key}: {step} holds no LoRA adapters (no model_and_optimizer.model.<linear>.lora_A.weight); is it a "
            "step of a run with [lora] enable = true?"
        )
    verify_contents(step, key=key, alone=True)
    stored = metadata.state_dict_metadata
    state = {k: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype) for k in names}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(step), no_dist=True)
    return {k.removeprefix(MODEL_PREFIX): t for k, t in state.items()}


def lora_base(cfg: Any, *, config: Path) -> Path:
    """The base a LoRA run trained its adapters on, as the run read it: checkpoint.initial_load_path (a DCP step, or a
    Hugging Face folder), else model.hf_assets_path's weights with initial_load_in_hf; refused, naming the key, where
    the run had none (its base was a random init) or it is gone."""
    if cfg.checkpoint.initial_load_path is not None:
        key, base = "checkpoint.initial_load_path", Path(cfg.checkpoint.initial_load_path)
        found = (base / "config.json").is_file() or (base / ".metadata").is_file()
    elif cfg.checkpoint.initial_load_in_hf and cfg.model.hf_assets_path is not None:
        key, base = "model.hf_assets_path", Path(cfg.model.hf_assets_path)
        found = (base / "config.json").is_file() and any(base.glob("*.safetensors"))
    else:
        raise ConfigError(
            f"checkpoint.initial_load_path: {config} names no base for the adapters (nor model.hf_assets_path with "
            "checkpoint.initial_load_in_hf), and a LoRA step holds the adapters only; pass the base with --base"
        )
    if not found:
        raise ConfigError(
            f"{key}: {base} (the adapters' base, named in {config}) is missing or holds no weights; pass the base "
            "with --base"
        )
    return base


def hf_tokenizer(tokenizer_path: str) -> Any:
    """transformers' tokenizer of a tokenizer folder (or tokenizer.json): its chat template, lm-eval's encoding."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(tokenizer_path)
    if path.is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    return AutoTokenizer.from_pretrained(str(path))
