"""The loss: next-token cross-entropy in fp32, computed from the final hidden states.

The model hands its final norm's output to the loss instead of projecting it (`ForwardBackward` calls
`model(inputs, segments=segments, head=functools.partial(loss, model, labels=labels))`); the loss applies
the output projection (`model.project`) itself, because the projection is where the memory goes. A plain loss
materialises the logits of the whole micro-batch (tokens x vocab) and cross-entropy upcasts them to
fp32: at 8B with local batch 2 x seq 8192 and a 128,256-token vocabulary that is 3.9 GiB of bf16
logits plus a 7.8 GiB fp32 log-softmax kept for backward, and backward's temporaries about as much
again, the largest single item after the blocks' activations.

The chunked loss projects and scores `chunk` tokens at a time, each chunk under activation
checkpointing: forward keeps only each chunk's summed loss; backward recomputes one chunk's logits at a
time. The peak holds one chunk's logits instead of all of them; the price is the output projection's
forward run twice (at 8B about 2% of a step's FLOPs) and each chunk's kernels. Summing chunk sums in
another order than one mean is the only difference: fp32 rounding (1e-6 relative, loss and gradients:
tests/test_loss.py in one process, tests/test_parallelisms.py with and without loss parallel).

When to chunk (`chunk_tokens_for`, training.loss_chunk_tokens): by default (-1) only where the
micro-batch's logits are large enough to matter, more than AUTO_CHUNK_FROM_BYTES (256 MiB) of fp32
logits on a rank (tokens x its share of the vocabulary x 4 bytes), then AUTO_CHUNK_TOKENS (2,048) at a
time. Below that the whole loss's buffers (about 3 fp32 copies of the logits, measured by make bench's
loss row) stay under 0.75 GiB, and chunks would only add kernels: torchtitan's debug model on one GPU
(16,384 tokens x 2,048 entries, 128 MiB) is scored whole, Llama 3's vocabulary at 2 x 8,192 tokens (7.8
GiB) in 8 chunks. N > 0 chunks N tokens at a time wherever a micro-batch has more; 0 never chunks.

Labels of IGNORE_INDEX (data/chat.py: the prompts of chat data) count for nothing: every loss here
is summed over the counted labels and divided by the label positions, so train.py's per-step
divisor (data/loader.py `Batch.loss_divisor`) makes the step's loss the mean over the counted
labels of the whole global batch, however they fall on ranks and micro-batches (torchtitan 0.2.2
normalises by the global count of non-ignored tokens too).

z-loss (training.z_loss_weight > 0; PaLM, OLMo) adds weight x mean(logsumexp(logits)^2), which keeps
the softmax normaliser near 1 (its log near 0) and the logits from drifting: it is computed on the same
chunks, from the same fp32 logits, and returned on its own (`LossTerms.extras["z_loss"]`), so the logged loss stays
the cross-entropy, the number a run without z-loss logs. Validation scores the cross-entropy alone.

Under TP with loss parallel the projection's output is a vocabulary-sharded DTensor and both the
loss and its backward must run under `parallelisms.tp.loss_parallel_context`; the chunks need
nothing more. Under FSDP the projection's parameters are gathered once per step and their
gradient reduce-scattered once, however many chunks (tests/test_parallelisms.py counts the collectives).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from config import Compile
from distributed import full_tensor

Summed = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # summed_losses or its torch.compile


def summed_losses(logits: torch.Tensor, labels: torch.Tensor, *, z: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cross-entropy of `logits` (..., vocab) against `labels` (...) summed over the counted labels (labels of
    IGNORE_INDEX count for nothing: chat data, data/chat.py), and with `z` the summed logsumexp(logits)^2 (the
    z-loss), else None; both from one fp32 copy of the logits, whatever the compute dtype."""
    logits = logits.flatten(0, -2).float()
    ce = F.cross_entropy(logits, labels.flatten(), reduction="sum")
    return ce, torch.logsumexp(logits, dim=-1).square().sum() if z else None


