"""Nothing damaged is loaded and loading runs no code from the folder: `.metadata` read with an unpickler that
admits only DCP's classes, every file there and long enough, its checksums matched (checkpoint/__init__.py)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.tensor import DTensor

from checkpoint.checksums import ALGORITHM, CONTENT, MANIFEST, first_damaged, read_manifest
from errors import ConfigError, warn

# -------------------------------------------------------------------- verifying


# Everything a DCP `.metadata` pickle may name (PyTorch 2.6-2.13): its dataclasses, torch.Size,
# dtypes, layouts and the checkpoint id's path.
_METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of DCP metadata")


def verify(path: Path, *, key: str = "checkpoint", fix: str | None = None) -> Metadata:
    """The metadata of the checkpoint at `path`, read and checked without running code from it.

    key: the config key that named `path`, for the error message; fix: the advice for a missing or
    truncated file (default: by key; "" for none).
    """
    try:
        with open(path / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise ConfigError(
            f"{key}: {path} is not a DCP checkpoint (no .metadata inside); point it at a step-<N> folder"
        ) from None
    except Exception as e:  # any malformed pickle
        raise ConfigError(
            f"{key}: {path}/.metadata was refused unread ({e}); only DCP checkpoints are loaded, and nothing "
            "in the folder was run"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ConfigError(f"{key}: {path}/.metadata is not DCP metadata ({type(metadata).__name__})")
    advice = _advice(path, key=key, fix=fix)
    sizes: dict[str, int] = {}
    for info in metadata.storage_data.values():
        file = path / info.relative_path
        if info.relative_path not in sizes:
            sizes[info.relative_path] = file.stat().st_size if file.is_file() else -1
        if sizes[info.relative_path] < 0:
            raise ConfigError(f"{key}: {file} is missing; the checkpoint is incomplete{advice}")
        if sizes[info.relative_path] < info.offset + info.length:
            raise ConfigError(
                f"{key}: {file} is truncated ({sizes[info.relative_path]:,} bytes, needs "
                f"{info.offset + info.length:,}); the checkpoint is incomplete{advice}"
            )
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            info = metadata.storage_data[MetadataIndex(fqn)]
            with open(path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
            try:
                torch.load(io.BytesIO(blob), weights_only=True)
            except Exception as e:
                raise ConfigError(
                    f"{key}: {path} item {fqn} was refused unread ({type(e).__name__}); it holds more than "
                    "tensors and plain values, and nothing in the folder was run"
                ) from None
    return metadata


def _advice(path: Path, *, key: str, fix: str | None) -> str:
    # The run's own checkpoint can go (an earlier one resumes); one the user points at is theirs to replace.
    if fix is None:
        fix = f"delete {path}" if key == "checkpoint.folder" else f"point {key} at a complete checkpoint"
    return f" ({fix})" if fix else ""


def verify_contents(
    path: Path,
    *,
    key: str = "checkpoint",
    fix: str | None = None,
    group: dist.ProcessGroup | None = None,
    alone: bool = False,
) -> None:
    """Every file of the checkpoint at `path` holds the bytes it was saved with (its checksums.json), or one line
    naming the first damaged file. Under torch.distributed a collective of `group`: each rank re-hashes its share
    of the files; `alone`: this process re-hashes them all (what one rank does by itself). A checkpoint saved
    before checksums were recorded passes (`verify` checks its sizes), said once."""
    advice = _advice(path, key=key, fix=fix)
    try:
        files = read_manifest(path)
    except ValueError as e:
        raise ConfigError(f"{key}: {path} is damaged ({e}){advice}") from None
    if files is None:
        warn(
            f"{key}: {path} has no {MANIFEST} (saved by torchtitan, or before this recipe recorded checksums): its files are checked "
            "by size only"
        )
        return
    if (damaged := first_damaged(path, files, group=group, alone=alone)) is not None:
        name, why = damaged
        what = "its bytes are not" if why == CONTENT else "its size is not"
        raise ConfigError(
            f"{key}: {path / name} is damaged ({what} what was saved, by the {ALGORITHM} checksums of {MANIFEST})"
            f"{advice}"
        )


def check_holds(path: Path, metadata: Metadata, expected: dict[str, torch.Tensor], *, key: str = "checkpoint") -> None:
    """Fail with one line, before DCP does with a traceback per rank, if `path` lacks the model's weights."""
    stored = metadata.state_dict_metadata
    missing = [k for k in expected if k not in stored]
    wrong = [k for k, v in expected.items() if k in stored and tuple(getattr(stored[k], "size", ())) != tuple(v.shape)]
    if missing or wrong:
        first = (missing or wrong)[0].removeprefix("model_and_optimizer.model.")
        raise ConfigError(
            f"{key}: {path} does not fit this model ({len(missing)} weights missing, {len(wrong)} of another "
            f"shape, e.g. {first}); check model.flavor (or model.hf_assets_path) and the checkpoint path"
        )


def nonfinite_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters holding NaN or inf, over all ranks (a collective: every rank calls it)."""
    named = [(name, p.to_local() if isinstance(p, DTensor) else p) for name, p in model.named_parameters()]
    finite = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist() if named else []  # one host sync
    local = [name for (name, _), ok in zip(named, finite, strict=True) if not ok]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, local)
    return sorted({name for names in everyone for name in names})


# ------------------------------------------------------------------ the command line
