"""torchtitan 0.2.2's DCP checkpoints, read and written: a torchtitan run continues here with its optimizer state,
step and schedule (no flag: checkpoint/manager.py recognises the layout), and a run of this recipe continues in
torchtitan's trainer (scripts/convert_torchtitan.py).

torchtitan's CheckpointManager saves {"model": ModelWrapper, "optimizer", "lr_scheduler", "dataloader",
"train_state"} with the model's state dict flattened to the top level. Each part, and where it goes here:

    <name>                              the weights, by the names this recipe's model has   -> the model
    optimizer.state.<name>.<k>          AdamW's step, exp_avg, exp_avg_sq, flattened by       -> the optimizer
                                        parameter name (StateDictOptions(flatten_optimizer_state_dict))
    optimizer.param_groups.<name>.<k>   lr (the next step's), initial_lr, betas, eps,        -> compared with [optimizer]
                                        weight_decay, decoupled_weight_decay (AdamW or Adam)
    lr_scheduler.<k>                    LambdaLR's last_epoch (the step), base_lrs, _last_lr  -> compared with the
                                        (the next step's lr); the schedule here is a function    schedule's lr for
                                        of the step and [lr_scheduler]                            the next step
    train_state.step, .ntokens_seen                                                           -> the step
    dataloader.dp_rank_<r>, .world_size each data-parallel rank's position in its own        -> not read: the loader
                                        dataset, a pickled StatefulDataLoader state            continues at the
                                        (documents read, tokens left over)                     step's sample

RoPE: torchtitan's Llama 3 rotates interleaved pairs of each head (Meta's layout), this recipe's model
rotates halves (Hugging Face's), so the rows of wq and wk, and of their exp_avg and exp_avg_sq, are
permuted within each head on the way in and back on the way out; the family says which weights
(ModelFamily.torchtitan_interleaved). The permutation is a relabelling of each head's q and k features:
attention scores, and so every loss, are the same.

Names and buffers: where torchtitan's model of a family names a weight otherwise (Qwen3 MoE's router, its
moe.router.gate), the weight and its moments are read and written under torchtitan's name
(ModelFamily.torchtitan_names). A buffer torchtitan's model holds and this recipe's does not, inert while zero (Qwen3
MoE's load-balancing expert_bias, ModelFamily.torchtitan_zero_buffers), is read only to refuse a checkpoint that holds
it nonzero, and written as zeros, so that torchtitan's model, which asks for it, finds it.

Out, the data position is written when torchtitan's loader would read this run's token stream: one prepared
corpus, unshuffled, not chat. torchtitan gives each data-parallel rank a contiguous slice of the documents
(datasets' `shard(contiguous=True)`) and packs each rank's BOS + document + EOS stream into windows of
seq_len + 1 tokens, as this recipe packs the whole corpus; with one rank the two streams are the same, and the
continuation reads the batches this recipe would have.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from errors import ConfigError
from models import ModelFamily

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # torchtitan's optimizer state dict
_MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-element state, laid out as the parameter
_GROUP_KEYS = ("initial_lr", "betas", "eps", "weight_decay", "decoupled_weight_decay")


def is_torchtitan(metadata: Metadata) -> bool:
    """Whether torchtitan wrote the checkpoint: its weights are at the top level, not under model_and_optimizer."""
    keys = metadata.state_dict_metadata
    return not any(k.startswith("model_and_optimizer.") for k in keys) and any(
        k.startswith("tok_embeddings.") for k in keys
    )


# ------------------------------------------------------------------ RoPE layout


def to_rotate_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's rows of a q or k projection -> this recipe's: within each head, the first of pair i (row 2i)
    becomes row i and the second (row 2i + 1) row i + head_dim/2."""
    return w.reshape(heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """This recipe's rows of a q or k projection -> torchtitan's (to_rotate_half undone)."""
    return w.reshape(heads, 2, -1, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _permuted(t: torch.Tensor, heads: int, permute: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """`permute` applied to a whole weight; a sharded one (FSDP, TP) is gathered, permuted, and each rank keeps its
    own shard again (one weight in full at a time)."""
    if not isinstance(t, DTensor):
        return permute(t, heads)
    return distribute_tensor(permute(t.full_tensor(), heads), t.device_mesh, t.placements, src_data_rank=None)


def interleaved_weights(fam: ModelFamily, args: Any, names: Any) -> dict[str, int]:
    """{weight name: heads} of the weights among `names` that torchtitan holds in RoPE's interleaved layout."""
    inside = fam.torchtitan_interleaved(args)
    return {n: inside[n.split(".", 2)[2]] for n in names if n.startswith("layers.") and n.split(".", 2)[2] in inside}


# ------------------------------------------------------------------ names


def torchtitan_name(fam: ModelFamily, name: str) -> str:
    """This recipe's weight `name` as torchtitan's model of the family names it (ModelFamily.torchtitan_names)."""
    if not name.startswith("layers."):
        return name
    _, layer, inside = name.split(".", 2)
    return f"layers.{layer}.{fam.torchtitan_names.get(inside, inside)}"


def torchtitan_named(fam: ModelFamily, state: dict[str, Any]) -> dict[str, Any]:
    """`state` (weights by name, or AdamW's flat "state.<name>.<k>" and "param_groups.<name>.<k>") under torchtitan's
    names, the same values."""

    def renamed(key: str) -> str:
        for prefix in ("state.", "param_groups."):
            if key.startswith(prefix):
                name, k = key.removeprefix(prefix).rsplit(".", 1)
                return f"{prefix}{torchtitan_name(fam, name)}.{k}"
        return torchtitan_name(fam, key)

    return {renamed(key): value for key, value in state.items()}


def zero_buffers(fam: ModelFamily, args: Any, weights: Any) -> dict[str, tuple[int, ...]]:
    """{torchtitan's name: shape} of the buffers torchtitan's model may hold that change nothing while zero, where the
    model whose state dict holds `weights` has none that torchtitan names so (ModelFamily.torchtitan_zero_buffers)."""
    inside = fam.torchtitan_zero_buffers(args)
    held = {torchtitan_name(fam, n) for n in weights}
    layers = sorted({int(n.split(".")[1]) for n in weights if n.startswith("layers.")})
    named = {f"layers.{i}.{buffer}": shape for i in layers for buffer, shape in inside.items()}
    return {name: shape for name, shape in named.items() if name not in held}


def _refuse_nonzero_buffers(path: Path, metadata: Metadata, buffers: dict[str, tuple[int, ...]], *, key: str,
                            group: dist.ProcessGroup | None) -> None:  # fmt: skip
    """One line if torchtitan's checkpoint holds any of `buffers` nonzero: this run's model, without them, would route
    otherwise than the model that was saved."""
    stored = {n: torch.empty(shape) for n, shape in buffers.items() if n in metadata.state_dict_metadata}
    if not stored:
        return
    dcp.load(stored, checkpoint_id=str(path), process_group=group, no_dist=not dist.is_initialized())
    nonzero = [n for n, t in stored.items() if t.any()]
    if nonzero:
        raise ConfigError(
            f"{key}: {path} holds torchtitan's load-balancing {nonzero[0].split('.', 2)[2]} nonzero ({len(nonzero)} "
            f"blocks, e.g. {nonzero[0]}), which moves its routing, and this run's model has no expert bias; set "
            "model.moe.load_balance_coeff > 0 (torchtitan's default is 0.001) to load and train it"
        )


# ------------------------------------------------------------------ in


@dataclass(frozen=True)
class TorchtitanState:
    """What a torchtitan checkpoint says besides its tensors."""

    path: Path
    step: int
    settings: dict[str, Any]  # what its optimizer was given, under this recipe's config keys
    next_lr: float | None  # the learning rate its schedule set for step + 1
    adamw: bool  # decoupled weight decay (AdamW), not Adam's L2 term


def read_state(path: Path, metadata: Metadata, *, group: dist.ProcessGroup | None = None) -> TorchtitanState:
    """The step, schedule and optimizer settings of torchtitan's checkpoint at `path` (plain values, read first)."""
    keys = metadata.state_dict_metadata
    group_of = next((k.rsplit(".", 1)[0] for k in keys if k.startswith("optimizer.param_groups.")), None)
    wanted = ["train_state.step", "lr_scheduler._last_lr"]
    wanted += [f"{group_of}.{k}" for k in _GROUP_KEYS] if group_of else []
    values: dict[str, Any] = {k: None for k in wanted if k in keys}
    if values:
        dcp.load(values, checkpoint_id=str(path), process_group=group, no_dist=not dist.is_initialized())
    hyper = {k: values.get(f"{group_of}.{k}") for k in _GROUP_KEYS}
    settings = {}
    if hyper["initial_lr"] is not None:
        settings["optimizer.lr"] = hyper["initial_lr"]
    if hyper["betas"] is not None:
        settings["optimizer.beta1"], settings["optimizer.beta2"] = hyper["betas"]
    settings |= {f"optimizer.{k}": hyper[k] for k in ("eps", "weight_decay") if hyper[k] is not None}
    last_lr = values.get("lr_scheduler._last_lr")
    return TorchtitanState(
        path=path,
        step=int(values.get("train_state.step") or 0),
        settings=settings,
        next_lr=float(last_lr[0]) if last_lr else None,
        adamw=hyper["decoupled_weight_decay"] is not False or not hyper["weight_decay"],
    )


def load_torchtitan(
    path: Path,
    metadata: Metadata,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    family: ModelFamily,
    args: Any,
    key: str,
    group: dist.ProcessGroup | None = None,
) -> TorchtitanState:
    """Fill `model` (and `optimizer`'s AdamW state, when given) from torchtitan's checkpoint at `path`, on any
    layout: DCP reshards what torchtitan saved on any number of ranks. A collective of `group`. The caller has
    checked that the checkpoint holds the model's weights (checkpoint.check_holds)."""
    state = read_state(path, metadata, group=group)
    if optimizer is not None and not state.adamw:
        raise ConfigError(
            f"{key}: {path} was trained by torchtitan with Adam (weight decay added to the gradient) and this recipe "
            f"trains with AdamW, so its optimizer state does not carry over; start from its weights alone "
            f"(checkpoint.initial_load_path = {path}) or add optimizer to checkpoint.exclude_from_loading"
        )
    weights = get_model_state_dict(model)
    _refuse_nonzero_buffers(path, metadata, zero_buffers(family, args, weights), key=key, group=group)
    # Loaded in place under torchtitan's names: `weights` and `flat` hold them under this recipe's.
    to_load: dict[str, Any] = torchtitan_named(family, weights)
    flat: dict[str, Any] = {}
    if optimizer is not None:
        flat = get_optimizer_state_dict(model, optimizer, options=FLAT)
        # The moments and step are loaded; the param_groups are compared (read_state), this run's own are kept.
        to_load["optimizer"] = torchtitan_named(family, {k: v for k, v in flat.items() if k.startswith("state.")})
    try:
        dcp.load(to_load, checkpoint_id=str(path), process_group=group, no_dist=not dist.is_initialized())
    except Exception as e:  # DCP gathers every rank's read errors into one exception on all ranks
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{key}: {path} could not be read as torchtitan's checkpoint ({first[:300]})") from None
    for name, heads in interleaved_weights(family, args, weights).items():
        weights[name] = _permuted(weights[name], heads, to_rotate_half)
        for moment in _MOMENTS if optimizer is not None else ():
            flat[f"state.{name}.{moment}"] = _permuted(flat[f"state.{name}.{moment}"], heads, to_rotate_half)
    set_model_state_dict(model, weights)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, flat, options=FLAT)
    return state


def schedule_disagreement(state: TorchtitanState, *, lr: float) -> str | None:
    """One line when this run's schedule gives step + 1 another learning rate than torchtitan's run set for it."""
    if state.next_lr is None or abs(lr - state.next_lr) <= 1e-6 * max(abs(lr), abs(state.next_lr)):
        return None
    return (
        f"resume: step {state.step + 1}'s learning rate is {lr:.6g} here and was {state.next_lr:.6g} in the torchtitan "
        "run that saved the checkpoint (lr_scheduler.* or training.steps differ from its; this run's schedule wins)"
    )


# ------------------------------------------------------------------ out


def torchtitan_state_dict(
    weights: dict[str, torch.Tensor],
    optimizer: dict[str, Any] | None,
    *,
    family: ModelFamily,
    args: Any,
    step: int,
    lr: float,
    next_lr: float,
    tokens_per_rank: int,
    loader: dict[str, Any] | None,
) -> dict[str, Any]:
    """torchtitan's checkpoint of this recipe's state at `step`: `weights` by name; `optimizer` flat, AdamW's
    "state.<name>.<k>" and one param group's "param_groups.<k>" (None: torchtitan's model-only layout); `lr`: the
    configured learning rate, `next_lr` the schedule's for step + 1; `tokens_per_rank`: tokens one data-parallel
    rank reads per step; `loader`: torchtitan's dataloader part (torchtitan_loader_state), or None."""
    rope = interleaved_weights(family, args, weights)

    def layout(name: str, t: torch.Tensor) -> torch.Tensor:
        return to_interleaved(t, rope[name]) if name in rope else t

    out: dict[str, Any] = torchtitan_named(family, {name: layout(name, t) for name, t in weights.items()})
    out |= {name: torch.zeros(shape) for name, shape in zero_buffers(family, args, weights).items()}
    if optimizer is None:
        return out
    group = {k.removeprefix("param_groups."): v for k, v in optimizer.items() if k.startswith("param_groups.")}
    flat: dict[str, Any] = {}
    for name in weights:
        for k in ("step", *_MOMENTS):
            t = optimizer[f"state.{name}.{k}"]
            flat[f"state.{name}.{k}"] = layout(name, t) if k in _MOMENTS else t
        flat |= {f"param_groups.{name}.{k}": v for k, v in group.items() if k != "params"}
        flat |= {f"param_groups.{name}.lr": next_lr, f"param_groups.{name}.initial_lr": lr}
    out["optimizer"] = torchtitan_named(family, flat)
    # torch's LambdaLR after `step` scheduler steps, as torchtitan's LRSchedulersContainer saves its first one.
    out["lr_scheduler"] = {"base_lrs": [lr], "last_epoch": step, "_step_count": step + 1, "_is_initial": False,
                           "_get_lr_called_within_step": False, "_last_lr": [next_lr]}  # fmt: skip
    out["train_state"] = {"step": step, "ntokens_seen": step * tokens_per_rank}
    if loader is not None:
        out["dataloader"] = loader
    return out


def torchtitan_loader_state(doc_ends: np.ndarray, read: Callable[[int, int], np.ndarray], *, samples: int,
                            window: int, dp: int, batch_size: int) -> dict[str, Any]:  # fmt: skip
    """torchtitan's dataloader part after `samples` windows of `window` tokens, split over `dp` data-parallel ranks
    in batches of `batch_size` windows per rank, over the documents that end at `doc_ends` of the token stream
    `read(start, length)` reads.

    Rank r reads the contiguous slice of the documents datasets' shard(contiguous=True) gives it, as one stream
    that starts again at its end; after w windows it has read the documents up to the one holding its token
    w * window - 1, and keeps that document's remaining tokens in its buffer."""
    n = len(doc_ends)
    per_rank = samples // dp
    state: dict[str, Any] = {"world_size": dp}
    for rank in range(dp):
        div, mod = divmod(n, dp)
        first = div * rank + min(rank, mod)
        last = first + div + (1 if rank < mod else 0)  # documents [first, last)
        begin = int(doc_ends[first - 1]) if first else 0
        ends = doc_ends[first:last].astype(np.int64) - begin  # each document's end within the rank's stream
        consumed = (per_rank * window) % int(ends[-1])
        if consumed == 0:
            read_docs, buffer = 0, []
        else:
            j = int(np.searchsorted(ends, consumed, side="left"))
            read_docs, buffer = j + 1, read(begin + consumed, int(ends[j]) - consumed).tolist()
        batches = per_rank // batch_size
        loader = {
            "_index_sampler_state": None, "_sampler_iter_state": {"samples_yielded": per_rank},
            "_sampler_iter_yielded": batches, "_num_yielded": batches, "_IterableDataset_len_called": None,
            "_shared_seed": None, "fetcher_state": {"dataset_iter_state": None, "fetcher_ended": False},
            "dataset_state": {"token_buffer": buffer, "sample_idx": read_docs}, "_iterator_finished": False,
        }  # fmt: skip
        state[f"dp_rank_{rank}"] = pickle.dumps(loader)
    return state
