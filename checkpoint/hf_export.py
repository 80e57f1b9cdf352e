"""A checkpoint's weights into a model, and out as a Hugging Face folder (config.json, safetensors, the
tokenizer's files)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from checkpoint.verify import check_holds, verify, verify_contents
from models import ModelFamily, parameter_shapes

# --------------------------------------------------------------- Hugging Face export

MODEL_PREFIX = "model_and_optimizer.model."  # where CheckpointManager keeps the weights in a checkpoint
HF_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def load_model_weights(path: Path, model: nn.Module, *, key: str = "checkpoint") -> None:
    """Fill `model` (plain, or sharded by TP under torchrun) with the weights of a DCP checkpoint saved by
    train.py at any step on any number of ranks; nothing else is read. One process needs no group."""
    metadata = verify(path, key=key)
    verify_contents(path, key=key)  # under torchrun, each rank hashes its share
    state = {MODEL_PREFIX + name: t for name, t in model.state_dict().items()}
    check_holds(path, metadata, state, key=key)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def export_hf_folder(
    checkpoint: Path,
    out: Path,
    *,
    family: ModelFamily,
    args: Any,
    dtype: torch.dtype | None,
    max_shard_bytes: int | None = None,
    side_files_from: str | Path | None = None,
) -> list[str]:
    """Write the model weights of a DCP checkpoint (any step, saved on any number of ranks) as a
    Hugging Face folder, one output shard in memory at a time; one process, no group.

    dtype None keeps the stored dtype. side_files_from: a Hugging Face folder whose config.json gives
    the token ids and whose tokenizer files and generation_config.json are copied (those names are returned).
    """
    # Imported here: Hugging Face interop, which a run without HF folders never needs.
    from models.hf import (
        DEFAULT_MAX_SHARD_BYTES,
        hf_config,
        hf_shapes,
        hf_sources,
        hf_tensor,
        plan_shards,
        write_hf_folder,
    )

    metadata = verify(checkpoint)  # read without running anything from the folder
    verify_contents(checkpoint, alone=True)  # rank 0 alone when a run exports its last step
    shapes = parameter_shapes(family, args)
    check_holds(checkpoint, metadata, {MODEL_PREFIX + n: torch.empty(s, device="meta") for n, s in shapes.items()})
    stored = metadata.state_dict_metadata
    sources = hf_sources(family, args)  # HF name -> (our name, its index along dim 0 when stacked from several)
    stored_dtype = {n: stored[MODEL_PREFIX + n].properties.dtype for n in shapes}
    out_dtype = {hf: dtype or stored_dtype[ours] for hf, (ours, _) in sources.items()}
    sizes = {hf: shape.numel() * out_dtype[hf].itemsize for hf, shape in hf_shapes(sources, shapes).items()}

    def load_shard(names: list[str]) -> dict[str, torch.Tensor]:
        # DCP reads only the keys asked for, so memory holds this shard's parameters and nothing more (a stacked
        # parameter whole, for its slices in the shard).
        needed = dict.fromkeys(sources[h][0] for h in names)
        state = {MODEL_PREFIX + n: torch.empty(shapes[n], dtype=stored_dtype[n]) for n in needed}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
        return {h: hf_tensor(state[MODEL_PREFIX + sources[h][0]], sources[h][1], out_dtype[h]) for h in names}

    source = Path(side_files_from) if side_files_from is not None else None
    token_ids: dict[str, int] = {}
    if source is not None and (source / "config.json").is_file():
        config = json.loads((source / "config.json").read_text())
        token_ids = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
    write_hf_folder(
        out,
        config=hf_config(family, args, dtype=dtype or next(iter(out_dtype.values())), **token_ids),
        shards=plan_shards(sizes, max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES),
        load_shard=load_shard,
    )
    copied = []
    for name in HF_SIDE_FILES if source is not None and source.is_dir() else ():
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
            copied.append(name)
    return copied
