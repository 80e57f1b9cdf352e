"""The global-batch loader: a step's sequences depend on the step alone, never on the number of ranks.

A chat corpus (data/chat.py) is read as windows of whole samples instead (`ChatWindows`: packed, or
one per window with `pad_samples`), and its labels are IGNORE_INDEX but on the assistant's tokens;
the loss is then normalised by the counted labels of the whole global batch, which every rank
knows from the step's sample indices alone (`Batch.loss_divisor`: no collective).

The corpus is read as windows of `window` = seq_len + 1 tokens (inputs are a window's first
seq_len tokens, labels its last seq_len). Sample k of the run is window k of the first epoch, and
so on around the corpus; with `[data] shuffle` it is window perm(k) of a pseudo-random permutation
of the windows that changes with every epoch, computed in O(1) from (seed, epoch, k) by a small
Feistel network instead of a stored index. Global step s consumes samples [s*G, (s+1)*G) for a
global batch of G sequences, split into micro-batches of local_batch_size x dp sequences, rank r
taking rows [r*local, (r+1)*local) of each. So a run on 1, 2 or 8 ranks sees the same tokens at
every step, resumes bit-exactly on another world size, and the loader's state is one integer
(plus what it was reading, to refuse resuming on other data).

A preference corpus (data/preference.py, for dpo.py) is read as windows of whole pairs (`PreferenceWindows`); each
micro-batch then carries the ids of its pairs (`Batch.pairs`), and its divisor makes the step's loss the mean over
the pairs of the global batch.

A mixture of corpora (data/mixture.py) first maps sample k to (source, j), j counting that source's
samples; the source then reads its window j as a single corpus reads window k, with its own shuffle
and its own epochs. A single corpus is the mixture of one source, whose j is k.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from config import grad_accum_steps
from data.chat import IGNORE_INDEX, ChatWindows
from data.corpus import TokenCorpus
from data.mixture import MixedCorpus
from data.preference import FORMAT, Pairs, PreferenceWindows
from errors import ConfigError, is_rank0


class Batch(NamedTuple):
    inputs: torch.Tensor  # (bs, seq_len) int64
    labels: torch.Tensor  # (bs, seq_len) int64: the inputs shifted by one; IGNORE_INDEX where the loss skips
    segments: torch.Tensor | None  # (bs, seq_len) int32: index of each input token's document in its window
    # What this micro-batch's loss (summed over counted labels / label positions) is divided by, so that the
    # step's gradient is the mean over the counted labels of the whole global batch: the gradient
    # accumulation steps when every label counts. Preference data: the global batch's pairs over the data-parallel
    # ranks, the loss being a sum over pairs (dpo.py).
    loss_divisor: float
    # Preference data: the ids of each row's pairs (data/preference.py Pairs). None otherwise.
    pairs: Pairs | None = None


class Sample(NamedTuple):
    tokens: np.ndarray  # (window,) int64
    segments: np.ndarray  # (window,) int32: each token's document in the window
    loss_mask: np.ndarray | None = None  # (window,) uint8, chat data: 1 where the token counts in the loss
    pairs: np.ndarray | None = None  # preference data: the ids of the window's pairs


_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-mixed 64-bit function of x."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def permute(index: int, size: int, key: int) -> int:
    """A bijection of [0, size) chosen by `key`: a 4-round Feistel network with cycle walking."""
    bits = max(2, (size - 1).bit_length())
    half = (bits + 1) // 2
    mask = (1 << half) - 1
    x = index
    while True:  # the domain [0, 4^half) holds at most 4x size: a few rounds on average
        left, right = x >> half, x & mask
        for round_ in range(4):
            left, right = right, left ^ (_mix(right ^ _mix(key * 4 + round_)) & mask)
        x = (left << half) | right
        if x < size:
            return x


@dataclass
class GlobalBatchLoader:
    """Yields this rank's micro-batches of each optimizer step (see the module docstring)."""

    corpus: TokenCorpus | MixedCorpus
    window: int  # tokens per sample: seq_len + 1
    local_batch_size: int
    global_batch_size: int
    dp_rank: int
    dp_degree: int
    shuffle: bool = False
    seed: int = 0
    strict_resume: bool = True  # refuse a checkpoint of other data, tokenizer, window or global batch
    pad_samples: bool = False  # chat data: one sample per window instead of packing whole samples
    count_format_tokens: bool = False  # preference data: the chat format's tokens in a reply count (mask value 2)
    sample_index: int = 0  # samples consumed by all ranks together: the checkpointed position
    reading_seconds: float = 0.0  # time spent reading this rank's samples so far (fleet/monitor.py compares the ranks')

    def __post_init__(self) -> None:
        self.grad_accum = grad_accum_steps(self.global_batch_size, local_batch=self.local_batch_size, dp=self.dp_degree)
        mixed = isinstance(self.corpus, MixedCorpus)
        self.sources = self.corpus.sources if mixed else [self.corpus]
        self.mixture = self.corpus.mixture if mixed else None
        # Chat sources are read as windows of whole samples (preference data: of whole pairs), the others as the token
        # stream cut every window tokens.
        if mixed and any(source.pairs for source in self.sources):
            raise ConfigError("data.mixture: preference pairs are trained on alone (dpo.enable); set data.path instead")
        self.chat = [
            (PreferenceWindows if source.pairs else ChatWindows)(source, self.window, pad=self.pad_samples)
            if source.loss_masks is not None
            else None
            for source in self.sources
        ]
        self.pairs = isinstance(self.chat[0], PreferenceWindows)
        self.windows = [
            chat.count if chat is not None else source.num_tokens // self.window
            for source, chat in zip(self.sources, self.chat, strict=True)
        ]  # per source
        self.num_windows = sum(self.windows)
        for source, windows in zip(self.sources, self.windows, strict=True):
            if windows == 0:
                what = f"data.mixture: {source.folder}" if mixed else "data.path: the corpus"
                raise ConfigError(
                    f"{what} holds {source.num_tokens} tokens, fewer than one sequence of training.seq_len + 1 = "
                    f"{self.window}; lower training.seq_len or add data"
                )
        # Each source its own permutations; source 0's key is a single corpus's.
        self.keys = [_mix(self.seed) if i == 0 else _mix(_mix(self.seed) ^ i) for i in range(len(self.sources))]

    def locate(self, sample: int) -> tuple[int, int]:
        """(source, window of that source) that sample `sample` reads."""
        source, j = self.mixture.locate(sample) if self.mixture is not None else (0, sample)
        windows = self.windows[source]
        epoch, index = divmod(j, windows)
        return source, permute(index, windows, self.keys[source] ^ epoch) if self.shuffle else index

    def sample(self, sample: int) -> Sample:
        """The window that sample `sample` reads: its tokens, document index per token (and chat loss mask)."""
        source, window = self.locate(sample)
        if (chat := self.chat[source]) is not None:
            return Sample(*chat.get(window))  # with a preference window's pair ids
        corpus, start = self.sources[source], window * self.window
        tokens = corpus.read(start, self.window)
        segments = np.zeros(self.window, dtype=np.int32)
        segments[corpus.doc_starts(start, self.window)] = 1
        segments[0] = 0  # a document that began before the window is this window's document 0
        return Sample(tokens, np.cumsum(segments, dtype=np.int32))

    def count_pairs(self, first: int, count: int) -> tuple[int, int]:
        """How many preference pairs samples [first, first + count) hold, all ranks together, and their counted
        chosen tokens."""
        windows = [self.locate(k)[1] for k in range(first, first + count)]
        chosen = self.chat[0].chosen_tokens[self.count_format_tokens]
        return int(self.chat[0].pairs_in[windows].sum()), int(chosen[windows].sum())

    def sample_window(self, window: int) -> Sample:
        """Window `window` of a single corpus, whatever the order the steps read it in (dpo.py scores every pair)."""
        return Sample(*self.chat[0].get(window)) if self.chat[0] is not None else self.sample(window)

    def count_labels(self, first: int, count: int) -> int:
        """How many labels count in the loss among samples [first, first + count), all ranks together."""
        if all(chat is None for chat in self.chat):
            return count * (self.window - 1)
        total = 0
        for k in range(first, first + count):
            source, window = self.locate(k)
            chat = self.chat[source]
            total += int(chat.labelled[window]) if chat is not None else self.window - 1
        return total

    def samples_per_source(self) -> list[int]:
        """Samples each source gave to the steps so far (all ranks together)."""
        if self.mixture is None:
            return [self.sample_index]
        return self.mixture.samples_per_source(self.sample_index)

    def next_step(self) -> Iterator[Batch]:
        """grad_accum micro-batches of (local_batch_size, seq_len) inputs, labels and segments."""
        base = self.sample_index
        self.sample_index += self.global_batch_size
        per_micro = self.local_batch_size * self.dp_degree
        # Each rank's label positions in a micro-batch, times the ranks: the global batch's counted labels over
        # that is grad_accum when every label counts.
        chosen_per_pair = 0.0
        if self.pairs:
            pairs, chosen = self.count_pairs(base, self.global_batch_size)
            divisor, chosen_per_pair = pairs / self.dp_degree, chosen / pairs
        else:
            divisor = self.count_labels(base, self.global_batch_size) / (per_micro * (self.window - 1))
        for micro in range(self.grad_accum):
            began = time.perf_counter()
            first = base + micro * per_micro + self.dp_rank * self.local_batch_size
            rows = [self.sample(first + j) for j in range(self.local_batch_size)]
            batch = self.batch(rows, divisor, chosen_tokens_per_pair=chosen_per_pair)
            self.reading_seconds += time.perf_counter() - began
            yield batch

    def batch(self, rows: list[Sample], divisor: float, *, chosen_tokens_per_pair: float = 1.0) -> Batch:
        """Samples as a micro-batch: the inputs, their labels (IGNORE_INDEX where a mask says the loss skips), the
        documents, and a preference batch's pair ids."""
        tokens = torch.from_numpy(np.stack([row.tokens for row in rows]))
        labels = tokens[:, 1:]
        if any(row.loss_mask is not None for row in rows):
            mask = np.stack([row.loss_mask if row.loss_mask is not None else np.ones(self.window, np.uint8)
                             for row in rows])[:, 1:]  # fmt: skip
            skipped = (mask == 0) | ((mask == FORMAT) & (not self.count_format_tokens))
            labels = labels.masked_fill(torch.from_numpy(skipped), IGNORE_INDEX)
        segments = torch.from_numpy(np.stack([row.segments for row in rows])[:, :-1])
        pairs = None
        if self.pairs:
            ids = torch.full((len(rows), max(len(row.pairs) for row in rows)), -1, dtype=torch.int64)
            for r, row in enumerate(rows):
                ids[r, : len(row.pairs)] = torch.from_numpy(row.pairs)
            pairs = Pairs(ids, chosen_tokens_per_pair)
        return Batch(tokens[:, :-1], labels, segments, divisor, pairs)

    def abandon_step(self) -> None:
        """The step `next_step` last began was abandoned (a stop request): its samples come again next time."""
        self.sample_index -= self.global_batch_size

    def _identity(self) -> dict[str, Any]:
        return {
            "dataset": self.corpus.fingerprint, "tokenizer": self.corpus.tokenizer_fingerprint,
            "window": self.window, "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle, "seed": self.seed if self.shuffle else 0,
        } | ({"pad_samples": self.pad_samples} if any(c is not None for c in self.chat) else {}) | (
            {"count_format_tokens": self.count_format_tokens} if self.pairs else {})  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"sample_index": self.sample_index, **self._identity()}

    def load_torchtitan(self, state: Any) -> None:
        """Resumed from torchtitan's checkpoint (checkpoint/torchtitan.py) of step `state.step`: its loader's position
        is in its own pipeline's terms, so this one continues where a run of these settings is after that step."""
        self.sample_index = state.step * self.global_batch_size
        if is_rank0():
            print(
                f"data: torchtitan's loader position is not read; reading on from sample {self.sample_index:,} of "
                "data.path, where this recipe's run of these settings is after that step",
                flush=True,
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        changed = [f"{k} {state[k]!r} -> {v!r}" for k, v in self._identity().items() if k in state and state[k] != v]
        if state.get("dataset") == self.corpus.fingerprint:  # the same tokens (a hash of them): the same stream, so a
            changed = [c for c in changed if not c.startswith("tokenizer ")]  # tokenizer's new fingerprint is no change
        if changed and self.strict_resume:
            raise ConfigError(
                f"data.ignore_resume_mismatch: the checkpoint was trained on other data or settings ({', '.join(changed)}); "
                "resuming would not continue its stream. Set data.ignore_resume_mismatch = true to resume anyway "
                "(from the same sample count), or choose another job.dump_folder"
            )
        self.sample_index = int(state["sample_index"])
