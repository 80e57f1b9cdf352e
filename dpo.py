"""Direct preference optimization ([dpo] enable = true): the loss, the reference model's log-probabilities, and the
check that the two agree at step 1, as Llama 3's chat models were aligned after each round of SFT.

A pair (data/preference.py) is a prompt, the chosen reply and the rejected one. DPO raises the policy's
log-probability of the chosen reply relative to a frozen reference model and lowers the rejected one's: with
the log-ratios r_c = log pi(chosen) - log ref(chosen) and r_r likewise, and delta = r_c - r_r, TRL's losses
(DPOTrainer's names and forms, which tests/test_dpo.py checks it against on the same pairs):

    sigmoid   -logsigmoid(beta delta)                                                (DPO)
    robust    (-logsigmoid(beta delta) (1 - ls) + logsigmoid(-beta delta) ls) / (1 - 2 ls)   (ls: dpo.label_smoothing)
    hinge     relu(1 - beta delta)
    ipo       (delta' - 1 / (2 beta))^2, delta' of the log-ratios averaged per reply token
    sft       the chosen replies' NLL, the mean over their tokens: Llama 3's NLL term (weight 0.2)

each weighted by dpo.loss_weights and averaged over the pairs of the global batch (sft: over the chosen tokens of
the global batch), however the ranks and micro-batches split it. (TRL averages each micro-batch and then the
micro-batches, so with gradient accumulation its step weighs a short micro-batch's pairs and tokens more; with one
micro-batch a step the two agree.) A sequence's log-probability is the sum over its
reply's counted tokens (TRL's convention), computed in chunks on vocabulary shards (loss.py `document_logprobs`),
never from the whole logits. The metrics are TRL's: rewards/chosen and rewards/rejected (beta x the log-ratios),
rewards/accuracies (the share of pairs whose chosen reward is the larger), rewards/margins, logps/chosen and
logps/rejected, means over the global batch's pairs; `loss` is the weighted sum.

The reference (dpo.reference = "precomputed"): before step 1 the initial weights score every pair once, in the
run's own layout, and the log-probabilities are written beside the prepared data (reference/<key>.npy with its
sha256 and what computed it), keyed on the data, the initial weights and the tokens counted; a rerun or a resumed
run reads them, so training holds one model. At step 1 the policy is the reference, so every reward is 0 and the
sigmoid loss is ln 2: `ReferenceCheck` stops the run in one line where they differ (another dtype, layout or padding
than the reference was computed with), naming what differs.

Or live (dpo.reference = "live", TRL's default): a second model, built and sharded as the policy is, frozen, in eval
mode, holding the initial weights, scores each micro-batch before the policy does: no table, one more forward a
micro-batch and the weights once more in memory.

Not yet: context and pipeline parallel (both refused in one line).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from config import Dpo
from data.preference import Pairs
from errors import ConfigError, is_rank0
from loss import AUTO_CHUNK_TOKENS, Loss, LossTerms, document_logprobs

if TYPE_CHECKING:
    from config import JobConfig
    from data.loader import GlobalBatchLoader
    from forward import ForwardBackward
    from parallelisms.parallel_dims import ParallelDims

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
GAP_PER_TOKEN = 1e-3  # nats per reply token between policy and reference at step 1 above which the run stops


class PreferenceLoss:
    """The DPO loss of a micro-batch of packed pairs: `loss(model, h, labels, segments=..., pairs=...)` returns the sum
    over its pairs of the weighted losses (module docstring) as LossTerms, with TRL's metrics as extras, each summed
    over the pairs; train.py divides by the global batch's pairs per data-parallel rank (data/loader.py)."""

    def __init__(self, settings: Dpo, *, chunk_tokens: int = AUTO_CHUNK_TOKENS, vocab_shards: int = 1):
        self.settings = settings
        self.weights = settings.loss_weights or [1.0] * len(settings.loss_type)
        self.chunk_tokens = chunk_tokens if chunk_tokens > 0 else AUTO_CHUNK_TOKENS
        self.vocab_shards = vocab_shards
        self.reference: torch.Tensor | None = None  # precomputed: (pairs of the corpus, 2) fp32, [chosen, rejected]
        self.live: torch.nn.Module | None = None  # or the live reference model, frozen, sharded like the policy
        # What makes `live` the reference while it scores: nothing for a second model; for a policy with adapters
        # (lora.py), the adapters off.
        self.as_reference: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.gap: torch.Tensor | None = None  # watching: the largest policy - reference gap per reply token so far

    @property
    def extras(self) -> tuple[str, ...]:
        return METRICS

    def cross_entropy_only(self) -> Loss:
        """What validation scores during DPO: the plain cross-entropy of the held-out data."""
        return Loss(self.chunk_tokens, vocab_shards=self.vocab_shards)

    def given(self, batch: Any, inputs: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor) -> dict[str, Any]:
        """The micro-batch's segments and its pairs with their reference log-probabilities (`placed`), before the
        policy's forward (forward.py)."""
        return {"segments": segments, "pairs": self.placed(batch.pairs, inputs, labels, segments)}

    def placed(self, pairs: Pairs, inputs: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor) -> Pairs:
        """A micro-batch's pairs on the device with their reference log-probabilities (forward.py calls it before the
        policy's forward, in its layout: `given`): the precomputed table's rows, or the live reference's forward, no autograd."""
        ids = pairs.ids.to(labels.device)
        if self.live is None:
            assert self.reference is not None, (
                "the reference log-probabilities are set before step 1 (prepare_reference)"
            )
            return pairs._replace(ids=ids, reference=self.reference[ids.clamp(min=0)])
        documents = 2 * ids.shape[1]
        head = functools.partial(
            document_logprobs, self.live, labels=labels, segments=segments, documents=documents,
            chunk_tokens=self.chunk_tokens,
        )  # fmt: skip
        with torch.no_grad(), self.as_reference():
            scores = self.live(inputs, segments=segments, head=head)
        return pairs._replace(ids=ids, reference=scores.view(-1, ids.shape[1], 2))

    def __call__(
        self, model: torch.nn.Module, h: torch.Tensor, labels: torch.Tensor, *, segments: torch.Tensor, pairs: Pairs
    ) -> LossTerms:
        ids, reference = pairs.ids, pairs.reference
        per_row = ids.shape[1]
        logps = document_logprobs(
            model, h, labels, segments, documents=2 * per_row, chunk_tokens=self.chunk_tokens
        ).view(-1, per_row, 2)
        tokens = reply_tokens(labels, segments, documents=2 * per_row).view(-1, per_row, 2)
        valid = ids >= 0
        if self.gap is not None:  # the first step's largest gap per reply token (ReferenceCheck)
            gap = torch.where(valid[..., None], (logps.detach() - reference).abs() / tokens.clamp(min=1), 0.0)
            self.gap = torch.maximum(self.gap, gap.max())
        ratios = logps - reference
        delta = ratios[..., 0] - ratios[..., 1]
        total = torch.zeros((), device=h.device)
        for kind, weight in zip(self.settings.loss_type, self.weights, strict=True):
            if kind == "sft":  # the mean over the global batch's chosen tokens: their sum x pairs / chosen tokens
                per_pair = -logps[..., 0] / pairs.chosen_tokens_per_pair
            else:
                per_pair = self._pair_loss(kind, delta, ratios, tokens)
            total = total + weight * torch.where(valid, per_pair, 0.0).sum()
        rewards = self.settings.beta * ratios.detach()
        chosen, rejected = rewards[..., 0], rewards[..., 1]
        values = (chosen, rejected, (chosen > rejected).float(), chosen - rejected, *logps.detach().unbind(-1))
        sums = {name: torch.where(valid, v, 0.0).sum() for name, v in zip(METRICS, values, strict=True)}
        return LossTerms(total, total.detach(), sums)

    def _pair_loss(self, kind: str, delta: torch.Tensor, ratios: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        beta, ls = self.settings.beta, self.settings.label_smoothing
        if kind == "sigmoid":
            return -F.logsigmoid(beta * delta)
        if kind == "robust":
            return (-F.logsigmoid(beta * delta) * (1 - ls) + F.logsigmoid(-beta * delta) * ls) / (1 - 2 * ls)
        if kind == "hinge":
            return torch.relu(1 - beta * delta)
        assert kind == "ipo", kind
        averaged = ratios / tokens.clamp(min=1)
        return (averaged[..., 0] - averaged[..., 1] - 1 / (2 * beta)) ** 2


def reply_tokens(labels: torch.Tensor, segments: torch.Tensor, *, documents: int) -> torch.Tensor:
    """Per row, the counted labels of each of its first `documents` documents: (bs, documents) fp32 (no host sync)."""
    rows = labels.shape[0]
    counted = ((labels != -100) & (segments < documents)).flatten()
    slot = (torch.arange(rows, device=labels.device)[:, None] * documents + segments.long()).flatten()
    out = torch.zeros(rows * documents + 1, device=labels.device)
    out.index_add_(0, torch.where(counted, slot, rows * documents), counted.float())
    return out[:-1].view(rows, documents)


def build_loss(settings: Dpo, *, chunk_tokens: int, vocab_shards: int) -> PreferenceLoss:
    """The DPO loss of `[dpo]`, on logits whose vocabulary is split over `vocab_shards` ranks (loss parallel)."""
    return PreferenceLoss(settings, chunk_tokens=chunk_tokens, vocab_shards=vocab_shards)


# ------------------------------------------------------------------ the reference


def reference_identity(cfg: JobConfig, loader: GlobalBatchLoader, *, adapters: str | None = None) -> dict[str, Any]:
    """What the reference's log-probabilities depend on: the pairs' tokens, the tokens counted, the initial weights
    (and the adapter folder a policy with adapters started from, lora.py)."""
    ck = cfg.checkpoint
    weights = ck.initial_load_path or (cfg.model.hf_assets_path if ck.initial_load_in_hf else None)
    started = {"adapters": _folder_identity(adapters)} if adapters else {}
    return started | {
        "data": loader.corpus.fingerprint,
        "window": loader.window,
        "count_format_tokens": loader.count_format_tokens,
        "weights": _folder_identity(weights) if weights else {"random_init_seed": cfg.debug.seed},
        "model": f"{cfg.model.name}/{cfg.model.flavor}",
    }


def how_computed(cfg: JobConfig, dims: ParallelDims) -> dict[str, Any]:
    """What may change a reference's values without changing what it is: the dtype, the layout, the padding."""
    return {
        "mixed_precision_param": cfg.training.mixed_precision_param,
        "layout": dims.describe(),
        "pad_samples": cfg.data.pad_samples,
        "attn_mask_type": cfg.model.attn_mask_type,
    }


def _folder_identity(path: str) -> dict[str, Any]:
    """A weights folder by its files' names, sizes and modification times (hashing gigabytes at every start would
    cost minutes; a rewritten folder has new times)."""
    folder = Path(path)
    files = sorted(f for f in folder.rglob("*") if f.is_file())
    return {"path": str(folder.resolve()), "files": [[str(f.relative_to(folder)), f.stat().st_size,
                                                      f.stat().st_mtime_ns] for f in files]}  # fmt: skip


def prepare_reference(
    cfg: JobConfig,
    loss_fn: PreferenceLoss,
    forward: ForwardBackward,
    loader: GlobalBatchLoader,
    *,
    dims: ParallelDims,
    start_step: int,
    build_reference: Callable[[], torch.nn.Module],
) -> None:
    """dpo.reference = "precomputed": the reference's log-probabilities of every pair, read from beside the prepared
    data, or computed there now with the initial weights (a fresh run only: a resumed policy is no longer the
    reference); rank 0 reads and writes the files and hands the others the table, so that nodes need not share the
    folder. "live": the reference model, built by `build_reference` (as the policy is) and loaded with the initial
    weights. `loss_fn` holds either, and watches the gap at step 1 of a fresh run.

    A live reference of a policy with adapters (lora.py: `as_reference`) is the policy as it started, as TRL's is: the
    adapters off, or at their starting values; no second model."""
    policy = forward.model
    watch = not start_step
    if cfg.dpo.reference == "live":
        if (as_reference := getattr(policy, "as_reference", None)) is not None:
            loss_fn.live, loss_fn.as_reference, kind = policy, as_reference, "the policy as it started, its adapters'"
        else:
            loss_fn.live = live_reference(cfg, policy, build=build_reference, start_step=start_step)
            kind = "a frozen copy of the initial weights, sharded like the policy"
        if is_rank0():
            print(
                f"dpo: reference live ({kind}), beta {cfg.dpo.beta}, losses {', '.join(cfg.dpo.loss_type)}", flush=True
            )
        loss_fn.computed_with = how_computed(cfg, dims)
        if watch:
            loss_fn.gap = torch.zeros((), device=forward.device)
        return
    identity = reference_identity(cfg, loader, adapters=getattr(policy, "adapters_from", None))
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    table = Path(loader.corpus.folder) / "reference" / f"{key}.npy"
    found = _on_rank0(lambda: read_reference(table) if table.is_file() else None)
    if found is None:
        if start_step:
            raise ConfigError(
                f"dpo.reference: {table} (the reference's log-probabilities this run started from) is missing, and a "
                "resumed policy is no longer the reference; restore that file, or start the run over in another "
                "job.dump_folder"
            )
        begin = time.perf_counter()
        found = score_pairs(forward, loader, parts=table.with_suffix(".parts")), {"computed": how_computed(cfg, dims)}
        if is_rank0():
            write_reference(table, found[0], identity=identity, computed=found[1]["computed"])
            shutil.rmtree(table.with_suffix(".parts"), ignore_errors=True)
            print(
                f"dpo: reference log-probabilities of {len(loader.chat[0].kept):,} pairs computed with the initial "
                f"weights in {time.perf_counter() - begin:.1f} s -> {table}",
                flush=True,
            )
    values, meta = found
    loss_fn.reference = torch.from_numpy(values).to(forward.device)
    loss_fn.computed_with = meta["computed"]
    if is_rank0():
        print(f"dpo: reference precomputed ({table}), beta {cfg.dpo.beta}, losses {', '.join(cfg.dpo.loss_type)}")
    if watch:
        loss_fn.gap = torch.zeros((), device=forward.device)


def live_reference(
    cfg: JobConfig, policy: torch.nn.Module, *, build: Callable[[], torch.nn.Module], start_step: int
) -> torch.nn.Module:
    """The live reference: a second model sharded like the policy, in eval mode, frozen (no gradient, so no optimizer
    state; not in checkpoints). A fresh run copies the policy's initial weights shard for shard; a resumed one reads
    checkpoint.initial_load_path (or model.hf_assets_path) again: a random init has nothing to read."""
    ck = cfg.checkpoint
    if start_step and ck.initial_load_path is None and not (ck.initial_load_in_hf and cfg.model.hf_assets_path):
        raise ConfigError(
            'dpo.reference: "live" resumes from the initial weights, and this run started from a random init; set '
            'checkpoint.initial_load_path, or use dpo.reference = "precomputed"'
        )
    reference = build().eval().requires_grad_(False)
    if start_step:
        from checkpoint import CheckpointManager, ModelInterop

        # The run's own folder holds the policy's checkpoints: only the initial weights are read.
        CheckpointManager(
            ck, dump_folder=cfg.job.dump_folder, model=reference, optimizer=None, stateful={},
            interop=ModelInterop.from_config(cfg.model),
        ).load_initial()  # fmt: skip
    else:
        reference.load_state_dict(policy.state_dict())
    return reference


def _on_rank0(read: Callable[[], Any]) -> Any:
    """What `read` returns on rank 0, on every rank; its ConfigError raised on every rank alike."""
    out: list[Any] = [None]
    if is_rank0():
        try:
            out[0] = ("ok", read())
        except ConfigError as e:
            out[0] = ("error", e)
    dist.broadcast_object_list(out, src=0)
    kind, value = out[0]
    if kind == "error":
        raise value
    return value


BLOCK_ROUNDS = 64  # rounds of forwards per saved part of the reference pass: the most a restart scores again


def score_pairs(forward: ForwardBackward, loader: GlobalBatchLoader, *, parts: Path) -> np.ndarray:
    """Every pair's summed log-probabilities [chosen, rejected] under the model as it is, (pairs, 2) float32 on every
    rank (nan for a pair dropped for its length): the windows split over the data-parallel ranks, local_batch_size at
    a time, every rank running the same number of forwards. Each BLOCK_ROUNDS rounds rank 0 writes a part into
    `parts`; a pass stopped and started again scores only the blocks it has no part of."""
    windows = loader.chat[0]
    per_round = loader.local_batch_size * loader.dp_degree
    rounds = -(-windows.count // per_round)
    done = _on_rank0(lambda: {int(f.stem.split("-")[1]): np.load(f) for f in parts.glob("part-*.npy")})
    table = np.full((windows.pairs, 2), np.nan, dtype=np.float32)
    for values in done.values():
        table[values[:, 0].astype(np.int64)] = values[:, 1:]
    if done and is_rank0():
        blocks = -(-rounds // BLOCK_ROUNDS)
        print(f"dpo: the reference pass resumes: {len(done)} of its {blocks} blocks are in {parts}", flush=True)
    with forward.scoring():
        for block in range(0, rounds, BLOCK_ROUNDS):
            if block in done:
                continue
            found = []
            for round_ in range(block, min(block + BLOCK_ROUNDS, rounds)):
                first = round_ * per_round + loader.dp_rank * loader.local_batch_size
                mine = [j for j in range(first, first + loader.local_batch_size) if j < windows.count]
                batch = loader.batch([loader.sample_window(j) for j in (mine or [0])], 1.0)
                scores = forward.score_documents(batch, documents=2 * batch.pairs.ids.shape[1]).cpu()
                ids, scores = batch.pairs.ids, scores.view(len(batch.inputs), -1, 2)
                if mine:
                    found.append(torch.cat([ids[ids >= 0, None].double(), scores[ids >= 0].double()], dim=1))
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, torch.cat(found).numpy() if found else np.zeros((0, 3)))
            part = np.concatenate(gathered)
            table[part[:, 0].astype(np.int64)] = part[:, 1:]
            if is_rank0():
                parts.mkdir(parents=True, exist_ok=True)
                tmp = parts / f"part-{block:08d}.tmp-{os.getpid()}"
                with open(tmp, "wb") as f:
                    np.save(f, part)
                os.replace(tmp, parts / f"part-{block:08d}.npy")
    return table


def write_reference(table: Path, values: np.ndarray, *, identity: dict[str, Any], computed: dict[str, Any]) -> None:
    """The table and its record (sha256, identity, how computed), each written whole or not at all."""
    table.parent.mkdir(parents=True, exist_ok=True)
    tmp = table.parent / f"{table.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, values)
    digest = hashlib.sha256(values.tobytes()).hexdigest()
    record = {"sha256": digest, "identity": identity, "computed": computed, "pairs": len(values)}
    meta = table.with_suffix(".json")
    meta_tmp = table.parent / f"{meta.name}.tmp-{os.getpid()}"
    meta_tmp.write_text(json.dumps(record, indent=1))
    os.replace(meta_tmp, meta)
    os.replace(tmp, table)  # last: the table's presence means complete


def read_reference(table: Path) -> tuple[np.ndarray, dict[str, Any]]:
    """The table and its record, refused in one line where its checksum does not match."""
    meta = json.loads(table.with_suffix(".json").read_text())
    values = np.load(table)
    if hashlib.sha256(values.tobytes()).hexdigest() != meta["sha256"]:
        raise ConfigError(
            f"dpo.reference: {table} does not match its checksum in {table.with_suffix('.json').name}; delete both "
            "and start the run again from its initial weights to compute them anew"
        )
    return values, meta


@dataclass
class ReferenceCheck:
    """After step 1 of a fresh run: the policy is the reference, so every reward is 0 and the sigmoid loss ln 2. A
    gap larger than GAP_PER_TOKEN nats per reply token on any rank stops the run in one line, naming what the run
    does differently from the reference's computation."""

    loss_fn: PreferenceLoss
    now: dict[str, Any]  # how_computed of this run
    group: Any = None  # the collective's group (gloo's under NCCL)

    def __call__(self, step: int, result: Any) -> bool:
        if self.loss_fn.gap is None:
            return False
        gap = self.loss_fn.gap.detach().float().cpu()
        self.loss_fn.gap = None
        if dist.is_initialized():
            dist.all_reduce(gap, op=dist.ReduceOp.MAX, group=self.group)
        if float(gap) <= GAP_PER_TOKEN:
            return False
        then = getattr(self.loss_fn, "computed_with", {})
        differs = [f"{k} {then[k]} then, {v} now" for k, v in self.now.items() if k in then and then[k] != v]
        why = "; ".join(differs) or "the same dtype, layout and padding: dropout on, or another model"
        raise ConfigError(
            f"dpo.reference: at step 1 the policy's log-probabilities differ from the reference's by up to "
            f"{float(gap):.3g} nats per reply token (the rewards should be 0, the sigmoid loss ln 2 = {math.log(2):.4f}): "
            f"{why}; compute the reference as the run trains (delete it beside the prepared data to compute it anew)"
        )
