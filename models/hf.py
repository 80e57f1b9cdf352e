"""Hugging Face folders in and out, for any family: `config.json` plus `model.safetensors` or
sharded `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json` (the tokenizer files
next to them are read by data/tokenizers.py, not here).

What differs between families (config.json's fields, weight names) is the family's hf.py, reached
as `fam.hf`: MODEL_TYPE, model_args_from_hf_config, hf_config, TOP_LEVEL and PER_LAYER (weight names one to one),
STACKED_PER_LAYER (our parameters stored as one tensor per index of their dim 0: an MoE's experts), PUBLISHED,
IGNORED_WEIGHT_SUFFIXES. This file reads and writes, checks names and shapes, and picks the family
of a folder from its model_type; the config.json fields every family reads alike are read by models/hf_reader.py,
which each family's model_args_from_hf_config calls.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from errors import ConfigError
from models import NAMES, ModelFamily, family, parameter_shapes

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # what transformers' save_pretrained uses


# ------------------------------------------------------------------------- names


def hf_to_ours(fam: ModelFamily, args: Any) -> dict[str, str]:
    """HF weight name -> our parameter name, for every weight a model of `args` stores one to one: the family's
    TOP_LEVEL names (lm_head.weight only when the output is not tied to the embedding) and its PER_LAYER names in each
    layer. (All of them but a family's STACKED_PER_LAYER parameters: `hf_sources` covers those too.)"""
    tied = args.tie_word_embeddings
    names = {hf: ours for hf, ours in fam.hf.TOP_LEVEL.items() if not (tied and hf == "lm_head.weight")}
    for i in range(args.n_layers):
        names |= {f"model.layers.{i}.{hf}.weight": f"layers.{i}.{ours}.weight" for hf, ours in fam.hf.PER_LAYER.items()}
    return names


def hf_sources(fam: ModelFamily, args: Any) -> dict[str, tuple[str, int | None]]:
    """HF weight name -> (our parameter name, the index along its dim 0 that the HF tensor is, or None for the whole
    parameter), for every weight of a model of `args`: `hf_to_ours` whole, and the family's STACKED_PER_LAYER
    parameters one HF tensor per index (an MoE's experts, stored one tensor each on the hub)."""
    sources: dict[str, tuple[str, int | None]] = {hf: (ours, None) for hf, ours in hf_to_ours(fam, args).items()}
    if fam.hf.STACKED_PER_LAYER:
        shapes = parameter_shapes(fam, args)
        for i in range(args.n_layers):
            for hf, ours in fam.hf.STACKED_PER_LAYER.items():
                name = f"layers.{i}.{ours}"
                sources |= {f"model.layers.{i}.{hf.format(e)}": (name, e) for e in range(shapes[name][0])}
    return sources


def stacked(sources: dict[str, tuple[str, int | None]]) -> bool:
    """Whether some parameter of `hf_sources` is stacked from several HF tensors (no one-to-one copy of names)."""
    return any(index is not None for _, index in sources.values())


def hf_shapes(sources: dict[str, tuple[str, int | None]], shapes: dict[str, torch.Size]) -> dict[str, torch.Size]:
    """HF weight name -> its shape, in the order of our parameters in `shapes` (the order files are written in): a
    stacked parameter's HF tensors are one index of its dim 0 each."""
    by_parameter: dict[str, list[tuple[str, int | None]]] = {}
    for hf, (ours, index) in sources.items():
        by_parameter.setdefault(ours, []).append((hf, index))
    return {
        hf: shapes[ours] if index is None else shapes[ours][1:] for ours in shapes for hf, index in by_parameter[ours]
    }


def hf_tensor(whole: torch.Tensor, index: int | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The HF tensor `hf_sources` names in our parameter `whole`: all of it, or its slice at `index` along dim 0,
    copied (safetensors refuses tensors that share memory); in `dtype` when given."""
    t = whole if index is None else whole[index].clone()
    return t if dtype is None else t.to(dtype)


# ------------------------------------------------------------------------- config


def read_hf_config(path: str | Path) -> tuple[dict[str, Any], Path]:
    """The contents of a Hugging Face folder's config.json (or of the file itself), and the file."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ConfigError(f"{path}: no config.json found; point at a Hugging Face folder (config.json + *.safetensors)")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: not a config.json (a JSON object of model settings)")
    return config, file


def family_of_hf_config(path: str | Path) -> ModelFamily:
    """The family whose MODEL_TYPE is the folder's config.json model_type."""
    config, file = read_hf_config(path)
    model_type = config.get("model_type")
    for name in NAMES:
        if model_type == family(name).hf.MODEL_TYPE:
            return family(name)
    known = ", ".join(f"{family(n).hf.MODEL_TYPE!r} ({n})" for n in NAMES)
    raise ConfigError(f"{file}: model_type {model_type!r} is no family of this recipe ({known})")


def model_args_from_hf(fam: ModelFamily, path: str | Path) -> Any:
    """ModelArgs of `fam` from a Hugging Face folder's config.json; every field the model cannot compute is
    refused in one ConfigError."""
    config, file = read_hf_config(path)
    if config.get("model_type", fam.hf.MODEL_TYPE) != fam.hf.MODEL_TYPE:
        other = next((n for n in NAMES if config["model_type"] == family(n).hf.MODEL_TYPE), None)
        fix = f"set model.name = {other!r}" if other else f"use a {fam.hf.MODEL_TYPE!r} folder"
        raise ConfigError(
            f"{file}: model_type = {config['model_type']!r} is not a {fam.name} model "
            f"(model_type {fam.hf.MODEL_TYPE!r}); {fix}"
        )
    if config.get("quantization_config") is not None:
        raise ConfigError(f"{file}: quantization_config is set; convert an unquantized (bf16/fp32) checkpoint")
    return fam.hf.model_args_from_hf_config(config, source=str(file))


def hf_config(fam: ModelFamily, args: Any, *, dtype: torch.dtype, **token_ids: int) -> dict[str, Any]:
    """The family's config.json for `args`, with bos_token_id / eos_token_id when given."""
    return fam.hf.hf_config(args, dtype=dtype) | token_ids


# ------------------------------------------------------------------------ reading


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    # Top level only: downloaded Llama folders also hold Meta's original/ weights, not read here.
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        hint = (
            " (found pytorch_model*.bin: re-save with save_pretrained, which writes safetensors)"
            if any(folder.glob("pytorch_model*.bin"))
            else ""
        )
        raise ConfigError(f"{folder}: no *.safetensors weights{hint}; point at a Hugging Face folder")
    return files


def _ignored(fam: ModelFamily, args: Any, hf_name: str) -> bool:
    return hf_name.endswith(tuple(fam.hf.IGNORED_WEIGHT_SUFFIXES)) or (
        hf_name == "lm_head.weight" and args.tie_word_embeddings
    )


def check_hf_weights(path: str | Path, fam: ModelFamily, args: Any) -> None:
    """Every weight of a model of `args` is in the folder with its shape, and nothing else is: read
    from the safetensors headers alone. Raises ConfigError naming the first problem."""
    from safetensors import safe_open

    folder = Path(path)
    expected = {hf: tuple(shape) for hf, shape in hf_shapes(hf_sources(fam, args), parameter_shapes(fam, args)).items()}
    seen: set[str] = set()
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                if _ignored(fam, args, hf_name):
                    continue
                if hf_name not in expected:
                    raise ConfigError(f"{file}: unexpected weight {hf_name}; is this a {fam.name} model of this size?")
                shape = tuple(f.get_slice(hf_name).get_shape())
                if shape != expected[hf_name]:
                    raise ConfigError(
                        f"{file}: {hf_name} has shape {shape}, the model expects {expected[hf_name]}; check model.flavor"
                    )
                seen.add(hf_name)
    if missing := [name for name in expected if name not in seen]:
        raise ConfigError(f"{folder}: {len(missing)} weights missing, e.g. {missing[0]}; is the download complete?")


def read_hf_weights(path: str | Path, fam: ModelFamily, args: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) for every weight of an HF folder, one tensor at a time (a stacked parameter once all its
    HF tensors are read, in whichever files they are), checked against `args` first (`check_hf_weights`)."""
    from safetensors import safe_open

    check_hf_weights(path, fam, args)
    sources = hf_sources(fam, args)
    sizes = Counter(ours for ours, index in sources.values() if index is not None)
    parts: dict[str, dict[int, torch.Tensor]] = {}  # a stacked parameter's HF tensors read so far, by index
    for file in _weight_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                if hf_name not in sources:
                    continue
                ours, index = sources[hf_name]
                if index is None:
                    yield ours, f.get_tensor(hf_name)
                    continue
                parts.setdefault(ours, {})[index] = f.get_tensor(hf_name)
                if len(parts[ours]) == sizes[ours]:
                    read = parts.pop(ours)
                    yield ours, torch.stack([read[i] for i in range(sizes[ours])])


def from_hf(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[nn.Module, Any]:
    """The model of a Hugging Face folder (its family from config.json's model_type) with its weights,
    and its ModelArgs. Built on the meta device and filled by assignment: the weights exist once."""
    fam = family_of_hf_config(path)
    args = model_args_from_hf(fam, path)
    state = {name: tensor.to(device=device, dtype=dtype) for name, tensor in read_hf_weights(path, fam, args)}
    with torch.device("meta"):
        model = fam.model_cls(args)
    model.load_state_dict(state, strict=True, assign=True)
    model.init_buffers(torch.device(device))  # derived from args (the RoPE table), never stored
    return model, args


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | Path, fam: ModelFamily, args: Any) -> None:
    """Copy an HF folder's weights into `model`, built from `args` and already allocated: plain, or sharded by FSDP
    or TP (each rank keeps its shard of each weight; every rank reads the files, so nothing is sent). A pipeline
    stage takes the weights of its own modules. One tensor in memory at a time besides the model."""
    from torch.distributed.tensor import distribute_tensor

    state = model.state_dict()
    for name, full in read_hf_weights(path, fam, args):
        if (target := state.get(name)) is None:  # another pipeline stage's
            continue
        if isinstance(target, DTensor):
            shard = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(full)


# ------------------------------------------------------------------------ writing


def plan_shards(sizes: dict[str, int], *, max_shard_bytes: int) -> list[list[str]]:
    """Group names (in order) into shards of at most max_shard_bytes (a bigger tensor goes alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_hf_folder(
    path: str | Path,
    *,
    config: dict[str, Any],
    shards: list[list[str]],
    load_shard: Callable[[list[str]], dict[str, torch.Tensor]],
) -> None:
    """Write config.json and the weights, one shard in memory at a time.

    `shards` lists HF weight names per file; `load_shard(names)` returns those tensors.
    One shard: model.safetensors. Several: model-0000k-of-0000n.safetensors + index, as
    save_pretrained writes them.
    """
    from safetensors.torch import save_file

    folder = Path(path)
    if any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").exists():
        raise ConfigError(f"{folder}: already holds safetensors weights; write to an empty or new folder")
    folder.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for k, names in enumerate(shards, start=1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: t.detach().contiguous() for name, t in load_shard(names).items()}
        assert list(tensors) == names, "load_shard must return exactly the requested weights"
        save_file(tensors, str(folder / file), metadata={"format": "pt"})  # transformers checks "format"
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def to_hf(
    model: nn.Module,
    fam: ModelFamily,
    args: Any,
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write `model` as a Hugging Face folder that AutoModelForCausalLM.from_pretrained loads (weights +
    config.json; copy the tokenizer files next to them yourself).

    `model` is a plain module; for a sharded (FSDP/TP) model save a checkpoint and export it
    with `scripts/convert_hf.py to-hf`. dtype: None keeps the parameters' dtype.
    """
    state = model.state_dict()
    if any(isinstance(t, DTensor) for t in state.values()):
        raise ValueError("to_hf: the model is sharded (DTensor); save a checkpoint and use scripts/convert_hf.py to-hf")
    sources = hf_sources(fam, args)
    if set(state) != {ours for ours, _ in sources.values()}:
        different = sorted(set(state) ^ {ours for ours, _ in sources.values()})
        raise ValueError(f"to_hf: the model's weights do not match args ({different[:3]})")
    out_dtype = dtype or next(iter(state.values())).dtype
    shapes = hf_shapes(sources, {name: t.shape for name, t in state.items()})
    sizes = {hf: shape.numel() * (dtype or state[sources[hf][0]].dtype).itemsize for hf, shape in shapes.items()}
    write_hf_folder(
        path,
        config=hf_config(fam, args, dtype=out_dtype),
        shards=plan_shards(sizes, max_shard_bytes=max_shard_bytes),
        load_shard=lambda names: {name: hf_tensor(state[sources[name][0]], sources[name][1], dtype) for name in names},
    )
