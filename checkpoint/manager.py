"""CheckpointManager: save (blocking or async), resume, prune, and the model and optimizer as DCP states
(checkpoint/__init__.py)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from checkpoint.checksums import ChecksumWriter, folder_digests
from checkpoint.folder import OutOfSpace, complete_checkpoints, log, rank, refuse_all_damaged, set_aside
from checkpoint.hf_export import export_hf_folder
from checkpoint.torchtitan import TorchtitanState, is_torchtitan, load_torchtitan, torchtitan_named
from checkpoint.verify import check_holds, nonfinite_parameters, verify, verify_contents
from config import Checkpoint, Model, model_args
from errors import ConfigError
from models import ModelFamily, family

# ---------------------------------------------------------------------- manager


class ModelAndOptimizer(Stateful):
    """Model and optimizer state in the form DCP reshards: FQN-keyed, DTensors kept sharded.

    optimizer None: the model alone (seed checkpoints, model-only last saves, loading without it).
    model_dtype: the dtype the model weights are saved in (a model-only last save's export_dtype).
    only: the model's parameters of these names alone (a frozen base's or the trainable ones: `split_frozen`);
    None: all of them.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        model_dtype: torch.dtype | None = None,
        only: frozenset[str] | None = None,
    ):
        self.model, self.optimizer, self.model_dtype, self.only = model, optimizer, model_dtype, only

    def model_state(self) -> dict[str, Any]:
        state = get_model_state_dict(self.model)
        return state if self.only is None else {name: t for name, t in state.items() if name in self.only}

    def state_dict(self) -> dict[str, Any]:
        model = self.model_state()
        if self.model_dtype is not None:
            model = {name: tensor.to(self.model_dtype) for name, tensor in model.items()}
        state = {"model": model}
        if self.optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        return torch.utils._pytree.tree_map_only(torch.Tensor, _plain, state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=self.only is None))
        if self.optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])


def split_frozen(model: nn.Module) -> tuple[frozenset[str], frozenset[str]] | None:
    """(trainable, frozen) parameter names where the model has both (LoRA: adapters on a frozen base), else None.
    Such a model's checkpoints hold the trainable parameters (and their optimizer state) alone; the frozen ones are
    initial_load_path's, read again on resume and checked to be the same files (`BaseRecord`)."""
    trainable = frozenset(name for name, p in model.named_parameters() if p.requires_grad)
    frozen = frozenset(name for name, p in model.named_parameters() if not p.requires_grad)
    return (trainable, frozen) if trainable and frozen else None


