"""Tokenizers, packing into seq_len + 1 windows, and the world-size independent loader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from config import Data
from data import ByteTokenizer, GlobalBatchLoader, PackedCorpus, build_tokenizer
from errors import ConfigError
from tests.launch import REPO


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_byte_tokenizer_round_trips_unicode() -> None:
    tok = build_tokenizer("byte")
    text = "café ✓ naïve"
    (ids,) = tok.encode_batch([text])
    assert max(ids) < 256 and tok.decode(ids) == text
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258)


@pytest.mark.parametrize("path", ["assets/tokenizer", "assets/tokenizer/tokenizer.json"])
def test_shipped_tokenizer_loads_as_folder_and_file(path: str) -> None:
    tok = build_tokenizer(str(REPO / path))
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2048)
    (ids,) = tok.encode_batch(["Once upon a time, there was a café."])
    assert tok.bos_id not in ids and tok.decode(ids) == "Once upon a time, there was a café."


def test_bad_tokenizer_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid tokenizer.json"):
        build_tokenizer(str(bad))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        build_tokenizer(str(tmp_path / "empty"))


def test_packing_is_the_bos_eos_joined_stream_cut_into_windows(tmp_path: Path) -> None:
    texts = ["ab", "cdef", "", "ghijklmnop", "q"]
    corpus = PackedCorpus(Data(path=str(write_jsonl(tmp_path / "d.jsonl", texts))), ByteTokenizer(), window=5)
    stream = [t for text in texts for t in (256, *text.encode(), 257)]
    assert corpus.num_tokens == len(stream)
    assert corpus.num_windows == len(stream) // 5
    for i in range(corpus.num_windows):
        assert corpus[i].tolist() == stream[5 * i : 5 * i + 5]
    assert corpus[corpus.num_windows].tolist() == stream[:5]  # epochs wrap around


@pytest.mark.parametrize("fmt", ["text", "parquet"])
def test_other_local_formats(tmp_path: Path, fmt: str) -> None:
    if fmt == "text":
        path = tmp_path / "d.txt"
        path.write_text("first paragraph\nstill first\n\nsecond one\n")
    else:
        import datasets

        path = tmp_path / "d.parquet"
        datasets.Dataset.from_dict({"text": ["first", "second"]}).to_parquet(str(path))
    corpus = PackedCorpus(Data(path=str(path)), ByteTokenizer(), window=4)
    assert corpus.num_tokens > 10 and corpus[0][0] == 256


def test_empty_or_short_data_and_missing_column_are_config_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="data.path"):
        PackedCorpus(Data(path=str(empty)), ByteTokenizer(), window=8)
    short = write_jsonl(tmp_path / "short.jsonl", ["hi"])
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        PackedCorpus(Data(path=str(short)), ByteTokenizer(), window=64)
    with pytest.raises(ConfigError, match="no column 'body'"):
        PackedCorpus(Data(path=str(short), text_column="body"), ByteTokenizer(), window=2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> PackedCorpus:
    texts = [f"document number {i} " * (1 + i % 7) for i in range(200)]
    path = write_jsonl(tmp_path_factory.mktemp("c") / "d.jsonl", texts)
    return PackedCorpus(Data(path=str(path)), ByteTokenizer(), window=17)


def global_batches(corpus: PackedCorpus, *, dp: int, local: int, global_: int, steps: int) -> list[torch.Tensor]:
    """Per step: every rank's inputs, stacked in (micro-batch, rank) order."""
    loaders = [GlobalBatchLoader(corpus, local, global_, dp_rank=r, dp_degree=dp) for r in range(dp)]
    out = []
    for _ in range(steps):
        per_rank = [list(loader.next_step()) for loader in loaders]
        micro = [torch.cat([per_rank[r][m][0] for r in range(dp)]) for m in range(loaders[0].grad_accum)]
        out.append(torch.cat(micro))
    return out


@pytest.mark.parametrize(("dp", "local"), [(2, 4), (4, 2), (2, 2), (8, 1)])
def test_a_step_sees_the_same_sequences_on_any_number_of_ranks(corpus: PackedCorpus, dp: int, local: int) -> None:
    reference = global_batches(corpus, dp=1, local=8, global_=8, steps=3)
    sharded = global_batches(corpus, dp=dp, local=local, global_=8, steps=3)
    for ref, got in zip(reference, sharded, strict=True):
        assert torch.equal(ref, got)


def test_inputs_and_labels_are_shifted_by_one(corpus: PackedCorpus) -> None:
    loader = GlobalBatchLoader(corpus, 2, 2, dp_rank=0, dp_degree=1)
    ((inputs, labels),) = list(loader.next_step())
    assert inputs.shape == labels.shape == (2, 16)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert np.array_equal(torch.cat([inputs[0, :1], labels[0]]).numpy(), corpus[0])


def test_loader_state_resumes_exactly(corpus: PackedCorpus) -> None:
    straight = GlobalBatchLoader(corpus, 2, 4, dp_rank=1, dp_degree=2)
    for _ in range(3):
        list(straight.next_step())
    resumed = GlobalBatchLoader(corpus, 2, 4, dp_rank=1, dp_degree=2)
    resumed.load_state_dict(straight.state_dict())
    for a, b in zip(straight.next_step(), resumed.next_step(), strict=True):
        assert torch.equal(a[0], b[0])


def test_global_batch_must_split_evenly(corpus: PackedCorpus) -> None:
    with pytest.raises(ConfigError, match="training.global_batch_size"):
        GlobalBatchLoader(corpus, 3, 8, dp_rank=0, dp_degree=2)
