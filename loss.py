"""The loss: next-token cross-entropy in fp32, computed from the final hidden states.

The model stops at its final norm (`model(tokens, skip_output=True)`); the loss applies the output
projection (`model.project`) itself, because the projection is where the memory goes. A plain loss
materialises the logits of the whole micro-batch (tokens x vocab) and cross-entropy upcasts them to
fp32: at 8B with local batch 2 x seq 8192 and a 128,256-token vocabulary that is 3.9 GiB of bf16
logits plus a 7.8 GiB fp32 log-softmax kept for backward, and backward's temporaries about as much
again, the largest single item after the blocks' activations.

The chunked loss projects and scores `chunk` tokens at a time, each chunk under activation
checkpointing: forward keeps only each chunk's summed loss; backward recomputes one chunk's logits at a
time. The peak holds one chunk's logits instead of all of them; the price is the output projection's
forward run twice (at 8B about 2% of a step's FLOPs) and each chunk's kernels. Summing chunk sums in
another order than one mean is the only difference: fp32 rounding (tests/test_loss.py: 1e-6 relative,
loss and gradients, with and without loss parallel).

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
chunks, from the same fp32 logits, and reported on its own (`ZLoss.take`), so the logged loss stays
the cross-entropy that runs without it log. Validation scores the cross-entropy alone.

Under TP with loss parallel the projection's output is a vocabulary-sharded DTensor and both the
loss and its backward must run under `parallelisms.tp.loss_parallel_context`; the chunks need
nothing more. Under FSDP the projection's parameters are gathered once per step and their
gradient reduce-scattered once, however many chunks (tests/test_loss.py counts the collectives).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from config import Compile


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over the counted labels and divided by the label positions, in fp32
    whatever the compute dtype: the mean when every label counts (labels of IGNORE_INDEX count for nothing:
    chat data, data/chat.py), and a micro-batch with no counted label gives 0, not 0 / 0."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum") / labels.numel()


def _summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, reduction="sum")


def _summed_cross_entropy_and_z(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and summed logsumexp(logits)^2 (the z-loss), from one fp32 copy of the logits."""
    logits = logits.float()
    return F.cross_entropy(logits, labels, reduction="sum"), torch.logsumexp(logits, dim=-1).square().sum()


