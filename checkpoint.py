"""The run's folder on disk: one run at a time, and distributed checkpoints (DCP) that nothing loses.

Layout: <dump_folder>/.lock names the run that owns the folder; <dump_folder>/<checkpoint.folder>/
step-<N>/ holds one DCP checkpoint: the model and optimizer (sharded as they are trained,
resharded on load, so a run saved on 4 ranks resumes on 2), the data loader position, the step,
the RNG state and the schedule settings.

Nothing half-written is ever resumed, and nothing complete is lost. A checkpoint is written to
`step-<N>.partial/`; DCP writes `.metadata` last (to a temporary name, then renamed) once every
rank has finished, so a `.partial` folder with `.metadata` is complete. Rank 0 renames it to
`step-<N>/` as soon as it sees that: right after a blocking save, at the first step after an
async save finished (`poll`, a `Future.done()` per step), or at the next start-up after a crash
(`prepare_dump_folder`), which also removes `.partial` debris. Resume looks at `step-<N>/`
folders only; when the newest fails `verify` (a filesystem damaged a file after it was complete),
start-up renames it `step-<N>.damaged`, warns, and resumes from the newest one that passes. A save that runs out of disk space removes its `.partial` and stops the run in one
line. Non-finite weights are never saved, and a checkpoint with non-finite weights is refused
when loaded. Pruning (`keep_latest_k`) never removes the seed checkpoint (step 0).

Nothing damaged is loaded. Every save records the size and xxh3_128 of each file it writes, hashed as DCP
writes it (checksums.py), in `checksums.json`, which lands before `.metadata`: so it is published with the
folder. Before a load, the ranks re-hash the files, each its share, and agree on the first damaged one
(`verify_contents`); a damaged newest checkpoint is set aside as above and the one before resumes, one the user
names is refused in one line, and a folder whose checkpoints are all damaged stops the run rather than start
it again from step 0. A checkpoint saved before checksums were recorded is checked by size, said once.
`python -m checkpoint verify PATH` checks a step folder, or every step of a checkpoint folder, without loading it.

A checkpoint torchtitan 0.2.2 wrote (its weights at the top level of the state dict) is recognised by its keys
and read by checkpoint_torchtitan.py: a resume takes its weights, AdamW state and step, and each stateful part
with a `load_torchtitan(state)` method what it can; initial_load_path its weights.

Loading runs no code from the checkpoint folder. DCP's `.metadata` is a pickle and DCP loads
non-tensor items with `torch.load(weights_only=False)`; `verify` first reads `.metadata` with an
unpickler that admits only DCP's metadata classes, loads every non-tensor item with
`torch.load(weights_only=True)`, and checks that every data file is there and long enough. Only
then does DCP read the folder.
"""

from __future__ import annotations

import atexit
import errno
import io
import json
import os
import pickle
import re
import shutil
import socket
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from checkpoint_torchtitan import TorchtitanState, is_torchtitan, load_torchtitan
from checksums import ALGORITHM, CONTENT, MANIFEST, ChecksumWriter, first_damaged, read_manifest
from config import Checkpoint
from errors import ConfigError, DiskFull, warn, writable_folder
from models import ModelFamily, parameter_shapes

_STEP_DIR = re.compile(r"^step-(\d+)$")
_PARTIAL_DIR = re.compile(r"^step-(\d+)\.partial$")
_DAMAGED_DIR = re.compile(r"^step-(\d+)\.damaged(-\d+)?$")
GiB = 2**30


