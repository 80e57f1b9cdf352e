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
folders only. A save that runs out of disk space removes its `.partial` and stops the run in one
line. Non-finite weights are never saved, and a checkpoint with non-finite weights is refused
when loaded. Pruning (`keep_latest_k`) never removes the seed checkpoint (step 0).

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
import os
import pickle
import re
import shutil
import socket
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from config import Checkpoint
from errors import ConfigError

_STEP_DIR = re.compile(r"^step-(\d+)$")
_PARTIAL_DIR = re.compile(r"^step-(\d+)\.partial$")
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
    _make_folder(folder, key="job.dump_folder")
    lock = DumpFolderLock(folder)
    lock.acquire()
    if cfg.enable or cfg.create_seed_checkpoint:
        ckpt = folder / cfg.folder
        _make_folder(ckpt, key="checkpoint.folder")
        free = shutil.disk_usage(ckpt).free
        if free < checkpoint_bytes:
            raise ConfigError(
                f"checkpoint.folder: {ckpt} has {free / GiB:.2f} GiB free, but a checkpoint of this model and "
                f"optimizer takes about {checkpoint_bytes / GiB:.2f} GiB; free space or point job.dump_folder "
                "elsewhere"
            )
        recover_partial_checkpoints(ckpt)
    return lock


def _make_folder(folder: Path, *, key: str) -> None:
    """Create `folder` and prove a file can be written in it, or raise one line that says why not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(
            f"{key}: {folder} exists and is not a folder (or a parent is a file); choose another"
        ) from None
    except OSError as e:
        why = {errno.ENAMETOOLONG: "its name is too long", errno.EROFS: "the file system is read-only"}.get(
            e.errno, e.strerror or type(e).__name__
        )
        raise ConfigError(f"{key}: cannot write to {folder} ({why}); choose a writable folder") from None


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


def verify(path: Path, *, key: str = "checkpoint") -> Metadata:
    """The metadata of the checkpoint at `path`, read and checked without running code from it.

    key: the config key that named `path`, for the error message.
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
    sizes: dict[str, int] = {}
    for info in metadata.storage_data.values():
        file = path / info.relative_path
        if info.relative_path not in sizes:
            sizes[info.relative_path] = file.stat().st_size if file.is_file() else -1
        if sizes[info.relative_path] < 0:
            raise ConfigError(f"{key}: {file} is missing; the checkpoint is incomplete (delete {path})")
        if sizes[info.relative_path] < info.offset + info.length:
            raise ConfigError(
                f"{key}: {file} is truncated ({sizes[info.relative_path]:,} bytes, needs "
                f"{info.offset + info.length:,}); the checkpoint is incomplete (delete {path})"
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
    """Model and optimizer state in the form DCP reshards: FQN-keyed, DTensors kept sharded."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        state = {"model": get_model_state_dict(self.model)}
        if self.optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state["model"])
        if self.optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])


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
    ):
        """`stateful`: everything else to save and restore (loader, train state)."""
        self.cfg = cfg
        self.folder = Path(dump_folder) / cfg.folder
        self.model, self.optimizer = model, optimizer
        self.stateful = stateful
        # DCP's collectives go over a gloo group so an async save in a background thread
        # never competes with NCCL training collectives; on CPU this is the default group.
        self.process_group = process_group
        self._pending: tuple[Future, int] | None = None
        self._started = 0.0  # when the last save began
        self._staging: Future | None = None
        self._stager = None
        if cfg.async_mode == "async_with_pinned_mem" and not torch.cuda.is_available():
            raise ConfigError(
                "checkpoint.async_mode: async_with_pinned_mem stages checkpoints through pinned (page-locked) memory, "
                'which needs CUDA; use "async" on this machine'
            )

    # ---------------------------------------------------------------- loading

    def resume_step(self) -> int:
        """The step `load` resumes from: the newest published checkpoint's, else 0."""
        found = complete_checkpoints(self.folder) if self.cfg.enable else []
        return found[-1][0] if found else 0

    def load(self) -> int:
        """Resume from the newest published checkpoint, else initialize from initial_load_path.

        Returns the step to continue from (0 for a fresh run).
        """
        if self.cfg.enable and (found := complete_checkpoints(self.folder)):
            step, path = found[-1]
            self._load(path, model_only=step == 0, key="checkpoint.folder")  # step 0: a seed, weights only
            _log(f"resumed from {path}")
            return step
        if self.cfg.initial_load_path is not None:
            path = Path(self.cfg.initial_load_path)
            self._load(path, model_only=True, key="checkpoint.initial_load_path")
            _log(f"initialized model weights from {path}")
        return 0

    def _load(self, path: Path, *, model_only: bool, key: str) -> None:
        metadata = verify(path, key=key)
        model_state = get_model_state_dict(self.model)
        check_holds(path, metadata, {f"model_and_optimizer.model.{k}": v for k, v in model_state.items()}, key=key)
        state: dict[str, Any] = {
            "model_and_optimizer": ModelAndOptimizer(self.model, None if model_only else self.optimizer)
        }
        if not model_only:
            state.update(self.stateful)
        try:
            dcp.load(state, checkpoint_id=str(path), process_group=self.process_group)
        except ConfigError:  # a Stateful refusing what it was given (e.g. the loader: other data)
            raise
        except Exception as e:  # DCP gathers every rank's read errors into one exception on all ranks
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"{key}: {path} could not be read ({first[:300]}); delete it or point elsewhere"
            ) from None
        if bad := nonfinite_parameters(self.model):
            raise ConfigError(
                f"{key}: {path} holds non-finite weights ({len(bad)} tensors, e.g. {bad[0]}); resume from an "
                "earlier checkpoint (delete this one) or start from initial_load_path"
            )

    # ----------------------------------------------------------------- saving

    def should_save(self, step: int, *, last: bool) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or last)

    def save(self, step: int, *, model_only: bool = False, wait: bool = False) -> None:
        """Write step-<step>; async when configured (published by `poll` once done, or by the next save)."""
        self._finish_pending()
        if bad := nonfinite_parameters(self.model):
            raise ConfigError(
                f"training: the weights hold non-finite values at step {step} ({len(bad)} tensors, e.g. {bad[0]}); "
                f"not saving them. The last saved checkpoint is {self.latest()}; lower optimizer.lr and resume from it"
            )
        self._started = time.perf_counter()
        partial = self.folder / f"step-{step}.partial"
        if _rank() == 0:  # before DCP's first collective, so before any rank writes into it
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {
            "model_and_optimizer": ModelAndOptimizer(self.model, None if model_only else self.optimizer)
        }
        if not model_only:
            state.update(self.stateful)
        with self._out_of_space(step):
            if self.cfg.async_mode != "disabled" and not wait:
                self._pending = (self._async_save(state, partial), step)
            else:
                dcp.save(state, checkpoint_id=str(partial), process_group=self.process_group)
                self._publish(step)

    def _async_save(self, state: dict[str, Any], partial: Path) -> Future:
        if self.cfg.async_mode == "async":
            return dcp.async_save(state, checkpoint_id=str(partial), process_group=self.process_group)
        # async_with_pinned_mem, as torchtitan 0.2.2 does it: stage into pinned shared memory with a
        # background copy, upload from another process. Untested here (it needs CUDA).
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self._stager is None:
            self._stager = DefaultStager(StagingOptions(True, True, True, True))
        response = dcp.async_save(
            state, checkpoint_id=str(partial), process_group=self.process_group,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self._stager,
        )  # fmt: skip
        self._staging = response.staging_completion
        return response.upload_completion

    def wait_for_staging(self) -> None:
        """Before the optimizer changes the weights: the pinned copy of the last save must be complete."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None

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

    def export_safetensors(self, step: int) -> Path:
        """Unsharded model weights alone as <folder>/step-<step>/model.safetensors."""
        from safetensors.torch import save_file

        self._finish_pending()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)  # every rank takes part
        target = self.folder / f"step-{step}" / "model.safetensors"
        if _rank() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".tmp")
            with _OutOfSpace(tmp):
                save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"step": str(step)})
            os.replace(tmp, target)
            _log(f"exported weights to {target}")
        return target

    def close(self) -> None:
        self._finish_pending()


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
        raise ConfigError(
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
