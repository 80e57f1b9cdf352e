"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

Layout: <dump_folder>/<checkpoint.folder>/step-<N>/ holds one DCP checkpoint: the model and
optimizer (sharded as they are trained, resharded on load, so a run saved on 4 ranks
resumes on 2), the LR scheduler, the data loader position, the step and the RNG state.

A checkpoint is written to `step-<N>.partial/` and renamed to `step-<N>/` by rank 0 only
after every rank has finished writing and DCP's `.metadata` (written last) exists. Resume
looks at `step-<N>/` folders with `.metadata` only, so a run killed mid-save resumes from
the previous complete checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from config import Checkpoint
from errors import ConfigError

_STEP_DIR = re.compile(r"^step-(\d+)$")


def is_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file()


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every fully written checkpoint in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        if (match := _STEP_DIR.match(child.name)) and is_checkpoint(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


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
        optimizer: torch.optim.Optimizer,
        stateful: dict[str, Stateful],
        process_group: dist.ProcessGroup | None = None,
    ):
        """`stateful`: everything else to save and restore (LR scheduler, loader, train state)."""
        self.cfg = cfg
        self.folder = Path(dump_folder) / cfg.folder
        self.model, self.optimizer = model, optimizer
        self.stateful = stateful
        # DCP's collectives go over a gloo group so an async save in a background thread
        # never competes with NCCL training collectives; on CPU this is the default group.
        self.process_group = process_group
        self._pending: tuple[Future, int, Path] | None = None
        if self.folder.exists() and not self.folder.is_dir():
            raise ConfigError(f"checkpoint.folder: {self.folder} exists and is not a folder; choose another folder")

    # ---------------------------------------------------------------- loading

    def load(self) -> int:
        """Resume from the newest complete checkpoint, else initialize from initial_load_path.

        Returns the step to continue from (0 for a fresh run).
        """
        if self.cfg.enable and (found := complete_checkpoints(self.folder)):
            step, path = found[-1]
            if step == 0:  # a seed checkpoint: weights only
                self._load_model(path)
            else:
                state = {"model_and_optimizer": ModelAndOptimizer(self.model, self.optimizer), **self.stateful}
                dcp.load(state, checkpoint_id=str(path), process_group=self.process_group)
            _log(f"resumed from {path}")
            return step
        if self.cfg.initial_load_path is not None:
            path = Path(self.cfg.initial_load_path)
            if not is_checkpoint(path):
                raise ConfigError(
                    f"checkpoint.initial_load_path: {path} is not a DCP checkpoint (no .metadata inside); "
                    "point it at a step-<N> folder"
                )
            self._load_model(path)
            _log(f"initialized model weights from {path}")
        return 0

    def _load_model(self, path: Path) -> None:
        model_state = get_model_state_dict(self.model)
        _check_holds(path, {f"model_and_optimizer.model.{k}": v for k, v in model_state.items()})
        state = {"model_and_optimizer": ModelAndOptimizer(self.model, None)}
        dcp.load(state, checkpoint_id=str(path), process_group=self.process_group)

    # ----------------------------------------------------------------- saving

    def should_save(self, step: int, *, last: bool) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or last)

    def save(self, step: int, *, model_only: bool = False, wait: bool = False) -> None:
        """Write step-<step>; async when configured (the next save or `close` waits for it)."""
        self._finish_pending()
        final = self.folder / f"step-{step}"
        partial = self.folder / f"step-{step}.partial"
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)  # debris of a save that was killed
            partial.mkdir(parents=True, exist_ok=True)
        optimizer = None if model_only else self.optimizer
        state: dict[str, Any] = {"model_and_optimizer": ModelAndOptimizer(self.model, optimizer)}
        if not model_only:
            state.update(self.stateful)
        if self.cfg.async_mode == "async" and not wait:
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.process_group)
            self._pending = (future, step, final)
        else:
            dcp.save(state, checkpoint_id=str(partial), process_group=self.process_group)
            self._publish(step, partial, final)

    def _finish_pending(self) -> None:
        if self._pending is not None:
            future, step, final = self._pending
            self._pending = None
            future.result()
            self._publish(step, final.with_name(final.name + ".partial"), final)

    def _publish(self, step: int, partial: Path, final: Path) -> None:
        # DCP writes .metadata after gathering every rank's write results, so once rank 0 is
        # here the checkpoint is complete; only then does it get its resumable name.
        if _rank() == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            self._prune()
            _log(f"saved checkpoint {final}")
        if dist.is_initialized():
            dist.barrier(group=self.process_group)

    def _prune(self) -> None:
        if self.cfg.keep_latest_k > 0:
            for _, path in complete_checkpoints(self.folder)[: -self.cfg.keep_latest_k]:
                shutil.rmtree(path, ignore_errors=True)

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
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"step": str(step)})
            os.replace(tmp, target)
            _log(f"exported weights to {target}")
        return target

    def close(self) -> None:
        self._finish_pending()


def _check_holds(path: Path, expected: dict[str, torch.Tensor]) -> None:
    """Fail with one line, before DCP does with a traceback per rank, if `path` lacks weights."""
    try:
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # unpickling garbage raises anything
        raise ConfigError(
            f"checkpoint: {path}/.metadata is unreadable ({type(e).__name__}); it is not a DCP checkpoint"
        ) from None
    missing = [k for k in expected if k not in stored]
    wrong = [k for k, v in expected.items() if k in stored and tuple(getattr(stored[k], "size", ())) != tuple(v.shape)]
    if missing or wrong:
        first = (missing or wrong)[0].removeprefix("model_and_optimizer.model.")
        raise ConfigError(
            f"checkpoint: {path} does not fit this model ({len(missing)} weights missing, {len(wrong)} of another "
            f"shape, e.g. {first}); check model.flavor (or model.hf_assets_path) and the checkpoint path"
        )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _log(message: str) -> None:
    if _rank() == 0:
        print(f"[checkpoint] {message}", flush=True)