def is_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file()


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every published checkpoint in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        if (match := _STEP_DIR.match(child.name)) and is_checkpoint(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def refuse_folder_of_steps(path: Path, *, key: str) -> None:
    """`key` names a folder that holds step folders rather than being one: a checkpoint folder (step-<N> inside) or a
    run folder (train.py's dump folder, whose checkpoint folder holds them). One line naming its newest step."""
    if not path.is_dir() or is_checkpoint(path):
        return
    try:
        if found := complete_checkpoints(path):
            kind, newest = "a checkpoint folder", found[-1][1]
        else:
            inner = [steps[-1][1] for child in sorted(path.iterdir()) if (steps := complete_checkpoints(child))]
            if not inner:
                return
            kind, newest = "a run folder", inner[0]
    except OSError:  # an unreadable folder: the caller's own checks say what is wrong
        return
    raise ConfigError(f"{key}: {path} is {kind}; point it at one of its step folders, e.g. {newest}")


# ------------------------------------------------------------------ the dump folder


class DumpFolderLock:
    """`<dump_folder>/.lock` holds "host pid" of the run that owns the folder; released at exit."""

    def __init__(self, folder: Path):
        self.path = folder / ".lock"
        self.owner = f"{socket.gethostname()} {os.getpid()}"

    def acquire(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                host, _, pid = self.path.read_text().strip().partition(" ")
                if host != socket.gethostname() or not pid.isdigit() or _alive(int(pid)):
                    raise ConfigError(
                        f"job.dump_folder: {self.path.parent} is in use by the run with pid {pid} on host {host} "
                        f"(see {self.path}); wait for it, choose another job.dump_folder, or delete {self.path} if "
                        "that run is gone"
                    ) from None
                self.path.unlink(missing_ok=True)  # a crashed run of this host: take over
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self.owner + "\n")
            atexit.register(self.release)
            return

    def release(self) -> None:
        if self.path.is_file() and self.path.read_text().strip() == self.owner:
            self.path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def prepare_dump_folder(dump_folder: str, cfg: Checkpoint, *, checkpoint_bytes: int) -> DumpFolderLock:
    """Rank 0, before any compute: the dump folder exists, is ours (lock), and can take a checkpoint.

    Publishes checkpoints a crash left complete but unpublished, and removes `.partial` debris.
    checkpoint_bytes: what one checkpoint of this model and optimizer takes on disk (an estimate).
    """
    folder = Path(dump_folder)
    writable_folder(folder, key="job.dump_folder")
    lock = DumpFolderLock(folder)
    lock.acquire()
    if cfg.enable or cfg.create_seed_checkpoint:
        ckpt = folder / cfg.folder
        writable_folder(ckpt, key="checkpoint.folder")
        free = shutil.disk_usage(ckpt).free
        if free < checkpoint_bytes:
            raise ConfigError(
                f"checkpoint.folder: {ckpt} has {free / GiB:.2f} GiB free, but a checkpoint of this model and "
                f"optimizer takes about {checkpoint_bytes / GiB:.2f} GiB; free space or point job.dump_folder "
                "elsewhere"
            )
        recover_partial_checkpoints(ckpt)
        if cfg.enable and cfg.load_step == -1:
            set_aside_damaged(ckpt)
    return lock


def recover_partial_checkpoints(folder: Path) -> None:
    """Publish each complete `step-<N>.partial` (it has .metadata) and remove the others."""
    for child in sorted(folder.iterdir()):
        if not (match := _PARTIAL_DIR.match(child.name)):
            continue
        final = folder / f"step-{match.group(1)}"
        if is_checkpoint(child) and not final.exists():
            os.replace(child, final)
            _log(f"published {final}: a run stopped after writing it, before it was published")
        else:
            shutil.rmtree(child, ignore_errors=True)
            _log(f"removed {child}: an unfinished save")


def set_aside_damaged(folder: Path) -> None:
    """Rename the newest checkpoints that fail `verify` (a filesystem, not a crash, damaged them) to
    `step-<N>.damaged`, newest first until one passes, warning about each: the resume then continues
    from the newest complete one, and no later save or pruning touches them. Nothing is deleted."""
    for step, path in reversed(complete_checkpoints(folder)):
        try:
            verify(path, key="checkpoint.folder", fix="")
            return
        except ConfigError as e:
            _set_aside(path, step, problem=e.problems[0].removeprefix("checkpoint.folder: "))


def _set_aside(path: Path, step: int, *, problem: str) -> None:
    aside, again = path.with_name(f"step-{step}.damaged"), 1
    while aside.exists():
        aside, again = path.with_name(f"step-{step}.damaged-{again}"), again + 1
    os.replace(path, aside)
    warn(
        f"checkpoint.folder: skipped step {step}, it is damaged ({problem}); kept as {aside} (delete it once "
        "looked at), resuming from the newest complete checkpoint before it"
    )


def refuse_all_damaged(folder: Path) -> None:
    """A folder whose checkpoints were all set aside as damaged had progress: starting again from step 0 (or from
    initial_load_path) would lose it without a word, so the run stops and says what to do."""
    damaged = sorted(p.name for p in folder.iterdir() if _DAMAGED_DIR.match(p.name)) if folder.is_dir() else []
    if damaged and not complete_checkpoints(folder):
        raise ConfigError(
            f"checkpoint.folder: every checkpoint in {folder} is damaged ({', '.join(damaged)}); not starting again "
            f"from step 0. Copy a whole checkpoint there to resume from it, or move {folder} aside to start afresh"
        )


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


# ---------------------------------------------------------------------- manager


class ModelAndOptimizer(Stateful):
    """Model and optimizer state in the form DCP reshards: FQN-keyed, DTensors kept sharded.

    optimizer None: the model alone (seed checkpoints, model-only last saves, loading without it).
    model_dtype: the dtype the model weights are saved in (a model-only last save's export_dtype).
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, model_dtype: torch.dtype | None = None
    ):
        self.model, self.optimizer, self.model_dtype = model, optimizer, model_dtype

    def state_dict(self) -> dict[str, Any]:
        model = get_model_state_dict(self.model)
        if self.model_dtype is not None:
            model = {name: tensor.to(self.model_dtype) for name, tensor in model.items()}
        state = {"model": model}
        if self.optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        return torch.utils._pytree.tree_map_only(torch.Tensor, _plain, state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state["model"])
        if self.optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A tensor subclass that wraps one plain tensor (torchao's float8 FSDP weights:
    WeightWithDynamicFloat8CastTensor) as that tensor, same storage: checkpoints hold plain tensors
    that any run reads, float8 or not, with or without torchao."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if type(local) in (torch.Tensor, nn.Parameter) or not hasattr(local, "__tensor_flatten__"):
        return t
    inner_names, _ = local.__tensor_flatten__()
    inner = getattr(local, inner_names[0])
    if not isinstance(t, DTensor):
        return inner
    return DTensor.from_local(inner, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def is_model_only(metadata: Metadata) -> bool:
    """Whether a checkpoint holds model weights and nothing else (a seed, or a model-only last save)."""
    return not any(
        fqn.startswith(("model_and_optimizer.optimizer", "train_state")) for fqn in metadata.state_dict_metadata
    )


class CheckpointManager:
    def __init__(
        self,
        cfg: Checkpoint,
        *,
        dump_folder: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        stateful: dict[str, Stateful],
        process_group: dist.ProcessGroup | None = None,
        family: ModelFamily | None = None,
        model_args: Any = None,
        hf_assets_path: str | None = None,
        tokenizer_path: str | None = None,
        optional: tuple[str, ...] = (),
    ):
        """`stateful`: everything else to save and restore (loader, train state); the keys in `optional` may
        be missing from checkpoints of earlier versions (they then keep their fresh state).
        family, model_args: the model's family and its shape as published (Hugging Face names and
        config.json; default model.args); only Hugging Face loading and export need them.
        hf_assets_path: the Hugging Face folder initial_load_in_hf reads when initial_load_path is unset.
        last_save_in_hf copies the tokenizer files of hf_assets_path, else of a tokenizer_path folder."""
        self.cfg = cfg
        self.folder = Path(dump_folder) / cfg.folder
        self.model, self.optimizer = model, optimizer
        self.family, self.model_args = family, model_args or model.args
        self.stateful, self.optional = stateful, optional
        self.hf_assets_path = hf_assets_path
        self.side_files = hf_assets_path or (
            tokenizer_path if tokenizer_path and Path(tokenizer_path).is_dir() else None
        )
        # DCP's collectives go over a gloo group so an async save in a background thread
        # never competes with NCCL training collectives; on CPU this is the default group.
        self.process_group = process_group
        self._pending: tuple[Future, int] | None = None
        self._started = 0.0  # when the last save began
        self.last_saved = -1  # the step of the last save begun (async ones may still be running)
        self._staging: Future | None = None
        self._stager = None
        # async_with_pinned_mem's StagingOptions (pinned, shared, async, non-blocking), torchtitan 0.2.2's.
        self.staging_options = (True, True, True, True)
        self._resume_checked: tuple[tuple[int, Path] | None] | None = None  # _resume_from's answer, once found
        self.torchtitan: TorchtitanState | None = None  # what torchtitan's checkpoint said, when one was loaded
        if cfg.async_mode == "async_with_pinned_mem" and not torch.cuda.is_available():
            raise ConfigError(
                "checkpoint.async_mode: async_with_pinned_mem stages checkpoints through pinned (page-locked) memory, "
                'which needs CUDA; use "async" on this machine'
            )

    # ---------------------------------------------------------------- loading

    def _resume_from(self) -> tuple[int, Path] | None:
        """The checkpoint a run of this folder continues from: checkpoint.load_step's, else the newest whole one
        (a collective: the ranks check its files together, once; damaged newer ones are set aside)."""
        if self._resume_checked is None:
            self._resume_checked = (self._find_resume(),)
        return self._resume_checked[0]

    def _find_resume(self) -> tuple[int, Path] | None:
        found = complete_checkpoints(self.folder) if self.cfg.enable else []
        if self.cfg.load_step == -1:
            while found:
                try:
                    verify_contents(found[-1][1], key="checkpoint.folder", fix="", group=self.process_group)
                    return found[-1]
                except ConfigError as e:
                    step, path = found.pop()
                    if _rank() == 0:  # after the collective: the other ranks are done with its files
                        _set_aside(path, step, problem=e.problems[0].removeprefix("checkpoint.folder: "))
            if self.cfg.enable:
                refuse_all_damaged(self.folder)
            return None
        if not self.cfg.enable:
            raise ConfigError(
                f"checkpoint.load_step: {self.cfg.load_step} resumes from a checkpoint, but checkpoint.enable is "
                "false; set it to true (or load_step = -1)"
            )
        if match := [(step, path) for step, path in found if step == self.cfg.load_step]:
            verify_contents(match[0][1], key="checkpoint.load_step", group=self.process_group)
            return match[0]
        steps = f"it has steps {', '.join(str(step) for step, _ in found)}" if found else "it has no checkpoint"
        raise ConfigError(
            f"checkpoint.load_step: {self.folder} has no step-{self.cfg.load_step} ({steps}); pick one of those, "
            "or -1 for the newest (a fresh run when there is none)"
        )

    def resume_step(self) -> int:
        """The step `load` resumes from: load_step's or the newest published checkpoint's, else 0."""
        found = self._resume_from()
        return found[0] if found and "train_state" not in self.cfg.exclude_from_loading else 0

    def load(self) -> int:
        """Resume from this run's checkpoint, else initialize the weights from initial_load_path (DCP,
        or Hugging Face safetensors with initial_load_in_hf). Returns the step to continue from (0: a fresh run)."""
        if found := self._resume_from():
            step, path = found
            metadata = verify(path, key="checkpoint.folder")
            excluded = set(self.cfg.exclude_from_loading)
            weights_only = {"optimizer", "train_state", "dataloader"} <= excluded  # asked for the model alone
            if is_model_only(metadata) and step > 0 and not weights_only:
                raise ConfigError(
                    f"checkpoint.folder: {path} holds the model weights only (checkpoint.last_save_model_only), not the "
                    "optimizer and data position a resume needs; start a new run from it (another job.dump_folder, "
                    f"checkpoint.initial_load_path = {path}), or set checkpoint.load_step to an earlier step"
                )
            model_only = is_model_only(metadata) or weights_only
            if is_torchtitan(metadata):
                return self._resume_torchtitan(path, metadata, excluded=excluded, model_only=model_only)
            parts = {} if model_only else {k: v for k, v in self.stateful.items() if k not in excluded}
            optimizer = None if model_only or "optimizer" in excluded else self.optimizer
            self._load(
                path,
                metadata,
                ModelAndOptimizer(self.model, optimizer),
                parts,
                key="checkpoint.folder",
                load_model="model" not in excluded,
            )
            _log(f"resumed from {path}" + (f" (not restored: {', '.join(sorted(excluded))})" if excluded else ""))
            return step if "train_state" not in excluded and not model_only else 0
        if self.cfg.initial_load_in_hf:
            folder = Path(self.cfg.initial_load_path or self.hf_assets_path or "")
            self._load_hf(folder)
            _log(f"initialized model weights from the Hugging Face folder {folder}")
        elif self.cfg.initial_load_path is not None:
            path = Path(self.cfg.initial_load_path)
            metadata = verify(path, key="checkpoint.initial_load_path")
            verify_contents(path, key="checkpoint.initial_load_path", group=self.process_group)
            if is_torchtitan(metadata):
                self._load_torchtitan(path, metadata, None, key="checkpoint.initial_load_path")
            else:
                self._load(path, metadata, ModelAndOptimizer(self.model, None), {}, key="checkpoint.initial_load_path")
            _log(f"initialized model weights from {path}" + (" (torchtitan's checkpoint)" if self.torchtitan else ""))
        return 0

    def _load(
        self,
        path: Path,
        metadata: Metadata,
        weights: ModelAndOptimizer,
        parts: dict[str, Stateful],
        *,
        key: str,
        load_model: bool = True,
    ) -> None:
        for name in [name for name in parts if name in self.optional and not _holds_part(metadata, name)]:
            del parts[name]  # saved by a recipe that did not have it yet: it starts afresh
            _log(f"{path} holds no {name} (saved before it was checkpointed): it starts afresh")
        model_state = get_model_state_dict(self.model)
        check_holds(path, metadata, {f"model_and_optimizer.model.{k}": v for k, v in model_state.items()}, key=key)
        state: dict[str, Any] = {**parts}
        if load_model or weights.optimizer is not None:
            state["model_and_optimizer"] = weights if load_model else _OptimizerOnly(weights)
        try:
            dcp.load(state, checkpoint_id=str(path), process_group=self.process_group)
        except ConfigError:  # a Stateful refusing what it was given (e.g. the loader: other data)
            raise
        except Exception as e:  # DCP gathers every rank's read errors into one exception on all ranks
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"{key}: {path} could not be read ({first[:300]}); delete it or point elsewhere"
            ) from None
        self._refuse_nonfinite(path, key=key)

    def _resume_torchtitan(self, path: Path, metadata: Metadata, *, excluded: set[str], model_only: bool) -> int:
        """Resume from torchtitan's checkpoint (checkpoint_torchtitan.py): weights, AdamW state and step; each
        stateful part with a `load_torchtitan(state)` takes what it can (the step, the data position), the others
        start afresh."""
        optimizer = None if model_only or "optimizer" in excluded else self.optimizer
        state = self._load_torchtitan(path, metadata, optimizer, key="checkpoint.folder")
        parts = {} if model_only else {n: p for n, p in self.stateful.items() if n not in excluded}
        taken = [name for name, part in parts.items() if hasattr(part, "load_torchtitan")]
        for name in taken:
            self.stateful[name].load_torchtitan(state)
        fresh = sorted(set(self.stateful) - set(taken))
        _log(f"resumed from torchtitan's checkpoint {path}" + (f" (afresh: {', '.join(fresh)})" if fresh else ""))
        return state.step if "train_state" not in excluded and not model_only else 0

    def _load_torchtitan(
        self, path: Path, metadata: Metadata, optimizer: torch.optim.Optimizer | None, *, key: str
    ) -> TorchtitanState:
        assert self.family is not None, "CheckpointManager(family=...) reads torchtitan's checkpoints"
        check_holds(path, metadata, get_model_state_dict(self.model), key=key)  # torchtitan's weights: top level
        self.torchtitan = load_torchtitan(
            path, metadata, self.model, optimizer, family=self.family, args=self.model_args, key=key,
            group=self.process_group,
        )  # fmt: skip
        self._refuse_nonfinite(path, key=key)
        return self.torchtitan

    def _load_hf(self, folder: Path) -> None:
        """Every rank reads its own shard of each weight from the safetensors files (DCP's Hugging Face
        reader), converting to the parameters' dtype as it copies."""
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        from models.hf import check_hf_weights, hf_to_ours

        key = "checkpoint.initial_load_path" if self.cfg.initial_load_path else "model.hf_assets_path"
        fam, args = self.family, self.model_args
        assert fam is not None, "CheckpointManager(family=...) reads Hugging Face folders"
        try:
            check_hf_weights(folder, fam, args)
        except ConfigError as e:
            raise ConfigError(*(f"{key}: {problem}" for problem in e.problems)) from None
        state = get_model_state_dict(self.model)
        hf_state = {hf: state[ours] for hf, ours in hf_to_ours(fam, args).items()}
        dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(str(folder)), process_group=self.process_group)
        set_model_state_dict(self.model, state)
        self._refuse_nonfinite(folder, key=key)

    def _refuse_nonfinite(self, path: Path, *, key: str) -> None:
        if bad := nonfinite_parameters(self.model):
            raise ConfigError(
                f"{key}: {path} holds non-finite weights ({len(bad)} tensors, e.g. {bad[0]}); resume from an "
                "earlier checkpoint (delete this one) or start from initial_load_path"
            )

    # ----------------------------------------------------------------- saving

    def should_save(self, step: int, *, last: bool) -> bool:
        first = step == 1 and self.cfg.enable_first_step_checkpoint
        return self.cfg.enable and (step % self.cfg.interval == 0 or last or first)

    def save(self, step: int, *, last: bool = False, model_only: bool = False, wait: bool = False) -> None:
        """Write step-<step>; async when configured (published by `poll` once done, or by the next save).

        last: the run's final save: the model alone in export_dtype with last_save_model_only, then
        exported to Hugging Face with last_save_in_hf (both block). model_only: seed checkpoints.
        """
        self._finish_pending()
        if bad := nonfinite_parameters(self.model):
            raise ConfigError(
                f"training: the weights hold non-finite values at step {step} ({len(bad)} tensors, e.g. {bad[0]}); "
                f"not saving them. The last saved checkpoint is {self.latest()}; lower optimizer.lr and resume from it"
            )
        self._started = time.perf_counter()
        self.last_saved = step
        partial = self.folder / f"step-{step}.partial"
        if _rank() == 0:  # before DCP's first collective, so before any rank writes into it
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True, exist_ok=True)
        model_only = model_only or (last and self.cfg.last_save_model_only)
        dtype = getattr(torch, self.cfg.export_dtype) if last and self.cfg.last_save_model_only else None
        state: dict[str, Any] = {
            "model_and_optimizer": ModelAndOptimizer(
                self.model, None if model_only else self.optimizer, model_dtype=dtype
            )
        }
        if not model_only:
            state.update(self.stateful)
        with self._out_of_space(step):
            if self.cfg.async_mode != "disabled" and not (wait or last):
                self._pending = (self._async_save(state, partial), step)
            else:
                dcp.save(state, storage_writer=ChecksumWriter(partial), process_group=self.process_group)
                self._publish(step)
        if last and self.cfg.last_save_in_hf and _rank() == 0:
            self.export_hf(step)

    def export_hf(self, step: int) -> Path:
        """step-<step> as a Hugging Face folder, <folder>/step-<step>-hf (export_dtype), tokenizer files included.

        Rank 0 alone, one output shard in memory at a time; the other ranks do not wait for it.
        """
        target = self.folder / f"step-{step}-hf"
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        begin = time.perf_counter()
        with _OutOfSpace(partial):
            assert self.family is not None, "CheckpointManager(family=...) exports Hugging Face folders"
            export_hf_folder(
                self.folder / f"step-{step}",
                partial,
                family=self.family,
                args=self.model_args,
                dtype=getattr(torch, self.cfg.export_dtype),
                side_files_from=self.side_files,
            )
        if target.exists():
            shutil.rmtree(target)
        os.replace(partial, target)
        _log(f"exported step {step} to the Hugging Face folder {target} ({time.perf_counter() - begin:.1f} s)")
        return target

    def _async_save(self, state: dict[str, Any], partial: Path) -> Future:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self.cfg.async_mode == "async":
            # The stager DCP uses when given no writer; given ChecksumWriter (a FileSystemWriter, thus a
            # BlockingAsyncStager) it would stage with that instead. Hashing happens in the upload thread.
            stager = DefaultStager(StagingOptions(False, False, False, False))
            future = dcp.async_save(
                state, storage_writer=ChecksumWriter(partial), process_group=self.process_group, async_stager=stager
            )
            future.add_done_callback(lambda _: stager.close())
            return future
        # async_with_pinned_mem, as torchtitan 0.2.2 does it: stage into pinned shared memory with a
        # background copy, upload from another process (CUDA only; make bench-gpu's cuda_paths checks it).
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self._stager is None:
            self._stager = DefaultStager(StagingOptions(*self.staging_options))
        response = dcp.async_save(
            state,
            storage_writer=ChecksumWriter(partial),
            process_group=self.process_group,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=self._stager,
        )
        self._staging = response.staging_completion
        return response.upload_completion

    def wait_for_staging(self) -> None:
        """Before the optimizer changes the weights: the pinned copy of the last save must be complete."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None
            if self._stager is not None and not stager_reusable(self._stager):
                self._stager = None  # the next save pins new buffers rather than fail

    def poll(self) -> None:
        """Publish a finished async save; one `Future.done()` per call, so it is cheap to call every step."""
        if self._pending is not None and self._pending[0].done():
            self._finish_pending()

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        future, step = self._pending
        self._pending = None
        self.wait_for_staging()
        with self._out_of_space(step):
            future.result()
        # The future completes after .metadata is written, so rank 0 publishes without waiting for the others.
        self._publish(step, barrier=False)

    def _publish(self, step: int, *, barrier: bool = True) -> None:
        # DCP writes .metadata after gathering every rank's write results, so once rank 0 is
        # here the checkpoint is complete; only then does it get its resumable name.
        if _rank() == 0:
            final = self.folder / f"step-{step}"
            if final.exists():
                shutil.rmtree(final)
            os.replace(self.folder / f"step-{step}.partial", final)
            self._prune()
            size = sum(f.stat().st_size for f in final.iterdir())
            _log(f"saved checkpoint {final} ({size / 2**20:,.1f} MiB, {time.perf_counter() - self._started:.2f} s)")
        if barrier and dist.is_initialized():
            dist.barrier(group=self.process_group)

    def _prune(self) -> None:
        if self.cfg.keep_latest_k > 0:
            trained = [(step, path) for step, path in complete_checkpoints(self.folder) if step > 0]  # keep seeds
            for _, path in trained[: -self.cfg.keep_latest_k]:
                shutil.rmtree(path, ignore_errors=True)

    def _out_of_space(self, step: int) -> Any:
        return _OutOfSpace(self.folder / f"step-{step}.partial")

    def latest(self) -> str:
        found = complete_checkpoints(self.folder)
        return str(found[-1][1]) if found else "none (checkpoint.enable is off or nothing was saved yet)"

    def close(self) -> None:
        self._finish_pending()


def _holds_part(metadata: Metadata, name: str) -> bool:
    return any(key == name or key.startswith(f"{name}.") for key in metadata.state_dict_metadata)


def stager_reusable(stager: Any) -> bool:
    """Whether a DefaultStager can stage another save. PyTorch 2.11's closes itself at the end of each stage (its
    copier table emptied), so the next save with it fails with `KeyError: <class 'type'>` (pytorch/pytorch#183413,
    torchtitan#3476; fixed in later releases, where a stager is reused and keeps its pinned buffers)."""
    inner = getattr(stager, "_state_dict_stager", None)  # private: DefaultStager's StateDictStager
    return inner is None or bool(getattr(inner, "_deepcopy_dispatch", True))


class SaveStep:
    """After each step: publish a finished async save; save every checkpoint.interval steps and after the last, the
    time the save holds the loop left out of the training throughput and ETA (`throughput.pause`, metrics.py)."""

    def __init__(self, checkpoint: CheckpointManager, *, total_steps: int, throughput: Any = None):
        self.checkpoint, self.total_steps, self.throughput = checkpoint, total_steps, throughput

    def __call__(self, step: int, result: Any) -> bool:
        self.checkpoint.poll()
        last = step == self.total_steps
        if self.checkpoint.should_save(step, last=last):
            begin = time.perf_counter()
            self.checkpoint.save(step, last=last)
            if self.throughput is not None:
                self.throughput.pause(time.perf_counter() - begin)
        return False


class _OptimizerOnly(Stateful):
    """exclude_from_loading = ["model"]: the optimizer state is restored, the weights are not."""

    def __init__(self, weights: ModelAndOptimizer):
        self.weights = weights

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.weights.state_dict()["optimizer"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.weights.model, self.weights.optimizer, state["optimizer"])


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
    from models.hf import DEFAULT_MAX_SHARD_BYTES, hf_config, hf_to_ours, plan_shards, write_hf_folder

    metadata = verify(checkpoint)  # read without running anything from the folder
    verify_contents(checkpoint, alone=True)  # rank 0 alone when a run exports its last step
    shapes = parameter_shapes(family, args)
    check_holds(checkpoint, metadata, {MODEL_PREFIX + n: torch.empty(s, device="meta") for n, s in shapes.items()})
    stored = metadata.state_dict_metadata
    ours_to_hf = {ours: hf for hf, ours in hf_to_ours(family, args).items()}
    stored_dtype = {n: stored[MODEL_PREFIX + n].properties.dtype for n in shapes}
    out_dtype = {ours_to_hf[n]: dtype or stored_dtype[n] for n in shapes}
    sizes = {ours_to_hf[n]: shapes[n].numel() * out_dtype[ours_to_hf[n]].itemsize for n in shapes}
    hf_to_name = {hf: ours for ours, hf in ours_to_hf.items()}

    def load_shard(names: list[str]) -> dict[str, torch.Tensor]:
        # DCP reads only the keys asked for, so memory holds this shard and nothing more.
        state = {
            MODEL_PREFIX + hf_to_name[h]: torch.empty(shapes[hf_to_name[h]], dtype=stored_dtype[hf_to_name[h]])
            for h in names
        }
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
        return {h: state[MODEL_PREFIX + hf_to_name[h]].to(out_dtype[h]) for h in names}

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


class _OutOfSpace:
    """Turn a full disk during a save into one line, after removing what the save left behind."""

    def __init__(self, partial: Path):
        self.partial = partial

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, error: BaseException | None, tb: Any) -> bool:
        # torch.save's zip writer reports a full disk as "unexpected pos ...", not ENOSPC (2.13):
        # so a failed save next to an (almost) full disk counts as one too.
        if error is None or not (_is_out_of_space(error) or _free_bytes(self.partial) < 16 * 2**20):
            return False
        if _rank() == 0:
            if self.partial.is_dir():
                shutil.rmtree(self.partial, ignore_errors=True)
            else:
                self.partial.unlink(missing_ok=True)
        raise DiskFull(
            f"checkpoint.folder: no space left on the device while writing {self.partial} (removed); free space or "
            "point job.dump_folder elsewhere, then rerun to resume from the last checkpoint"
        ) from None


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _is_out_of_space(error: BaseException | None) -> bool:
    """ENOSPC/EDQUOT anywhere in the exception, its causes, or the per-rank failures DCP collects."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return False


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _log(message: str) -> None:
    if _rank() == 0:
        print(f"[checkpoint] {message}", flush=True)


# ------------------------------------------------------------------ the command line


def check_folder(path: Path) -> list[tuple[Path, str | None]]:
    """(step folder, None or what is damaged) for a step folder, or for every step of a checkpoint folder (set-aside
    ones included), without loading anything: what `verify` and `verify_contents` check, in one process."""
    steps = [path]
    if path.is_dir() and not is_checkpoint(path):
        named = [(m, p) for p in path.iterdir() if (m := _STEP_DIR.match(p.name) or _DAMAGED_DIR.match(p.name))]
        steps = [p for _, p in sorted(named, key=lambda mp: (int(mp[0].group(1)), mp[1].name))]
    checked = []
    for step in steps:
        try:
            verify(step, key="verify", fix="")
            if (step / MANIFEST).is_file():  # else sizes only, which `main` says
                verify_contents(step, key="verify", fix="")
            checked.append((step, None))
        except ConfigError as e:
            checked.append((step, e.problems[0].removeprefix("verify: ")))
    return checked


def main(argv: list[str]) -> int:
    """`python -m checkpoint verify PATH...`: OK or damaged per step (a PATH that does not exist: not found), exit
    status 0 when all are OK, else 2."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m checkpoint", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "verify", help="check step folders (or every step of a checkpoint folder) against their checksums"
    )
    check.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    opts = parser.parse_args(argv)
    checked, missing = [], []
    for path in opts.paths:
        if not path.exists():
            missing.append(path)
            print(f"{path}: not found", flush=True)
            continue
        for step, problem in check_folder(path):
            checked.append(problem)
            if problem is None:
                whole = (step / MANIFEST).is_file()
                print(f"{step}: OK" + ("" if whole else f" (sizes only: no {MANIFEST})"), flush=True)
            else:
                print(f"{step}: damaged: {problem}", flush=True)
    if not checked and len(missing) < len(opts.paths):
        print(f"{', '.join(str(p) for p in opts.paths if p not in missing)}: no checkpoint found", flush=True)
    return 0 if checked and not missing and all(problem is None for problem in checked) else 2


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
