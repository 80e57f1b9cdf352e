"""Data mixtures: several corpora read as one stream of samples, each in the share of its weight.

`[data] mixture = ["data/fineweb-edu", "data/code", "data/math"]` with `mixture_weights = [7, 2, 1]`
trains on 70% / 20% / 10% of the sequences. Which source sample k of the run comes from is a pure
function of k: the weights become integer counts per block of BLOCK samples (largest remainders),
and the block is one fixed interleaving of them, the smooth weighted round-robin order, in which
every prefix holds each source's count to within one sample of its share. So any run of 1,000
consecutive samples holds each source within a few samples of its weight, whatever the seed or the
step. Sample k is the j-th sample of its source, with j = k // BLOCK x count + its rank in the block
(O(1)); the source reads its own windows j = 0, 1, ... as a single corpus does (its own shuffle,
its own epochs). A small source runs through its epochs faster than a large one, and the others
never wait for it.

Nothing but the sample index is state: a mixture resumes on any number of ranks, as one corpus
does (data/loader.py), and the tokens each source gave so far follow from the sample index alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from config import Data
from data.corpus import TokenCorpus, open_corpus
from data.tokenizers import Tokenizer

BLOCK = 10_000  # samples per period of the interleaving: weights are kept to 1 part in 10,000


class Mixture:
    """Which source each sample of the run comes from, and which of that source's samples it is."""

    def __init__(self, weights: list[float]):
        self.counts = _counts(weights, BLOCK)
        self.order = _interleave(self.counts)
        # prefix[p, s]: samples of source s among the first p of a block.
        self.prefix = np.zeros((BLOCK + 1, len(weights)), dtype=np.int64)
        np.add.at(self.prefix[1:], (np.arange(BLOCK), self.order), 1)
        self.prefix = np.cumsum(self.prefix, axis=0)

    def locate(self, sample: int) -> tuple[int, int]:
        """(source, index among that source's samples) of sample `sample` of the run."""
        block, position = divmod(sample, BLOCK)
        source = int(self.order[position])
        return source, block * int(self.counts[source]) + int(self.prefix[position, source])

    def samples_per_source(self, samples: int) -> list[int]:
        """How many of the first `samples` samples of the run each source gave."""
        block, position = divmod(samples, BLOCK)
        return (block * self.counts + self.prefix[position]).tolist()


def _counts(weights: list[float], total: int) -> np.ndarray:
    """Integer counts summing to `total` in the proportions of `weights` (largest remainders)."""
    exact = np.asarray(weights, dtype=np.float64) / sum(weights) * total
    counts = np.floor(exact).astype(np.int64)
    for source in np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]:
        counts[source] += 1
    return counts


def _interleave(counts: np.ndarray) -> np.ndarray:
    """The smooth weighted round-robin order of sum(counts) slots (nginx's): each slot goes to the source
    furthest behind its share, so every prefix is within one sample of each share."""
    total, credit = int(counts.sum()), np.zeros(len(counts), dtype=np.int64)
    order = np.empty(total, dtype=np.int64)
    for slot in range(total):
        credit += counts
        order[slot] = source = int(np.argmax(credit))  # the lowest index among ties
        credit[source] -= total
    return order


class MixedCorpus:
    """The prepared folders of `[data] mixture`, with the Mixture of their weights."""

    def __init__(self, sources: list[TokenCorpus], weights: list[float], names: list[str]):
        self.sources, self.names, self.mixture = sources, names, Mixture(weights)
        self.num_tokens = sum(s.num_tokens for s in sources)
        self.tokenizer_fingerprint = sources[0].tokenizer_fingerprint
        what = [[s.fingerprint for s in sources], self.mixture.counts.tolist()]
        self.fingerprint = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


def open_mixture(cfg: Data, tokenizer: Tokenizer, tokenizer_path: str) -> MixedCorpus:
    """The corpora of `[data] mixture`, each a prepared folder or raw data in any form `[data] path` takes (prepared
    into the cache first), opened as `[data] path` is: tokenized by model.tokenizer_path, chat data or not as
    `[data] chat` says. Their weights: `[data] mixture_weights`; empty: equal shares."""
    paths = cfg.mixture
    sources = [
        open_corpus(
            dataclasses.replace(cfg, path=path, mixture=[], mixture_weights=[]), tokenizer, tokenizer_path,
            key="data.mixture",
        )
        for path in paths
    ]  # fmt: skip
    # Metric names (tokens_<name>): a folder's name, a file's without its suffixes, a dataset name's last part.
    names = [Path(p).name if Path(p).is_dir() else Path(p).name.split(".")[0] for p in paths]
    if len(set(names)) < len(names):
        names = [f"{i}_{name}" for i, name in enumerate(names)]
    return MixedCorpus(sources, cfg.mixture_weights or [1.0] * len(sources), names)
