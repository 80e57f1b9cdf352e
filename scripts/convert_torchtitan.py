"""Write one of this recipe's checkpoints as torchtitan 0.2.2's, so that torchtitan's trainer resumes from it with
its optimizer state, step, schedule and (where torchtitan reads the same token stream) data position.

    python scripts/convert_torchtitan.py CHECKPOINT OUT --config CONFIG [--dp N] [train.py's overrides]
    # e.g. the run's step-100 into a torchtitan dump folder, for torchtitan on one data-parallel rank:
    python scripts/convert_torchtitan.py outputs/debug/checkpoint/step-100 tt/checkpoint/step-100 \\
        --config configs/debug.toml
    # then torchtitan resumes: --job.dump_folder tt --checkpoint.enable (its checkpoint.folder, "checkpoint")

CONFIG and the overrides are the run's own (train.py's command line): they name the model, whose RoPE layout
torchtitan's differs from (checkpoint/torchtitan.py), and the data, whose position torchtitan's loader continues
from when it reads the same stream: one prepared corpus, unshuffled, not chat. --dp: the data-parallel degree
torchtitan resumes on (its loader keeps one position per rank and refuses another degree); each rank's batch is
the global batch / dp. Otherwise no data position is written, and torchtitan resumes with
--checkpoint.exclude_from_loading dataloader (its data from the start).

Going the other way needs no conversion: train.py resumes from torchtitan's checkpoints as they are. One process
on CPU, the whole checkpoint in memory (weights and two AdamW moments: 12 bytes a parameter in float32).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

# Runnable without installing the repo: its root holds config/ and models/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint import MODEL_PREFIX, is_model_only, verify, verify_contents  # noqa: E402
from checkpoint.checksums import ChecksumWriter  # noqa: E402
from checkpoint.torchtitan import is_torchtitan, torchtitan_loader_state, torchtitan_state_dict  # noqa: E402
from config import JobConfig, LRScheduler, load_config, model_args  # noqa: E402
from data.corpus import TokenCorpus, open_corpus  # noqa: E402
from data.tokenizers import build_tokenizer  # noqa: E402
from errors import ConfigError, report  # noqa: E402
from models import family  # noqa: E402
from optimizer import lr_factor  # noqa: E402

OPTIMIZER_PREFIX = "model_and_optimizer.optimizer."


def read_whole(path: Path, metadata: Metadata) -> dict[str, Any]:
    """Every item of the checkpoint at `path`, in memory, by its flat name."""
    state: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            state[fqn] = torch.empty(item.size, dtype=item.properties.dtype)
        elif isinstance(item, BytesStorageMetadata):
            state[fqn] = None
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def learning_rates(ours: dict[str, Any]) -> tuple[float, float]:
    """(the configured learning rate, the schedule's for the step after the saved one), by the settings the run
    saved with the checkpoint."""
    settings = {
        k.removeprefix("train_state.settings."): v for k, v in ours.items() if k.startswith("train_state.settings.")
    }

    def setting(name: str, cast: type) -> Any:
        value = settings[f"lr_scheduler.{name}"]
        return None if value == "None" else cast(value)

    schedule = LRScheduler(
        warmup_steps=int(settings["lr_scheduler.warmup_steps"]),
        total_steps=setting("total_steps", int),
        decay_ratio=setting("decay_ratio", float),
        decay_type=settings["lr_scheduler.decay_type"],
        min_lr_factor=float(settings["lr_scheduler.min_lr_factor"]),
    )
    lr, step = float(settings["optimizer.lr"]), int(ours["train_state.step"])
    return lr, lr * lr_factor(step, schedule, training_steps=int(settings["training.steps"]))


def loader_state(cfg: JobConfig, ours: dict[str, Any], *, dp: int) -> tuple[dict[str, Any] | None, str]:
    """torchtitan's dataloader part for the run's data position, or None and why not."""
    d = cfg.data
    if d.mixture or d.shuffle or d.chat:
        return None, "the run read a mixture, shuffled or chat data, which torchtitan's loader does not read alike"
    global_batch = int(ours["dataloader.global_batch_size"])
    if global_batch % dp:
        raise ConfigError(f"--dp: {dp} does not divide the run's global batch of {global_batch} sequences")
    corpus: TokenCorpus = open_corpus(d, build_tokenizer(cfg.model.tokenizer_path), cfg.model.tokenizer_path)
    if corpus.fingerprint != ours["dataloader.dataset"]:
        raise ConfigError(
            f"--config: its data.path is not the data the checkpoint was trained on (fingerprint {corpus.fingerprint} "
            f"vs {ours['dataloader.dataset']}); give the run's own config and overrides"
        )
    ends = np.concatenate([start + e for start, e in zip(corpus.shard_starts[:-1], corpus.doc_ends, strict=True)])
    state = torchtitan_loader_state(
        ends, corpus.read, samples=int(ours["dataloader.sample_index"]), window=int(ours["dataloader.window"]),
        dp=dp, batch_size=global_batch // dp,
    )  # fmt: skip
    return state, ""


def convert(checkpoint: Path, out: Path, cfg: JobConfig, *, dp: int) -> str:
    """Write `checkpoint` as torchtitan's at `out`; returns a line on what was left out, if anything."""
    if out.exists():
        raise ConfigError(f"OUT: {out} already exists; choose a new step-<N> folder")
    metadata = verify(checkpoint, key="CHECKPOINT")
    if is_torchtitan(metadata):
        raise ConfigError(f"CHECKPOINT: {checkpoint} is torchtitan's already; torchtitan resumes from it as it is")
    verify_contents(checkpoint, key="CHECKPOINT")
    ours = read_whole(checkpoint, metadata)
    weights = {k.removeprefix(MODEL_PREFIX): v for k, v in ours.items() if k.startswith(MODEL_PREFIX)}
    fam, args = family(cfg.model.name), model_args(cfg.model)
    if is_model_only(metadata):
        state = torchtitan_state_dict(weights, None, family=fam, args=args, step=0, lr=0.0, next_lr=0.0,
                                      tokens_per_rank=0, loader=None)  # fmt: skip
        left_out = (
            f"{checkpoint} holds the weights only: torchtitan starts from them (--checkpoint.initial_load_path {out})"
        )
    else:
        optimizer = {k.removeprefix(OPTIMIZER_PREFIX).replace("param_groups.0.", "param_groups."): v
                     for k, v in ours.items() if k.startswith(OPTIMIZER_PREFIX)}  # fmt: skip
        if any(k.endswith(".momentum_buffer") for k in optimizer):
            raise ConfigError(
                f"CHECKPOINT: {checkpoint} was trained with Muon, and torchtitan 0.2.2 has no Muon to continue its "
                "state; start torchtitan from the weights (a step saved with checkpoint.last_save_model_only = true)"
            )
        lr, lr_next = learning_rates(ours)
        loader, why = loader_state(cfg, ours, dp=dp)
        left_out = (
            why and f"no data position ({why}); resume torchtitan with --checkpoint.exclude_from_loading dataloader"
        )
        window, global_batch = int(ours["dataloader.window"]), int(ours["dataloader.global_batch_size"])
        state = torchtitan_state_dict(
            weights, optimizer, family=fam, args=args, step=int(ours["train_state.step"]), lr=lr, next_lr=lr_next,
            tokens_per_rank=global_batch // dp * (window - 1), loader=loader,
        )  # fmt: skip
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    dcp.save(state, storage_writer=ChecksumWriter(partial), no_dist=True)
    os.replace(partial, out)
    return left_out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="this recipe's step-<N> folder (any step, saved on any ranks)")
    parser.add_argument("out", type=Path, help="the step-<N> folder to create, e.g. in a torchtitan dump folder")
    parser.add_argument("--config", required=True, help="the run's TOML (train.py's --config)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree torchtitan resumes on (default 1)")
    opts, overrides = parser.parse_known_args(argv)
    # One process by design: DCP's "assuming the intent is to save/load in a single process" is right.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    if opts.dp < 1:
        raise ConfigError(f"--dp: {opts.dp} must be at least 1")
    cfg = load_config(["--config", opts.config, *overrides])
    left_out = convert(opts.checkpoint, opts.out, cfg, dp=opts.dp)
    print(f"wrote {opts.out}: torchtitan's checkpoint of {opts.checkpoint}")
    if left_out:
        print(left_out)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as e:
        sys.exit(report(e))