class LossTerms(NamedTuple):
    """What a loss computed, each term summed over the counted labels and divided by the label positions.

    `total` is what backward runs on: the cross-entropy plus each extra term times its weight. For the metrics,
    detached: the cross-entropy, and each extra term unweighted by the name it is logged under (`z_loss`), so that
    a run logs the same loss with or without them. A NamedTuple, so that FSDP's hooks on a model's output (the
    loss is computed inside the forward) find the tensor in it."""

    total: torch.Tensor
    cross_entropy: torch.Tensor
    extras: dict[str, torch.Tensor]

    def divided(self, divisor: float) -> LossTerms:
        """Every term over `divisor` (a micro-batch's share of its step)."""
        extras = {name: value / divisor for name, value in self.extras.items()}
        return LossTerms(self.total / divisor, self.cross_entropy / divisor, extras)

    def detached(self) -> LossTerms:
        """These terms after backward: what a step adds up and logs."""
        return self._replace(total=self.total.detach())

    def plus(self, other: LossTerms) -> LossTerms:
        """Term by term: a step's terms over its micro-batches (train.py's train_step)."""
        extras = {name: value + other.extras[name] for name, value in self.extras.items()}
        return LossTerms(self.total + other.total, self.cross_entropy + other.cross_entropy, extras)

    @staticmethod
    def zeros(names: tuple[str, ...], *, device: torch.device) -> LossTerms:
        """Nothing scored (pipeline stages before the last), with the extra terms `names` of the loss."""
        zero = torch.zeros((), device=device)
        return LossTerms(zero, zero, dict.fromkeys(names, zero))


AUTO_CHUNK_FROM_BYTES = 256 * 2**20  # fp32 logits per rank above which the default chunks (module docstring)
AUTO_CHUNK_TOKENS = 2048


def chunk_tokens_for(setting: int, *, tokens: int, vocab: int) -> int:
    """The chunk size for a micro-batch of `tokens` tokens scored over `vocab` vocabulary entries on this rank
    (its shard under loss parallel), under training.loss_chunk_tokens = `setting`; 0 = the whole micro-batch at
    once. -1: AUTO_CHUNK_TOKENS where its fp32 logits exceed AUTO_CHUNK_FROM_BYTES (module docstring)."""
    if setting == -1:
        setting = AUTO_CHUNK_TOKENS if 4 * tokens * vocab > AUTO_CHUNK_FROM_BYTES else 0
    return setting if 0 < setting < tokens else 0


@dataclass(frozen=True)
class Loss:
    """The training loss: `loss(model, h, labels)` projects the final norm's output `h` (bs, seqlen, dim)
    with `model.project` and returns the cross-entropy against `labels` (bs, seqlen) summed over the counted
    labels and divided by the label positions (the mean when every label counts; a micro-batch with no counted
    label gives 0, not 0 / 0), plus z_loss_weight x the z-loss likewise divided when the weight is > 0: LossTerms,
    with the terms apart for the metrics."""

    chunk_tokens: int = 0  # training.loss_chunk_tokens (chunk_tokens_for); 0 = the whole micro-batch at once
    _: KW_ONLY
    z_loss_weight: float = 0.0  # training.z_loss_weight
    vocab_shards: int = 1  # ranks the logits' vocabulary is split over: the TP degree under loss parallel
    summed: Summed = summed_losses  # or its torch.compile (build_loss_fn)

    def __call__(self, model: torch.nn.Module, h: torch.Tensor, labels: torch.Tensor) -> LossTerms:
        vocab = model.args.vocab_size // self.vocab_shards
        chunk = chunk_tokens_for(self.chunk_tokens, tokens=labels.numel(), vocab=vocab)  # 0: the whole micro-batch
        ce, z = chunked_sums(model.project, h, labels, chunk_tokens=chunk, z=bool(self.extras), summed=self.summed)
        if z is None:
            ce = ce / labels.numel()
            return LossTerms(ce, ce.detach(), {})
        ce, z = ce / labels.numel(), z / labels.numel()
        return LossTerms(ce + self.z_loss_weight * z, ce.detach(), {"z_loss": z.detach()})

    def given(self, batch: Any, inputs: torch.Tensor, labels: torch.Tensor, segments: Any) -> dict[str, Any]:
        """What this loss takes besides the final hidden states and the labels, computed from the micro-batch before
        the model's forward (forward.py): nothing here; DPO's reference log-probabilities (dpo.py), a teacher's hidden
        states (distill.py)."""
        return {}

    @property
    def extras(self) -> tuple[str, ...]:
        """The names of the extra terms this loss returns (LossTerms.extras): every rank logs them."""
        return ("z_loss",) if self.z_loss_weight > 0 else ()

    def cross_entropy_only(self) -> Loss:
        """This loss without its z-loss: what validation scores."""
        return replace(self, z_loss_weight=0.0)