class ZLoss:
    """The z-loss of the micro-batches since the last `take()`: device tensors, no host sync."""

    def __init__(self) -> None:
        self.total, self.count = None, 0

    def add(self, z: torch.Tensor) -> None:
        self.total = z if self.total is None else self.total + z
        self.count += 1

    def take(self) -> torch.Tensor | None:
        """The mean z-loss (unweighted) per micro-batch since the last take, or None when there was none."""
        mean = None if self.total is None else self.total / self.count
        self.total, self.count = None, 0
        return mean


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
    with `model.project` and returns the cross-entropy against `labels` (bs, seqlen) summed over the counted labels
    and divided by the label positions (`cross_entropy_loss`): the mean when every label counts."""

    chunk_tokens: int = 0  # training.loss_chunk_tokens (chunk_tokens_for); 0 = the whole micro-batch at once
    whole: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss
    summed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _summed_cross_entropy
    z_loss_weight: float = 0.0  # training.z_loss_weight
    summed_with_z: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = (
        _summed_cross_entropy_and_z
    )
    z_loss: ZLoss = field(default_factory=ZLoss)  # what the z-loss was, for the metrics
    vocab_shards: int = 1  # ranks the logits' vocabulary is split over: the TP degree under loss parallel

    def __call__(self, model: torch.nn.Module, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        vocab = model.args.vocab_size // self.vocab_shards
        chunk = chunk_tokens_for(self.chunk_tokens, tokens=labels.numel(), vocab=vocab)  # 0: the whole micro-batch
        if self.z_loss_weight > 0:
            ce, z = cross_entropy_and_z_loss(model.project, h, labels, chunk_tokens=chunk, summed=self.summed_with_z)
            self.z_loss.add(z.detach())
            return ce + self.z_loss_weight * z
        if chunk == 0:
            return self.whole(model.project(h), labels)
        return chunked_cross_entropy_loss(model.project, h, labels, chunk_tokens=chunk, summed=self.summed)

    def cross_entropy_only(self) -> Loss:
        """This loss without its z-loss: what validation scores."""
        return replace(self, z_loss_weight=0.0, z_loss=ZLoss())


def build_loss_fn(
    compile: Compile, *, chunk_tokens: int = 0, z_loss_weight: float = 0.0, vocab_shards: int = 1
) -> Loss:
    """The loss of training.loss_chunk_tokens and training.z_loss_weight, on logits whose vocabulary is split over
    `vocab_shards` ranks (loss parallel); its cross-entropy is compiled when compile.components has "loss" (inductor
    fuses the fp32 upcast into the log-softmax instead of materialising an fp32 copy of the logits)."""
    if not (compile.enable and "loss" in compile.components):
        return Loss(chunk_tokens, z_loss_weight=z_loss_weight, vocab_shards=vocab_shards)
    return Loss(
        chunk_tokens,
        whole=torch.compile(cross_entropy_loss, backend=compile.backend),
        summed=torch.compile(_summed_cross_entropy, backend=compile.backend),
        z_loss_weight=z_loss_weight,
        summed_with_z=torch.compile(_summed_cross_entropy_and_z, backend=compile.backend),
        vocab_shards=vocab_shards,
    )


def chunked_cross_entropy_loss(
    project: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
    summed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _summed_cross_entropy,
) -> torch.Tensor:
    """cross_entropy_loss(project(h), labels), `chunk_tokens` tokens at a time, never holding more than
    one chunk's logits (forward and backward)."""
    if isinstance(h, DTensor):
        # Sequence parallel leaves the final norm's output sharded over the sequence; the projection
        # would gather it anyway. Gather it once here, then split the gathered tokens.
        h = h.redistribute(placements=[Replicate()] * h.device_mesh.ndim)
    tokens, labels = h.flatten(0, 1), labels.flatten()
    total = torch.zeros((), device=labels.device)
    for h_chunk, labels_chunk in zip(tokens.split(chunk_tokens), labels.split(chunk_tokens), strict=True):
        chunk_sum = checkpoint(_project_and_sum, project, summed, h_chunk, labels_chunk, use_reentrant=False)
        total = total + (chunk_sum.full_tensor() if isinstance(chunk_sum, DTensor) else chunk_sum)
    return total / labels.numel()


def _project_and_sum(
    project: Callable[[torch.Tensor], torch.Tensor],
    summed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    h_chunk: torch.Tensor,
    labels_chunk: torch.Tensor,
) -> torch.Tensor:
    return summed(project(h_chunk), labels_chunk)


def cross_entropy_and_z_loss(
    project: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
    summed: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = _summed_cross_entropy_and_z,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, mean logsumexp(logits)^2) of project(h) against labels, `chunk_tokens` at a
    time as chunked_cross_entropy_loss does (0, or at least all the tokens: one chunk, not recomputed)."""
    if isinstance(h, DTensor):  # sequence parallel: gather once (see chunked_cross_entropy_loss)
        h = h.redistribute(placements=[Replicate()] * h.device_mesh.ndim)
    tokens, labels = h.flatten(0, 1), labels.flatten()
    if chunk_tokens <= 0 or labels.numel() <= chunk_tokens:
        sums = [_project_and_sum(project, summed, tokens, labels)]
    else:
        sums = [
            checkpoint(_project_and_sum, project, summed, h_chunk, labels_chunk, use_reentrant=False)
            for h_chunk, labels_chunk in zip(tokens.split(chunk_tokens), labels.split(chunk_tokens), strict=True)
        ]
    ce, z = (sum(_local(s[i]) for s in sums) / labels.numel() for i in (0, 1))
    return ce, z


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value