class BaseRecord(Stateful):
    """Which files a checkpoint's trainable parameters were trained on top of (`split_frozen`): initial_load_path's
    (or the Hugging Face folder's) digests, saved with every checkpoint and compared on resume."""

    def __init__(self) -> None:
        self.now: dict[str, Any] | None = None  # the base this process loaded
        self.saved: dict[str, Any] | None = None  # the one the checkpoint loaded was trained on

    def state_dict(self) -> dict[str, Any]:
        return {"files": json.dumps(self.now, sort_keys=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = json.loads(state["files"])


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


@dataclass(frozen=True)
class ModelInterop:
    """What loading and exporting Hugging Face folders and reading torchtitan's checkpoints need of the model:
    its family, its shape as published (Hugging Face names and config.json), the Hugging Face folder
    initial_load_in_hf reads when initial_load_path is unset, and the tokenizer folder whose files an export copies."""

    family: ModelFamily
    args: Any
    hf_assets_path: str | None = None
    tokenizer_path: str | None = None

    @classmethod
    def from_config(cls, cfg: Model) -> ModelInterop:
        return cls(family(cfg.name), model_args(cfg), cfg.hf_assets_path, cfg.tokenizer_path)

    def side_files(self) -> str | None:
        """The folder whose tokenizer files a Hugging Face export copies: hf_assets_path's, else a tokenizer_path
        folder's."""
        tokenizer = self.tokenizer_path if self.tokenizer_path and Path(self.tokenizer_path).is_dir() else None
        return self.hf_assets_path or tokenizer


class CheckpointManager:
    # async_with_pinned_mem's staging (CUDA, which __init__ requires of the mode): pinned shared memory, a background
    # copy, non-blocking device-to-host copies.
    PINNED = StagingOptions(
        use_pinned_memory=True, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=True
    )

    def __init__(
        self,
        cfg: Checkpoint,
        *,
        dump_folder: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        stateful: dict[str, Stateful],
        process_group: dist.ProcessGroup | None = None,
        interop: ModelInterop | None = None,
        on_point: Callable[[str, int], None] | None = None,
    ):
        """`stateful`: everything else to save and restore (loader, train state). interop: only Hugging Face loading
        and export and torchtitan's checkpoints need it. on_point: called with a point's name and the step at each
        point a save passes, in order `start` (every rank), `write` (every rank, the first bytes of a file written),
        `metadata`, `manifest`, `publish` and `prune` (rank 0): a test or drill holds a rank still there
        (fleet/faults.py); None in a run."""
        self.cfg = cfg
        self.folder = Path(dump_folder) / cfg.folder
        self.model, self.optimizer = model, optimizer
        self.stateful, self.interop, self.on_point = stateful, interop, on_point
        # DCP's collectives go over a gloo group so an async save in a background thread
        # never competes with NCCL training collectives; on CPU this is the default group.
        self.process_group = process_group
        self._pending: tuple[Future, int] | None = None
        self._started = 0.0  # when the last save began
        self.last_saved = -1  # the step of the last save begun (async ones may still be running)
        self._staging: Future | None = None
        self._stager = None
        self._resume_checked: tuple[tuple[int, Path] | None] | None = None  # _resume_from's answer, once found
        self.torchtitan: TorchtitanState | None = None  # what torchtitan's checkpoint said, when one was loaded
        self.base = BaseRecord()  # the files of a frozen base (split_frozen), recorded with each checkpoint
        if cfg.async_mode == "async_with_pinned_mem" and not torch.cuda.is_available():
            raise ConfigError(
                "checkpoint.async_mode: async_with_pinned_mem stages checkpoints through pinned (page-locked) memory, "
                'which needs CUDA; use "async" on this machine'
            )

    def _interop(self, act: str) -> ModelInterop:
        assert self.interop is not None, f"CheckpointManager(interop=...) {act}"
        return self.interop

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
                    if rank() == 0:  # after the collective: the other ranks are done with its files
                        set_aside(path, step, problem=e.problems[0].removeprefix("checkpoint.folder: "))
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
        """The step a run continues from once `load`ed: load_step's or the newest published checkpoint's; 0 for a
        fresh run, or with train_state in exclude_from_loading (the one way `load` takes a model-only checkpoint
        of a later step than 0)."""
        found = self._resume_from()
        return found[0] if found and "train_state" not in self.cfg.exclude_from_loading else 0

    def load(self) -> None:
        """Resume from this run's checkpoint (at `resume_step`), else initialize the weights from initial_load_path
        (DCP, or Hugging Face safetensors with initial_load_in_hf)."""
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
                self._resume_torchtitan(path, metadata, excluded=excluded, model_only=model_only)
                return
            parts = {} if model_only else {k: v for k, v in self.stateful.items() if k not in excluded}
            optimizer = None if model_only or "optimizer" in excluded else self.optimizer
            if split := split_frozen(self.model):  # the frozen base first, from where it came; the step holds the rest
                self.load_initial(what="the frozen base")
                parts["frozen_base"] = self.base
            self._load(
                path,
                metadata,
                ModelAndOptimizer(self.model, optimizer, only=split[0] if split else None),
                parts,
                key="checkpoint.folder",
                load_model="model" not in excluded,
            )
            if split:
                self._check_base(path)
            log(f"resumed from {path}" + (f" (not restored: {', '.join(sorted(excluded))})" if excluded else ""))
            return
        self.load_initial(what="the frozen base" if split_frozen(self.model) else "model weights")

    def load_initial(self, *, what: str = "model weights") -> None:
        """The model's initial weights: initial_load_path's (DCP, or Hugging Face safetensors with initial_load_in_hf),
        or none to load (a random init); of a model with a frozen base (split_frozen), the frozen parameters alone,
        whose files are recorded (BaseRecord). Also what a DPO run's live reference starts from on a resume (dpo.py),
        and a distillation's teacher (distill.py); `what` names them in the log."""
        split = split_frozen(self.model)
        if self.cfg.initial_load_in_hf:
            interop = self._interop("reads Hugging Face folders")
            folder = Path(self.cfg.initial_load_path or interop.hf_assets_path or "")
            self._load_hf(folder)
            log(f"initialized {what} from the Hugging Face folder {folder}")
        elif self.cfg.initial_load_path is not None:
            path = folder = Path(self.cfg.initial_load_path)
            metadata = verify(path, key="checkpoint.initial_load_path")
            verify_contents(path, key="checkpoint.initial_load_path", group=self.process_group)
            if is_torchtitan(metadata):
                self._load_torchtitan(path, metadata, None, key="checkpoint.initial_load_path")
            else:
                weights = ModelAndOptimizer(self.model, None, only=split[1] if split else None)
                self._load(path, metadata, weights, {}, key="checkpoint.initial_load_path")
            log(f"initialized {what} from {path}" + (" (torchtitan's checkpoint)" if self.torchtitan else ""))
        else:
            folder = None
        if split:
            files = folder_digests(folder, group=self.process_group) if folder is not None else {}
            self.base.now = {"path": str(folder) if folder is not None else None, "files": files}

    def _check_base(self, path: Path) -> None:
        """The frozen base loaded now is the one the checkpoint at `path` was trained on, or one line saying so."""
        saved, now = self.base.saved or {}, self.base.now or {}
        if saved.get("files") == now.get("files") and (saved.get("files") or saved.get("path") == now.get("path")):
            return
        where = now.get("path") or "a random init (no checkpoint.initial_load_path)"
        was = saved.get("path") or "a random init"
        differ = sorted(set(saved.get("files", {}).items()) ^ set(now.get("files", {}).items()))
        detail = f", e.g. {differ[0][0]}" if differ else ""
        raise ConfigError(
            f"checkpoint.initial_load_path: {where} is not the frozen base {path} was trained on ({was}; its files "
            f"differ{detail}); point checkpoint.initial_load_path (or model.hf_assets_path) at that base"
        )

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
        model_state = weights.model_state()
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

    def _resume_torchtitan(self, path: Path, metadata: Metadata, *, excluded: set[str], model_only: bool) -> None:
        """Resume from torchtitan's checkpoint (checkpoint/torchtitan.py): weights, AdamW state and step; each
        stateful part with a `load_torchtitan(state)` takes what it can (the step, the data position), the others
        start afresh."""
        optimizer = None if model_only or "optimizer" in excluded else self.optimizer
        if optimizer is not None and any(group.get("muon") for group in optimizer.param_groups):
            raise ConfigError(
                f"checkpoint.folder: {path} is torchtitan's, with AdamW's state, and optimizer.name is \"Muon\": set "
                'checkpoint.exclude_from_loading = ["optimizer"] to start Muon from its weights and step, or resume '
                'with optimizer.name = "AdamW"'
            )
        state = self._load_torchtitan(path, metadata, optimizer, key="checkpoint.folder")
        parts = {} if model_only else {n: p for n, p in self.stateful.items() if n not in excluded}
        taken = [name for name, part in parts.items() if hasattr(part, "load_torchtitan")]
        for name in taken:
            self.stateful[name].load_torchtitan(state)
        fresh = sorted(set(self.stateful) - set(taken))
        log(f"resumed from torchtitan's checkpoint {path}" + (f" (afresh: {', '.join(fresh)})" if fresh else ""))

    def _load_torchtitan(
        self, path: Path, metadata: Metadata, optimizer: torch.optim.Optimizer | None, *, key: str
    ) -> TorchtitanState:
        interop = self._interop("reads torchtitan's checkpoints")
        # torchtitan's weights: top level, under its names
        check_holds(path, metadata, torchtitan_named(interop.family, get_model_state_dict(self.model)), key=key)
        self.torchtitan = load_torchtitan(
            path, metadata, self.model, optimizer, family=interop.family, args=interop.args, key=key,
            group=self.process_group,
        )  # fmt: skip
        self._refuse_nonfinite(path, key=key)
        return self.torchtitan

    def _load_hf(self, folder: Path) -> None:
        """Every rank reads its own shard of each weight from the safetensors files (DCP's Hugging Face
        reader), converting to the parameters' dtype as it copies."""
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        from models.hf import check_hf_weights, hf_sources, load_hf_weights, stacked

        key = "checkpoint.initial_load_path" if self.cfg.initial_load_path else "model.hf_assets_path"
        interop = self._interop("reads Hugging Face folders")
        fam, args = interop.family, interop.args
        try:
            check_hf_weights(folder, fam, args)
        except ConfigError as e:
            raise ConfigError(*(f"{key}: {problem}" for problem in e.problems)) from None
        sources = hf_sources(fam, args)
        if stacked(sources):
            # DCP's reader fills whole tensors, and a parameter stacked from several HF tensors (an MoE's experts)
            # is none: every rank reads each tensor and keeps its shard (models/hf.py).
            load_hf_weights(self.model, folder, fam, args)
        else:
            state = get_model_state_dict(self.model)
            hf_state = {hf: state[ours] for hf, (ours, _) in sources.items()}
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
        if rank() == 0:  # before DCP's first collective, so before any rank writes into it
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True, exist_ok=True)
        self._point("start", step)
        model_only = model_only or (last and self.cfg.last_save_model_only)
        dtype = getattr(torch, self.cfg.export_dtype) if last and self.cfg.last_save_model_only else None
        split = split_frozen(self.model)  # a frozen base is initial_load_path's: the checkpoint holds the rest
        state: dict[str, Any] = {
            "model_and_optimizer": ModelAndOptimizer(
                self.model, None if model_only else self.optimizer, model_dtype=dtype, only=split[0] if split else None
            )
        }
        if not model_only:
            state.update(self.stateful)
        if split:
            state["frozen_base"] = self.base
        with self._out_of_space(step):
            if self.cfg.async_mode != "disabled" and not (wait or last):
                self._pending = (self._async_save(state, self._writer(partial, step)), step)
            else:
                dcp.save(state, storage_writer=self._writer(partial, step), process_group=self.process_group)
                self._publish(step)
        if last and self.cfg.last_save_in_hf and rank() == 0:
            self.export_hf(step)

    def export_hf(self, step: int) -> Path:
        """step-<step> as a Hugging Face folder, <folder>/step-<step>-hf (export_dtype), tokenizer files included.

        Rank 0 alone, one output shard in memory at a time; the other ranks do not wait for it.
        """
        target = self.folder / f"step-{step}-hf"
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        begin = time.perf_counter()
        with OutOfSpace(partial):
            interop = self._interop("exports Hugging Face folders")
            export_hf_folder(
                self.folder / f"step-{step}",
                partial,
                family=interop.family,
                args=interop.args,
                dtype=getattr(torch, self.cfg.export_dtype),
                side_files_from=interop.side_files(),
            )
        if target.exists():
            shutil.rmtree(target)
        os.replace(partial, target)
        log(f"exported step {step} to the Hugging Face folder {target} ({time.perf_counter() - begin:.1f} s)")
        return target

    def _async_save(self, state: dict[str, Any], writer: ChecksumWriter) -> Future:
        from torch.distributed.checkpoint.staging import DefaultStager

        if self.cfg.async_mode == "async":
            # The stager DCP uses when given no writer; given ChecksumWriter (a FileSystemWriter, thus a
            # BlockingAsyncStager) it would stage with that instead. Hashing happens in the upload thread.
            stager = DefaultStager(StagingOptions(False, False, False, False))
            future = dcp.async_save(state, storage_writer=writer, process_group=self.process_group, async_stager=stager)
            future.add_done_callback(lambda _: stager.close())
            return future
        # async_with_pinned_mem, as torchtitan 0.2.2 does it: stage into pinned shared memory with a
        # background copy, upload from another process (CUDA only; make bench-gpu's cuda_paths checks it).
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self._stager is None:
            self._stager = DefaultStager(self.PINNED)
        response = dcp.async_save(
            state,
            storage_writer=writer,
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
        if rank() == 0:
            final = self.folder / f"step-{step}"
            self._point("publish", step)
            replaced = _pruned(final) if final.exists() else None  # (a step saved again, after load_step's resume)
            os.replace(self.folder / f"step-{step}.partial", final)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
            self._prune(step)
            size = sum(f.stat().st_size for f in final.iterdir())
            log(f"saved checkpoint {final} ({size / 2**20:,.1f} MiB, {time.perf_counter() - self._started:.2f} s)")
        if barrier and dist.is_initialized():
            dist.barrier(group=self.process_group)

    def _prune(self, saved: int) -> None:
        """Delete all but the newest keep_latest_k trained steps (`saved` the one just published). Each is renamed
        `step-<N>.pruned` before a file of it is deleted: a kill while deleting (a long time, for a large checkpoint on
        a network filesystem) then leaves no half of a checkpoint under a checkpoint's name, nor a `step-<N>` folder
        without `.metadata` that no later pruning would see; start-up removes the `.pruned` rest."""
        if self.cfg.keep_latest_k > 0:
            trained = [(step, path) for step, path in complete_checkpoints(self.folder) if step > 0]  # keep seeds
            for _, path in trained[: -self.cfg.keep_latest_k]:
                doomed = _pruned(path)
                self._point("prune", saved)
                shutil.rmtree(doomed, ignore_errors=True)

    def _point(self, name: str, step: int) -> None:
        if self.on_point is not None:
            self.on_point(name, step)

    def _writer(self, partial: Path, step: int) -> ChecksumWriter:
        return ChecksumWriter(partial, step=step, on_point=self.on_point)

    def _out_of_space(self, step: int) -> Any:
        return OutOfSpace(self.folder / f"step-{step}.partial")

    def latest(self) -> str:
        found = complete_checkpoints(self.folder)
        return str(found[-1][1]) if found else "none (checkpoint.enable is off or nothing was saved yet)"

    def close(self) -> None:
        self._finish_pending()


def _pruned(path: Path) -> Path:
    """`path` renamed `<name>.pruned` (one rename: it stops being a checkpoint at once), to be deleted."""
    doomed = path.with_name(f"{path.name}.pruned")
    shutil.rmtree(doomed, ignore_errors=True)  # (a leftover of an earlier kill, had start-up not removed it)
    os.replace(path, doomed)
    return doomed


def stager_reusable(stager: Any) -> bool:
    """Whether a DefaultStager can stage another save. PyTorch 2.11's closes itself at the end of each stage (its
    copier table emptied), so the next save with it fails with `KeyError: <class 'type'>` (pytorch/pytorch#183413,
    torchtitan#3476; fixed in later releases, where a stager is reused and keeps its pinned buffers)."""
    inner = getattr(stager, "_state_dict_stager", None)  # private: DefaultStager's StateDictStager
    return inner is None or bool(getattr(inner, "_deepcopy_dispatch", True))


class SaveStep:
    """After each step: publish a finished async save; save every checkpoint.interval steps and after the last."""

    def __init__(self, checkpoint: CheckpointManager, *, total_steps: int):
        self.checkpoint, self.total_steps = checkpoint, total_steps

    def __call__(self, step: int, result: Any) -> bool:
        self.checkpoint.poll()
        last = step == self.total_steps
        if self.checkpoint.should_save(step, last=last):
            self.checkpoint.save(step, last=last)
        return False


class _OptimizerOnly(Stateful):
    """exclude_from_loading = ["model"]: the optimizer state is restored, the weights are not."""

    def __init__(self, weights: ModelAndOptimizer):
        self.weights = weights

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.weights.state_dict()["optimizer"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.weights.model, self.weights.optimizer, state["optimizer"])