def build_loss_fn(
    compile: Compile, *, chunk_tokens: int = 0, z_loss_weight: float = 0.0, vocab_shards: int = 1
) -> Loss:
    """The loss of training.loss_chunk_tokens and training.z_loss_weight, on logits whose vocabulary is split over
    `vocab_shards` ranks (loss parallel); `summed_losses` is compiled when compile.components has "loss" (inductor
    fuses the fp32 upcast into the log-softmax instead of materialising an fp32 copy of the logits)."""
    summed = summed_losses
    if compile.enable and "loss" in compile.components:
        summed = torch.compile(summed_losses, backend=compile.backend)
    return Loss(chunk_tokens, z_loss_weight=z_loss_weight, vocab_shards=vocab_shards, summed=summed)


def chunked_sums(
    project: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
    z: bool = False,
    summed: Summed = summed_losses,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """summed(project(h), labels, z=z), `chunk_tokens` tokens at a time, each chunk under activation
    checkpointing so that forward and backward never hold more than one chunk's logits; 0, or at least all
    the tokens: one chunk, not recomputed. Plain tensors, also where the logits are DTensors (loss parallel)."""
    whole = chunk_tokens <= 0 or labels.numel() <= chunk_tokens
    if whole and not z:
        # h as it comes: under sequence parallel the projection's TP plan gathers it and reduce-scatters its
        # gradient. Compiled, these (bs, seqlen) logits and the flattened ones below round differently in the
        # last bit; the cross-entropy alone has always been scored on these, with the z-loss on those.
        return full_tensor(summed(project(h), labels, z=False)[0]), None
    if isinstance(h, DTensor):
        # Sequence parallel leaves the final norm's output sharded over the sequence; the projection
        # would gather it anyway. Gather it once here, then split the gathered tokens.
        h = h.redistribute(placements=[Replicate()] * h.device_mesh.ndim)
    tokens, labels = h.flatten(0, 1), labels.flatten()
    if whole:
        sums = [summed(project(tokens), labels, z=z)]
    else:
        chunks = zip(tokens.split(chunk_tokens), labels.split(chunk_tokens), strict=True)
        sums = [checkpoint(_project_and_sum, project, summed, z, *chunk, use_reentrant=False) for chunk in chunks]
    return sum(full_tensor(ce) for ce, _ in sums), sum(full_tensor(z_sum) for _, z_sum in sums) if z else None


def _project_and_sum(
    project: Callable[[torch.Tensor], torch.Tensor],
    summed: Summed,
    z: bool,
    h_chunk: torch.Tensor,
    labels_chunk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return summed(project(h_chunk), labels_chunk, z=z)


def target_logprobs(
    model: torch.nn.Module,
    h: torch.Tensor,
    targets: torch.Tensor,
    counted: torch.Tensor,
    *,
    chunk_tokens: int = AUTO_CHUNK_TOKENS,
) -> torch.Tensor:
    """Scoring a continuation (lm-eval's loglikelihood, downstream.py): per row of `targets` (bs, seqlen), the fp32
    log-probabilities of its tokens at the `counted` positions (bs, seqlen, bool) summed, and how many of them are not
    the most likely token, as a (bs, 2) tensor [summed log-probability, tokens missed by greedy decoding].

    Only the counted positions are projected (a multiple-choice continuation is a few tokens of a long context),
    `chunk_tokens` at a time, so a vocabulary of 128K entries never materialises more than one chunk's logits. Under
    loss parallel the log-softmax, the target's entry and the maximum are computed on the vocabulary shards (one
    all-reduce each; `loss_parallel_context` is the caller's), and a token counts as greedy when its log-probability is
    the maximum, where one process compares argmax with it: the two differ on an exact tie only."""
    mesh = h.device_mesh if isinstance(h, DTensor) else None
    if mesh is not None:  # sequence parallel: the final norm's output gathered once, as in chunked_sums
        h = h.redistribute(placements=[Replicate()] * mesh.ndim).to_local()
    rows, positions = counted.nonzero(as_tuple=True)
    picked, wanted = h[rows, positions], targets[rows, positions]
    logprob = torch.zeros(len(rows), device=h.device)
    missed = torch.zeros(len(rows), device=h.device)
    for start in range(0, len(rows), chunk_tokens):
        part, target = picked[start : start + chunk_tokens], wanted[start : start + chunk_tokens]
        if mesh is not None:  # the projection's TP plan takes the DTensor it was given
            part = DTensor.from_local(part, mesh, [Replicate()] * mesh.ndim)
        lp = F.log_softmax(model.project(part).float(), dim=-1)
        if isinstance(lp, DTensor):  # loss parallel: (tokens, vocab / tp) on each rank
            target_lp = full_tensor(-F.nll_loss(lp, target, reduction="none"))
            is_greedy = target_lp >= full_tensor(lp.amax(dim=-1))
        else:
            target_lp = lp.gather(-1, target[:, None])[:, 0]
            is_greedy = lp.argmax(dim=-1) == target
        logprob[start : start + len(target)] = target_lp
        missed[start : start + len(target)] = (~is_greedy).float()
    out = torch.zeros(targets.shape[0], 2, device=h.device)
    out[:, 0].index_add_(0, rows, logprob)
    out[:, 1].index_add_(0, rows, missed)
    return out


def document_logprobs(
    model: torch.nn.Module,
    h: torch.Tensor,
    labels: torch.Tensor,
    segments: torch.Tensor,
    *,
    documents: int,
    chunk_tokens: int = AUTO_CHUNK_TOKENS,
) -> torch.Tensor:
    """Scoring whole sequences (a preference pair's replies, dpo.py): per row of `labels` (bs, seqlen), the fp32
    log-probabilities of its counted labels (not IGNORE_INDEX) summed over each of its first `documents` documents
    (`segments`, the document of each position), as a (bs, documents) tensor, differentiable.

    The tokens are projected `chunk_tokens` at a time, each chunk under activation checkpointing as the chunked
    cross-entropy's are (`chunked_sums`): forward and backward hold one chunk's logits, never the whole micro-batch's.
    Every position is projected and the uncounted ones weighted 0, as the cross-entropy does, so that nothing depends
    on how many count: no host sync. Under loss parallel the log-softmax and the label's entry are computed on the
    vocabulary shards, as `target_logprobs` does (`loss_parallel_context` is the caller's)."""
    rows, seqlen = labels.shape
    mesh = h.device_mesh if isinstance(h, DTensor) else None
    if mesh is not None:  # sequence parallel: the final norm's output gathered once, as in chunked_sums
        h = h.redistribute(placements=[Replicate()] * mesh.ndim).to_local()
    counted = ((labels != -100) & (segments < documents)).flatten()  # IGNORE_INDEX (data/chat.py)
    slots = rows * documents  # and one more, where the uncounted positions add their zeros
    slot = (torch.arange(rows, device=labels.device)[:, None] * documents + segments.long()).flatten()
    slot = torch.where(counted, slot, slots)
    targets = torch.where(counted, labels.flatten(), 0)
    chunks = zip(
        *(t.split(chunk_tokens) for t in (h.flatten(0, 1), targets, slot, counted.float())),
        strict=True,
    )
    sums = [checkpoint(_document_sums, model.project, mesh, slots + 1, *c, use_reentrant=False) for c in chunks]
    return sum(sums)[:slots].view(rows, documents)


def _document_sums(
    project: Callable[[torch.Tensor], torch.Tensor],
    mesh: object,
    slots: int,
    part: torch.Tensor,
    target: torch.Tensor,
    slot: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    if mesh is not None:  # the projection's TP plan takes the DTensor it was given
        part = DTensor.from_local(part, mesh, [Replicate()] * mesh.ndim)
    lp = F.log_softmax(project(part).float(), dim=-1)
    if isinstance(lp, DTensor):  # loss parallel: (tokens, vocab / tp) on each rank
        target_lp = full_tensor(-F.nll_loss(lp, target, reduction="none"))
    else:
        target_lp = lp.gather(-1, target[:, None])[:, 0]
    return torch.zeros(slots, device=target_lp.device).index_add(0, slot, target_lp * weight)
