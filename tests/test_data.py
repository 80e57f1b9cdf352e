"""Tokenizers, preparation into token shards, the memory-mapped corpus, and the world-size
independent, shuffling, resumable loader."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from config import Data, load_config
from data.corpus import MAX_RAW_BYTES, TokenCorpus, open_corpus, prepare_cache
from data.inputs import input_problems
from data.loader import GlobalBatchLoader, permute
from data.mixture import BLOCK, MixedCorpus, Mixture, open_mixture
from data.prepare import prepare, shard_name, tokenize
from data.sources import find_source
from data.tokenizers import ByteTokenizer, Framing, build_tokenizer
from errors import ConfigError
from tests.launch import REPO, python, two_at_a_time
from tests.tiny_hf import CONVENTIONS, tokenizer_folder

BYTE = ByteTokenizer()


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def stream(texts: list[str]) -> list[int]:
    """The packed token stream of `texts` under the byte tokenizer: BOS text EOS, back to back."""
    return [t for text in texts for t in (256, *text.encode(), 257)]


def prepared(folder: Path, source: Path, *, chunk_bytes: int = 64, workers: int = 0) -> TokenCorpus:
    prepare(find_source(str(source)), "byte", folder, workers=workers, chunk_bytes=chunk_bytes)
    return TokenCorpus(folder)


# ------------------------------------------------------------------ tokenizers


def test_byte_tokenizer_round_trips_unicode() -> None:
    tok = build_tokenizer("byte")
    text = "café ✓ naïve"
    (ids,) = tok.encode_batch([text])
    assert max(ids) < 256 and tok.decode(ids) == text
    assert (tok.framing, tok.eos_id, tok.vocab_size) == (Framing(before=(256,), after=(), eos=257), 257, 258)


@pytest.mark.parametrize("path", ["assets/tokenizer", "assets/tokenizer/tokenizer.json"])
def test_shipped_tokenizer_loads_as_folder_and_file(path: str) -> None:
    tok = build_tokenizer(str(REPO / path))
    named_bos = None if path.endswith(".json") else 0  # (a bare tokenizer.json names no BOS; its template adds it)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (named_bos, 1, 2048)
    assert tok.framing == Framing(before=(0,), after=(), eos=1)  # Llama 3's: BOS text, documents BOS text EOS
    (ids,) = tok.encode_batch(["Once upon a time, there was a café."])
    assert tok.bos_id not in ids and tok.decode(ids) == "Once upon a time, there was a café."


def test_the_llama3_tokenizer_from_llama_models_gives_metas_ids_and_prepares_a_uint32_corpus(tmp_path: Path) -> None:
    """scripts/llama3_tokenizer.py: the offline route to the recipes' tokenizer folder. Its ids are tiktoken's
    through llama-models' own Tokenizer, special tokens in the text included; a corpus prepared with it."""
    meta_module = pytest.importorskip(
        "llama_models.llama3.tokenizer", reason="needs llama-models (pip install llama-models)"
    )
    proc = python("scripts/llama3_tokenizer.py", "--output", str(tmp_path / "tok"))
    assert proc.returncode == 0, proc.stderr
    meta, ours = meta_module.Tokenizer.get_instance(), build_tokenizer(str(tmp_path / "tok"))
    stories = (REPO / "assets" / "corpus" / "stories_validation.jsonl").read_text().splitlines()[:100]
    texts = [
        "This is a test sentence.", "  spaces\n\n\ttabs\r\nCRLF", "naïve café — 日本語のテキスト 🙂👍🏽",
        "def f(x):\n    return x**2  # two\n", "1234567890 3.14159 1e-9", " " * 40 + "x", "'s 'LL 'Re I'm",
        "<|begin_of_text|>hi<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n<|reserved_special_token_17|>",
        *(json.loads(line)["text"] for line in stories),
    ]  # fmt: skip
    expected = [meta.encode(t, bos=False, eos=False, allowed_special="all") for t in texts]
    assert ours.encode_batch(texts) == expected
    assert expected[0] == [2028, 374, 264, 1296, 11914, 13]  # llama-models' own test of this sentence
    assert (ours.bos_id, ours.eos_id, ours.vocab_size) == (meta.bos_id, meta.eos_id, 128_256)
    assert ours.framing == Framing(before=(meta.bos_id,), after=(), eos=meta.eos_id)  # Meta's tokenizer.json's
    source = write_jsonl(tmp_path / "d.jsonl", texts)
    manifest = prepare(find_source(str(source)), str(tmp_path / "tok"), tmp_path / "corpus", workers=0)
    corpus = TokenCorpus(tmp_path / "corpus")
    packed = [t for ids in expected for t in (meta.bos_id, *ids, meta.eos_id)]
    assert manifest["dtype"] == "uint32" and corpus.read(0, len(packed)).tolist() == packed
    proc = python("scripts/llama3_tokenizer.py", "--output", str(tmp_path / "x"), "--model", "nope.model")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --model: nope.model not found"), proc.stderr


def test_bad_tokenizer_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid tokenizer.json"):
        build_tokenizer(str(bad))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        build_tokenizer(str(tmp_path / "empty"))


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_prompts_are_framed_as_transformers_frames_them_and_documents_as_the_family_was_pretrained(
    convention: str, tmp_path: Path
) -> None:
    """data/tokenizers.py's one rule, on a tokenizer in each convention: a prompt is transformers' `tokenizer(text)`;
    a prepared document is that, closed by end-of-text (once); no BOS by name where the tokenizer adds none."""
    from transformers import AutoTokenizer

    folder = tokenizer_folder(tmp_path / "tok", convention)
    theirs, ours = AutoTokenizer.from_pretrained(str(folder)), build_tokenizer(str(folder))
    texts = ["Once upon a time", "Hi", " two  spaces", ""]
    assert [ours.framing.prompt(ids) for ids in ours.encode_batch(texts)] == [theirs(t)["input_ids"] for t in texts]
    bos, eos = 0, 1  # the shipped vocabulary's <|begin_of_text|> and <|end_of_text|>
    expected = {"llama3": ((bos,), (eos,)), "smollm2": ((), (eos,)), "qwen3": ((), (eos,)), "flags": ((bos,), (eos,))}
    assert (ours.framing.before, ours.framing.closing) == expected[convention]
    corpus_folder = tmp_path / "corpus"
    prepare(find_source(str(write_jsonl(tmp_path / "d.jsonl", texts[:3]))), str(folder), corpus_folder, workers=0)
    corpus = TokenCorpus(corpus_folder)
    plain = [theirs(t, add_special_tokens=False)["input_ids"] for t in texts[:3]]
    documents = [[*expected[convention][0], *ids, *expected[convention][1]] for ids in plain]
    assert corpus.read(0, corpus.num_tokens).tolist() == [t for d in documents for t in d]
    assert corpus.manifest["tokenizer"]["framing"] == ours.framing.describe()


def test_the_framing_table_of_docs_data_md_is_what_each_tokenizer_does(tmp_path: Path) -> None:
    text = (REPO / "docs" / "data.md").read_text()
    section = text[text.index("## How a text is framed") :].split("\n## ")[0]
    rows = [
        [c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))]
        for line in section.splitlines()
        if line.startswith("| ")
    ]
    tokenizers = {
        "the shipped": [build_tokenizer(str(REPO / "assets" / "tokenizer")), BYTE],
        "a Llama 3 folder": [build_tokenizer(str(tokenizer_folder(tmp_path / "llama3", "llama3")))],
        "a SmolLM2 folder": [build_tokenizer(str(tokenizer_folder(tmp_path / "smollm2", "smollm2")))],
        "a Qwen3 folder": [build_tokenizer(str(tokenizer_folder(tmp_path / "qwen3", "qwen3")))],
        "a folder whose": [build_tokenizer(str(tokenizer_folder(tmp_path / "flags", "flags")))],
    }
    checked = 0
    for label, _, prompt, document in rows[1:]:
        for tok in next((v for k, v in tokenizers.items() if label.startswith(k)), []):
            f = tok.framing
            words = [["EOS" if i == f.eos else "BOS" for i in ids] for ids in (f.before, f.after, f.closing)]
            assert prompt == " ".join([*words[0], "text", *words[1]]), (label, f)
            assert document == " ".join([*words[0], "text", *words[2]]), (label, f)
            checked += 1
    assert checked == 6, rows


def test_a_corpus_prepared_under_the_old_framing_rule_is_refused_with_the_command(tmp_path: Path) -> None:
    """Before the rule, a prepared manifest had no framing and every document began with a BOS found by name."""
    source = write_jsonl(tmp_path / "d.jsonl", TEXTS[:5])
    folder = tokenizer_folder(tmp_path / "tok", "qwen3")
    prepare(find_source(str(source)), str(folder), tmp_path / "corpus", workers=0)
    manifest_file = tmp_path / "corpus" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    del manifest["tokenizer"]["framing"]
    manifest["tokenizer"]["fingerprint"] = "0123456789abcdef"
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as refused:
        open_corpus(Data(path=str(tmp_path / "corpus")), build_tokenizer(str(folder)), str(folder))
    (line,) = refused.value.problems
    assert line.startswith(f"data.path: {tmp_path / 'corpus'} was prepared before documents were framed "), line
    assert f"--source {source} " in line and f"--tokenizer {folder} " in line, line


# ------------------------------------------------------------------ preparation


TEXTS = [f"document {i}: " + "words " * (i % 11) for i in range(300)]


def test_prepared_stream_is_bos_text_eos_in_order_in_uint16_with_document_ends(tmp_path: Path) -> None:
    corpus = prepared(tmp_path / "out", write_jsonl(tmp_path / "d.jsonl", TEXTS), chunk_bytes=500)
    expected = stream(TEXTS)
    assert corpus.num_tokens == len(expected) and len(corpus.tokens) > 10  # many shards
    assert corpus.read(0, len(expected)).tolist() == expected
    assert {t.dtype for t in corpus.tokens} == {np.dtype(np.uint16)}  # 258 tokens fit in 16 bits
    # Any range, across shard boundaries, and the documents that begin in it, against brute force.
    starts = np.flatnonzero(np.array(expected) == 256)
    for start, length in [(0, 7), (3, 40), (int(corpus.shard_starts[2]) - 5, 30), (len(expected) - 9, 9)]:
        assert corpus.read(start, length).tolist() == expected[start : start + length]
        inside = starts[(starts >= start) & (starts < start + length)] - start
        assert corpus.doc_starts(start, length).tolist() == inside.tolist(), (start, length)
    manifest = corpus.manifest
    assert (manifest["documents"], manifest["tokens"], manifest["dtype"]) == (300, len(expected), "uint16")
    assert manifest["tokenizer"]["fingerprint"] == "byte-v1" and manifest["source"]["text_column"] == "text"


def test_the_output_does_not_depend_on_the_number_of_workers(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", TEXTS * 4)
    one = prepared(tmp_path / "one", source, chunk_bytes=4096, workers=1)
    two = prepared(tmp_path / "two", source, chunk_bytes=4096, workers=2)
    assert len(one.tokens) == len(two.tokens) > 3
    for shard in one.manifest["shards"]:
        for kind in ("tokens_file", "doc_ends_file"):
            assert (tmp_path / "one" / shard[kind]).read_bytes() == (tmp_path / "two" / shard[kind]).read_bytes()
    assert (tmp_path / "one" / "manifest.json").read_bytes() == (tmp_path / "two" / "manifest.json").read_bytes()


def test_tasks_on_several_nodes_write_what_one_machine_writes(tmp_path: Path) -> None:
    """prepare_data.py --task K --tasks N (a Slurm array): each task its share of the chunks, the last one
    to finish the manifest; byte for byte the one-machine corpus. --finish writes the manifest from the
    tasks' records; a task that has not finished, and a task index out of range, are one line each."""
    source = write_jsonl(tmp_path / "d.jsonl", TEXTS * 4)
    one = prepared(tmp_path / "one", source, chunk_bytes=4096)
    out = tmp_path / "tasks"
    cli = ["scripts/prepare_data.py", "--source", str(source), "--tokenizer", "byte", "--output", str(out),
           "--chunk-mb", str(4096 / 2**20), "--workers", "1"]  # fmt: skip
    assert prepare(find_source(str(source)), "byte", out, workers=0, chunk_bytes=4096, task=(2, 3)) is None
    proc = python("scripts/prepare_data.py", "--output", str(out), "--tasks", "3", "--finish")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --output: ") and "Traceback" not in proc.stderr
    assert "lacks task-0-of-3.json, task-1-of-3.json" in proc.stderr
    assert prepare(find_source(str(source)), "byte", out, workers=0, chunk_bytes=4096, task=(0, 3)) is None
    assert not (out / "manifest.json").exists()
    proc = python(*cli, "--task", "1", "--tasks", "3")  # the last to finish
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}: 1,200 documents" in proc.stdout
    files = [s[kind] for s in one.manifest["shards"] for kind in ("tokens_file", "doc_ends_file")]
    assert len(files) > 6  # every task had chunks
    for name in [*files, "manifest.json", "prepare.json"]:
        assert (out / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    (out / "manifest.json").unlink()
    assert python("scripts/prepare_data.py", "--output", str(out), "--tasks", "3", "--finish").returncode == 0
    assert (out / "manifest.json").read_bytes() == (tmp_path / "one" / "manifest.json").read_bytes()
    proc = python(*cli, "--task", "3", "--tasks", "3")
    assert proc.returncode == 2 and proc.stderr == "error: --task: must be in 0..2 (--tasks 3), got 3\n"


def test_an_interrupted_preparation_resumes_without_redoing_finished_shards(tmp_path: Path) -> None:
    source = find_source(str(write_jsonl(tmp_path / "d.jsonl", TEXTS)))
    out = tmp_path / "out"
    chunks = tokenize(source, "byte", out, workers=0, chunk_bytes=500, share=(0, 2))  # half, then "killed"
    assert not (out / "manifest.json").exists()
    done = {i: (out / shard_name(i, "tokens")).stat().st_mtime_ns for i in range(0, chunks, 2)}
    time.sleep(0.01)
    prepare(source, "byte", out, workers=0, chunk_bytes=500)
    assert {i: (out / shard_name(i, "tokens")).stat().st_mtime_ns for i in done} == done  # not rewritten
    assert TokenCorpus(out).read(0, len(stream(TEXTS))).tolist() == stream(TEXTS)
    with pytest.raises(ConfigError, match=r"holds another preparation \(its chunk_bytes differ\)"):
        prepare(source, "byte", out, workers=0, chunk_bytes=501)


@pytest.mark.parametrize("kind", ["json_array", "jsonl_gz", "text", "parquet", "folder"])
def test_source_formats(tmp_path: Path, kind: str) -> None:
    texts = ["first doc", "second\nwith two lines", "third"]
    match kind:
        case "json_array":
            (path := tmp_path / "d.json").write_text(json.dumps([{"text": t} for t in texts]))
        case "jsonl_gz":
            path = tmp_path / "d.jsonl.gz"
            path.write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode()))
        case "text":
            (path := tmp_path / "d.txt").write_text("\n\n".join(texts) + "\n")
        case "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": texts, "id": [1, 2, 3]}), path := tmp_path / "d.parquet")
        case "folder":
            (path := tmp_path / "docs").mkdir()
            write_jsonl(path / "a.jsonl", texts[:2])
            write_jsonl(path / "b.jsonl", texts[2:])
            (path / "README").write_text("not data")  # files of unknown kinds are skipped
    corpus = prepared(tmp_path / "out", path)
    assert corpus.read(0, corpus.num_tokens).tolist() == stream(texts)


def test_short_data_and_a_missing_column_are_named(tmp_path: Path) -> None:
    short = write_jsonl(tmp_path / "short.jsonl", ["hi"])
    corpus = prepared(tmp_path / "out", short)
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        GlobalBatchLoader(corpus, window=64, local_batch_size=1, global_batch_size=1, dp_rank=0, dp_degree=1)
    with pytest.raises(ConfigError, match="has no column 'body'"):
        prepare(find_source(str(short), text_column="body"), "byte", tmp_path / "body", workers=0)


def test_raw_data_is_cached_and_too_much_of_it_is_refused_with_the_command(tmp_path: Path) -> None:
    data = Data(path=str(write_jsonl(tmp_path / "d.jsonl", TEXTS)), cache_folder=str(tmp_path / "cache"))
    first = open_corpus(data, BYTE, "byte")
    manifest = first.folder / "manifest.json"
    written = manifest.stat().st_mtime_ns
    assert open_corpus(data, BYTE, "byte").folder == first.folder and manifest.stat().st_mtime_ns == written
    assert first.read(0, first.num_tokens).tolist() == stream(TEXTS)
    # A prepared folder is read as it is; one of another tokenizer is refused.
    assert open_corpus(Data(path=str(first.folder)), BYTE, "byte").num_tokens == first.num_tokens
    with pytest.raises(ConfigError, match="was tokenized by byte, not by model.tokenizer_path"):
        open_corpus(Data(path=str(first.folder)), build_tokenizer(str(REPO / "assets/tokenizer")), "assets/tokenizer")
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:  # sparse: the size is what counts, nothing is read
        f.truncate(MAX_RAW_BYTES + 1)
    with pytest.raises(ConfigError) as info:
        open_corpus(Data(path=str(big)), BYTE, "byte")
    (line,) = info.value.problems
    assert line.startswith(f"data.path: {big} is 256 MiB of raw text: too much to tokenize at every start")
    assert f"scripts/prepare_data.py --source {big} --split train --text-column text --tokenizer byte" in line


def test_the_cache_holds_only_complete_preparations_and_its_problems_name_data_cache_folder(tmp_path: Path) -> None:
    """A preparation appears in the cache once complete, under its key and nothing else; a refused one leaves the
    cache as it was. What can still stand in the way (a half-made folder an older version left, a damaged one) is
    refused in one line naming data.cache_folder, the folder, the data it caches and the fix, which works."""
    cache = tmp_path / "cache"
    path = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    data = Data(path=str(path), cache_folder=str(cache))
    corpus = open_corpus(data, BYTE, "byte")
    folder = corpus.folder
    assert list(cache.iterdir()) == [folder] and corpus.read(0, corpus.num_tokens).tolist() == stream(TEXTS)
    # Another run that prepared the same data at the same time publishes after this one: this one's copy is kept.
    manifest = (folder / "manifest.json").read_bytes()
    prepare_cache(find_source(str(path)), "byte", folder)
    assert list(cache.iterdir()) == [folder] and (folder / "manifest.json").read_bytes() == manifest

    nulls = tmp_path / "nulls.jsonl"
    nulls.write_text('{"text": null}\n{"text": null}\n')
    with pytest.raises(ConfigError, match=rf"^data.path: {nulls} holds no documents \(only 2 null ones\); point it"):
        open_corpus(Data(path=str(nulls), cache_folder=str(cache)), BYTE, "byte")
    assert list(cache.iterdir()) == [folder]

    (folder / shard_name(0, "tokens")).unlink()
    fix = f"delete {folder}, the cache of data.path {path}: the next start prepares it again"
    with pytest.raises(ConfigError) as damaged:
        open_corpus(data, BYTE, "byte")
    (line,) = damaged.value.problems
    assert line.startswith(f"data.cache_folder: {folder / shard_name(0, 'tokens')} is missing or damaged (")
    assert line.endswith(fix), line
    for file in folder.iterdir():  # an older version's refused preparation: what it wrote before the refusal
        if file.name != "prepare.json":
            file.unlink()
    with pytest.raises(ConfigError) as left:
        open_corpus(data, BYTE, "byte")
    assert left.value.problems == [
        f"data.cache_folder: {folder}, the cache of data.path {path}, holds an unfinished preparation (no "
        "manifest.json) that an older version of this recipe left; delete that folder, then start again"
    ]
    (folder / "prepare.json").unlink()
    folder.rmdir()
    assert open_corpus(data, BYTE, "byte").read(0, corpus.num_tokens).tolist() == stream(TEXTS)


def test_a_step_that_fails_on_one_rank_stops_every_rank_with_one_error() -> None:
    """distributed.collective_on_every_rank, which each step of the cache's preparation runs in, on 2 ranks as threads
    over torch's threaded process group: a RecipeError on rank 1 alone is raised on both ranks as itself (rank 0
    prints it); another exception goes on up its own rank, and the other raises a RecipeError naming that rank."""
    import threading

    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    from distributed import collective_on_every_rank
    from errors import RecipeError

    def fails_on(failing: int, error: Exception) -> Callable[[int], int]:
        def step(rank: int) -> int:
            if rank == failing:
                raise error
            return rank

        return step

    cases = {
        "none": fails_on(-1, ConfigError("unused")),
        "config": fails_on(1, ConfigError("data.chat: refused", "data.path: refused too")),
        "bug": fails_on(0, OSError(28, "No space left on device")),
    }
    outcome: dict[tuple[str, int], object] = {}
    store = dist.HashStore()

    def rank(r: int) -> None:
        dist.init_process_group("threaded", rank=r, world_size=2, store=store)
        try:
            for name, step in cases.items():
                try:
                    outcome[name, r] = collective_on_every_rank(lambda: step(r))  # noqa: B023 (called at once)
                except Exception as e:
                    outcome[name, r] = e
        finally:
            dist.destroy_process_group()

    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # each thread its own group registry
    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
    assert (outcome["none", 0], outcome["none", 1]) == (0, 1)
    for r in range(2):
        refused = outcome["config", r]
        assert type(refused) is ConfigError and refused.problems == ["data.chat: refused", "data.path: refused too"]
    assert isinstance(outcome["bug", 0], OSError)
    told = outcome["bug", 1]
    assert type(told) is RecipeError and told.problems == [
        "rank 0 failed (OSError: [Errno 28] No space left on device); see its traceback"
    ]


def test_prepare_data_script(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    prepared, no_source, no_tokenizer = two_at_a_time(
        lambda: python(
            "scripts/prepare_data.py",
            "--source",
            str(source),
            "--tokenizer",
            "byte",
            "--output",
            str(tmp_path / "out"),
            "--workers",
            "1",
        ),
        lambda: python(
            "scripts/prepare_data.py",
            "--source",
            str(tmp_path / "nope"),
            "--tokenizer",
            "byte",
            "--output",
            str(tmp_path / "x"),
        ),
        lambda: python(
            "scripts/prepare_data.py", "--source", str(source), "--tokenizer", "nope", "--output", str(tmp_path / "y")
        ),
    )
    assert prepared.returncode == 0, prepared.stderr
    assert "300 documents, 13,618 tokens (uint16, 2.01 bytes per token on disk), 1 shards" in prepared.stdout
    assert (
        no_source.returncode == 2
        and no_source.stderr.startswith("error: --source: ")
        and "Traceback" not in no_source.stderr
    )
    assert no_tokenizer.returncode == 2 and no_tokenizer.stderr.startswith("error: --tokenizer: nope not found"), (
        no_tokenizer.stderr
    )


def test_an_unwritable_cache_folder_is_one_line(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    cfg = Data(path=str(source), cache_folder="/proc/nope")
    with pytest.raises(
        ConfigError, match=r"^data.cache_folder: cannot write to /proc/nope \(.*\); choose a writable folder$"
    ):
        open_corpus(cfg, build_tokenizer("byte"), "byte")


# ---------------------------------------------------------------------- loader


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> TokenCorpus:
    folder = tmp_path_factory.mktemp("c")
    texts = [f"document number {i} " * (1 + i % 7) for i in range(200)]
    return prepared(folder / "out", write_jsonl(folder / "d.jsonl", texts), chunk_bytes=2000)


def loader(
    corpus: TokenCorpus, *, local: int, global_: int, rank: int = 0, dp: int = 1, **kw: object
) -> GlobalBatchLoader:
    return GlobalBatchLoader(corpus, window=17, local_batch_size=local, global_batch_size=global_, dp_rank=rank,
                             dp_degree=dp, **kw)  # type: ignore[arg-type]  # fmt: skip


def global_batches(corpus: TokenCorpus, *, dp: int, local: int, steps: int, **kw: object) -> list[torch.Tensor]:
    """Per step: every rank's inputs, stacked in (micro-batch, rank) order."""
    loaders = [loader(corpus, local=local, global_=8, rank=r, dp=dp, **kw) for r in range(dp)]
    out = []
    for _ in range(steps):
        per_rank = [list(ld.next_step()) for ld in loaders]
        micro = [torch.cat([per_rank[r][m].inputs for r in range(dp)]) for m in range(loaders[0].grad_accum)]
        out.append(torch.cat(micro))
    return out


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("dp", "local"), [(2, 4), (4, 2), (2, 2), (8, 1)])
def test_a_step_sees_the_same_sequences_on_any_number_of_ranks(
    corpus: TokenCorpus, dp: int, local: int, shuffle: bool
) -> None:
    reference = global_batches(corpus, dp=1, local=8, steps=3, shuffle=shuffle, seed=3)
    sharded = global_batches(corpus, dp=dp, local=local, steps=3, shuffle=shuffle, seed=3)
    for ref, got in zip(reference, sharded, strict=True):
        assert torch.equal(ref, got)


def test_an_abandoned_step_reads_its_samples_again(corpus: TokenCorpus) -> None:
    """A stop request between micro-batches abandons the step (train.py): the loader is rewound by one step."""
    ld = loader(corpus, local=2, global_=8, dp=2, rank=1, shuffle=True, seed=3)
    list(ld.next_step())
    started = ld.next_step()
    first = next(started).inputs  # the stop came after the first micro-batch
    ld.abandon_step()
    assert ld.sample_index == 8
    again = [b.inputs for b in ld.next_step()]
    assert torch.equal(again[0], first) and len(again) == ld.grad_accum == 2
    straight = loader(corpus, local=2, global_=8, dp=2, rank=1, shuffle=True, seed=3)
    list(straight.next_step())
    assert all(torch.equal(a, b.inputs) for a, b in zip(again, straight.next_step(), strict=True))


def test_inputs_labels_and_segments(corpus: TokenCorpus) -> None:
    ld = loader(corpus, local=2, global_=2)
    ((inputs, labels, segments, *_),) = list(ld.next_step())
    assert inputs.shape == labels.shape == segments.shape == (2, 16)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    window = corpus.read(0, 17)
    assert np.array_equal(torch.cat([inputs[0, :1], labels[0]]).numpy(), window)
    # A new document (BOS = 256) starts a new segment; what came before the window is segment 0.
    bos = (inputs == 256).int()
    bos[:, 0] = 0
    assert torch.equal(segments, torch.cumsum(bos, dim=1).int())


def windows_read(ld: GlobalBatchLoader, samples: range) -> list[int]:
    """Which window of its source each of `samples` reads."""
    return [ld.locate(k)[1] for k in samples]


def test_shuffle_is_a_seeded_permutation_that_changes_every_epoch(corpus: TokenCorpus) -> None:
    for size in (1, 2, 7, 100, 1001):
        assert sorted(permute(i, size, 5) for i in range(size)) == list(range(size))
    ld = loader(corpus, local=1, global_=1, shuffle=True, seed=1)
    n = ld.num_windows
    first, second = windows_read(ld, range(n)), windows_read(ld, range(n, 2 * n))
    assert sorted(first) == sorted(second) == list(range(n))
    assert first != list(range(n)) and first != second
    assert first == windows_read(loader(corpus, local=1, global_=1, shuffle=True, seed=1), range(n))
    assert first != windows_read(loader(corpus, local=1, global_=1, shuffle=True, seed=2), range(n))


def test_loader_state_resumes_exactly_on_another_world_size_and_refuses_other_data(corpus: TokenCorpus) -> None:
    straight = loader(corpus, local=4, global_=4, shuffle=True, seed=9)  # one rank
    for _ in range(3):
        list(straight.next_step())
    on_two = [loader(corpus, local=2, global_=4, rank=r, dp=2, shuffle=True, seed=9) for r in range(2)]
    for ld in on_two:
        ld.load_state_dict(straight.state_dict())
    expected = next(straight.next_step()).inputs
    assert torch.equal(torch.cat([next(ld.next_step()).inputs for ld in on_two]), expected)

    state = straight.state_dict()
    with pytest.raises(ConfigError, match=r"data.ignore_resume_mismatch: .*\(global_batch_size 4 -> 8\)"):
        loader(corpus, local=4, global_=8).load_state_dict(state | {"shuffle": False, "seed": 0})
    with pytest.raises(ConfigError, match=r"dataset 'other' -> "):
        loader(corpus, local=4, global_=4, shuffle=True, seed=9).load_state_dict(state | {"dataset": "other"})
    # The same tokens under a tokenizer whose fingerprint changed (the framing rule's, on an unchanged stream): resumes.
    renamed = loader(corpus, local=4, global_=4, shuffle=True, seed=9)
    renamed.load_state_dict(state | {"tokenizer": "before-the-framing-rule"})
    assert renamed.sample_index == state["sample_index"]
    with pytest.raises(ConfigError, match=r"tokenizer 'before-the-framing-rule' -> "):
        renamed.load_state_dict(state | {"tokenizer": "before-the-framing-rule", "dataset": "other"})
    lenient = loader(corpus, local=4, global_=8, strict_resume=False)
    lenient.load_state_dict(state)
    assert lenient.sample_index == state["sample_index"]


def test_global_batch_must_split_evenly(corpus: TokenCorpus) -> None:
    with pytest.raises(ConfigError, match="training.global_batch_size"):
        loader(corpus, local=3, global_=8, dp=2)


def test_reading_a_window_costs_the_same_inside_a_huge_document(tmp_path: Path) -> None:
    """One 2-million-token document vs many short ones: a window is a memory-map slice either way."""
    long_doc = write_jsonl(tmp_path / "long.jsonl", ["x" * 2_000_000])
    short_docs = write_jsonl(tmp_path / "short.jsonl", ["y" * 100] * 20_000)
    timings = {}
    for name, source in (("long", long_doc), ("short", short_docs)):
        ld = GlobalBatchLoader(
            prepared(tmp_path / name, source, chunk_bytes=2**20),
            window=8193,
            local_batch_size=4,
            global_batch_size=4,
            dp_rank=0,
            dp_degree=1,
        )
        begin = time.perf_counter()
        for _ in range(20):
            list(ld.next_step())
        timings[name] = time.perf_counter() - begin
    # Not a speed target (a shared machine): within one order of magnitude, where per-document
    # work would make the long document thousands of times slower.
    assert timings["long"] < 10 * timings["short"] + 0.05, timings
    assert os.path.getsize(tmp_path / "long" / "tokens-00000.npy") < 2 * 2_000_002 + 1024


# --------------------------------------------------------------------- mixtures


@pytest.mark.parametrize("weights", [[7, 2, 1], [1, 3, 0.05], [0.5, 0.5], [0.7, 0.3], [1, 1, 1, 1, 1, 1, 1]])
def test_every_1000_consecutive_samples_hold_each_source_within_1_percent_of_its_weight(weights: list[float]) -> None:
    mixture = Mixture(weights)
    samples = 3 * BLOCK + 1234  # three periods and a part: blocks join as smoothly as they run
    located = [mixture.locate(k) for k in range(samples)]
    sources = np.array([source for source, _ in located])
    seen = np.zeros((samples + 1, len(weights)), dtype=np.int64)
    seen[np.arange(1, samples + 1), sources] = 1
    seen = np.cumsum(seen, axis=0)  # seen[k, s]: samples of source s among the first k
    shares = (seen[1000:] - seen[:-1000]) / 1000  # every run of 1,000 consecutive samples
    assert np.abs(shares - np.array(weights) / sum(weights)).max() <= 0.01
    # Sample k is the j-th sample of its source, j counted in O(1); the first k samples' counts likewise.
    assert [j for _, j in located] == [int(seen[k, s]) for k, s in enumerate(sources)]
    assert all(mixture.samples_per_source(k) == seen[k].tolist() for k in range(0, samples + 1, 997))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory, corpus: TokenCorpus) -> MixedCorpus:
    """The loader tests' corpus (932 windows of 17) with a small one (3 windows) at weights 2 : 1."""
    folder = tmp_path_factory.mktemp("m")
    small = prepared(folder / "small", write_jsonl(folder / "s.jsonl", ["s" * 50]), chunk_bytes=2000)
    return MixedCorpus([corpus, small], weights=[2, 1], names=["big", "small"])


def test_a_mixture_reads_each_source_as_alone_and_a_small_source_repeats_without_stalling(
    corpus: TokenCorpus, mixed: MixedCorpus
) -> None:
    ld = loader(mixed, local=1, global_=1, shuffle=True, seed=4)  # type: ignore[arg-type]
    alone = loader(corpus, local=1, global_=1, shuffle=True, seed=4)
    assert ld.windows == [932, 3]
    located = [ld.locate(k) for k in range(3000)]
    big = [window for source, window in located if source == 0]
    small = [window for source, window in located if source == 1]
    assert (len(big), len(small)) == (2000, 1000)  # 2 : 1 in every run of 3 samples
    # The first source reads what it reads alone, the same permutations, epoch after epoch.
    assert big == windows_read(alone, range(2000))
    # The small one goes through 333 epochs of 3 windows meanwhile, each epoch a permutation of its own.
    epochs = [small[i : i + 3] for i in range(0, 999, 3)]
    assert all(sorted(e) == [0, 1, 2] for e in epochs) and len({tuple(e) for e in epochs}) > 1
    tokens = ld.sample(next(k for k, (source, _) in enumerate(located) if source == 1)).tokens
    assert np.array_equal(tokens, mixed.sources[1].read(small[0] * 17, 17))
    ld.sample_index = 3000
    assert ld.samples_per_source() == [2000, 1000]


@pytest.mark.parametrize(("dp", "local"), [(2, 4), (4, 2)])
def test_a_mixture_step_is_the_same_on_any_number_of_ranks_and_resumes_on_another(
    mixed: MixedCorpus, dp: int, local: int
) -> None:
    reference = global_batches(mixed, dp=1, local=8, steps=6, shuffle=True, seed=3)  # type: ignore[arg-type]
    sharded = global_batches(mixed, dp=dp, local=local, steps=6, shuffle=True, seed=3)  # type: ignore[arg-type]
    assert all(torch.equal(ref, got) for ref, got in zip(reference, sharded, strict=True))
    one = loader(mixed, local=8, global_=8, shuffle=True, seed=3)  # type: ignore[arg-type]
    list(one.next_step())
    resumed = loader(mixed, local=local, global_=8, dp=dp, shuffle=True, seed=3)  # type: ignore[arg-type]
    resumed.load_state_dict(one.state_dict())  # one integer: the sample count
    assert torch.equal(torch.cat([b.inputs for b in resumed.next_step()])[:local], reference[1][:local])
    other = loader(MixedCorpus(mixed.sources, weights=[1, 1], names=["big", "small"]), local=8, global_=8)
    with pytest.raises(ConfigError, match="data.ignore_resume_mismatch: the checkpoint was trained on other data"):
        other.load_state_dict(one.state_dict())  # other weights: another stream


def test_a_mixture_prepares_raw_sources_and_refuses_another_tokenizer_in_one_line(
    tmp_path: Path, corpus: TokenCorpus
) -> None:
    raw = write_jsonl(tmp_path / "raw.jsonl", ["text"] * 40)
    cache = str(tmp_path / "cache")
    both = open_mixture(
        Data(mixture=[str(corpus.folder), str(raw)], mixture_weights=[1, 1], cache_folder=cache), BYTE, "byte"
    )
    assert both.names == ["out", "raw"] and both.sources[1].folder.parent == Path(cache)  # prepared into the cache
    with pytest.raises(ConfigError) as info:
        tokenizer = str(REPO / "assets/tokenizer")
        open_mixture(Data(mixture=[str(corpus.folder)], cache_folder=cache), build_tokenizer(tokenizer), tokenizer)
    assert info.value.problems == [
        f"data.mixture: {corpus.folder} was tokenized by byte, not by model.tokenizer_path; point "
        "model.tokenizer_path at that tokenizer, or prepare the data again"
    ]
    twice = open_mixture(Data(mixture=[str(corpus.folder)] * 2), BYTE, "byte")  # equal shares; the same name twice
    assert twice.names == ["0_out", "1_out"] and twice.mixture.counts.tolist() == [5000, 5000]


# ------------------------------------------------------------------ docs/data.md's commands


def data_md_commands(heading: str) -> list[str]:
    """The commands of the ```bash blocks in docs/data.md's section `heading` (up to the next section)."""
    text = (REPO / "docs" / "data.md").read_text()
    section = text[text.index(heading) :]
    section = section[: section.find("\n## ", 1)]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def run(command: str, **env: str) -> subprocess.CompletedProcess[str]:
    command = command.replace(".venv/bin/python", sys.executable)
    proc = subprocess.run(
        ["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=600, env=os.environ | env
    )
    assert proc.returncode == 0, (command, proc.stderr[-3000:])
    return proc


def test_the_data_forms_commands_of_docs_data_md_run_as_written(tmp_path: Path) -> None:
    """Each form's command as docs/data.md writes it, output folders moved to a temporary folder; the download and
    the hub name on local stand-ins of the same layout (no network here)."""
    out = str(tmp_path / "outputs")
    save, prepare_split, download, prepare_hub, prepare_cached = data_md_commands("## Data as `datasets` users hold")
    run(save.replace("outputs/data", out))
    proc = run(prepare_split.replace("outputs/data", out))
    held_out = len((REPO / "assets/corpus/stories_validation.jsonl").read_text().splitlines())
    assert f"wrote {out}/stories-dict-validation: {held_out} documents" in proc.stdout  # the split's, not train's
    # Unprepared: data.path reads its train split, validation.dataset_path its validation split.
    from evaluation.validation import Validator
    from forward import ForwardBackward
    from loss import Loss

    folder, cache = f"{out}/stories-dict", str(tmp_path / "cache")
    cfg = load_config(
        ["--config", "configs/debug.toml", f"--data.path={folder}", f"--validation.dataset_path={folder}"]
    )
    data, tokenizer = dataclasses.replace(cfg.data, cache_folder=cache), build_tokenizer("assets/tokenizer")
    assert open_corpus(data, tokenizer, "assets/tokenizer").manifest["documents"] == 6028
    forward = ForwardBackward(torch.nn.Module(), Loss(), device=torch.device("cpu"))
    cfg.data = data
    validator = Validator(cfg, tokenizer=tokenizer, dp_rank=0, dp_degree=1, forward=forward)
    assert validator.loader.corpus.manifest["documents"] == held_out
    # `hf download`'s layout of fineweb-edu's sample-10BT, with its README's configuration.
    assert (
        download.startswith("hf download HuggingFaceFW/fineweb-edu --repo-type dataset")
        and "data/hf/fineweb-edu" in download
    )
    hub = tmp_path / "fineweb-edu"
    (hub / "sample" / "10BT").mkdir(parents=True)
    (hub / "README.md").write_text(
        "---\nconfigs:\n- config_name: sample-10BT\n  data_files:\n  - split: train\n    path: sample/10BT/*\n---\n"
    )
    (hub / ".gitattributes").write_text("*.parquet filter=lfs\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"text": [f"A fineweb page number {i}." for i in range(50)]}), hub / "sample/10BT/000_00000.parquet"
    )
    proc = run(prepare_hub.replace("data/hf/fineweb-edu", str(hub)).replace("data/fineweb-edu-10BT", f"{out}/fw"))
    assert "50 documents" in proc.stdout
    # A dataset name in the local Hugging Face cache, as an earlier load_dataset("roneneldan/TinyStories") leaves it.
    cache = tmp_path / "hf" / "datasets"
    (tmp_path / "TinyStories").mkdir()
    (tmp_path / "TinyStories" / "validation.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    import datasets

    datasets.load_dataset(str(tmp_path / "TinyStories"), split="validation", cache_dir=str(cache))
    (cache / "tiny_stories").rename(cache / "roneneldan___tiny_stories")  # as load_dataset(name) leaves it
    env = {
        "HF_HOME": str(tmp_path / "hf"),
        "HF_DATASETS_CACHE": str(cache),
        "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
    }
    proc = run(prepare_cached.replace("data/tinystories-validation", f"{out}/ts"), **env)
    assert f"{len(TEXTS)} documents" in proc.stdout

    # Four tasks, each reading its own quarter of the shipped corpus.
    (loop,) = data_md_commands("- **Across nodes:**")
    proc = run(loop.replace("outputs/data", out))
    read = [int(m.replace(",", "")) for m in re.findall(r"task \d of 4: .*?, ([\d,]+) bytes read", proc.stdout)]
    size = (REPO / "assets/corpus/stories.jsonl").stat().st_size
    assert len(read) == 4 and all(r < size / 4 + 2**18 for r in read), read
    assert json.loads((Path(out) / "stories-4" / "manifest.json").read_text())["documents"] == 6028


def test_a_dataset_name_that_is_not_cached_is_one_line_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name ("owner/name") whose owner has a folder in the local Hugging Face cache is looked up when the data
    opens (data/sources.py), one line if that dataset is not there; a name with nothing cached is refused with the
    config's other missing inputs, in words that fit a missing local folder and a dataset to download alike."""
    datasets_cache = tmp_path / "hf" / "datasets"
    (datasets_cache / "someuser___other").mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(datasets_cache))
    cfg = load_config(["--config", "configs/debug.toml", "--data.path=someuser/tiny"], input_checks=input_problems)
    with pytest.raises(ConfigError, match=r"^data.path: someuser/tiny is neither a local path nor a dataset in the"):
        open_corpus(cfg.data, build_tokenizer("assets/tokenizer"), "assets/tokenizer")
    with pytest.raises(ConfigError) as refused:
        load_config(["--config", "configs/debug.toml", "--data.path=nobody/tiny"], input_checks=input_problems)
    (line,) = refused.value.problems
    assert line.endswith(
        "; if it names a Hugging Face dataset, download it with `hf download nobody/tiny --repo-type dataset "
        "--local-dir data/hf/tiny` and set data.path to that folder"
    ), line


def test_a_recipes_missing_corpus_is_made_as_its_header_says() -> None:
    """data/fineweb-edu-10BT-llama3 is no Hugging Face dataset: the line gives the commands of the recipe's header
    (the dataset it names, HuggingFaceFW/fineweb-edu, then prepare_data.py); a folder under a local folder that is
    made by no recipe gets no download of "data/..." either."""
    with pytest.raises(ConfigError) as refused:
        load_config(["--config", "configs/llama3_8b.toml"], input_checks=input_problems)
    (line,) = [p for p in refused.value.problems if p.startswith("data.path")]
    assert line == (
        "data.path: data/fineweb-edu-10BT-llama3 not found; configs/llama3_8b.toml's header makes it: `hf download "
        'HuggingFaceFW/fineweb-edu --repo-type dataset --include "sample/10BT/*" --local-dir data/raw/fineweb-edu`, '
        "then `python scripts/prepare_data.py --source data/raw/fineweb-edu/sample/10BT --tokenizer "
        "assets/hf/Llama-3.1-8B --output data/fineweb-edu-10BT-llama3 --workers 64`"
    )
    with pytest.raises(ConfigError) as refused:
        load_config(["--config", "configs/debug.toml", "--data.path=data/mine"], input_checks=input_problems)
    (line,) = refused.value.problems
    assert "prepare_data.py --source SOURCE" in line and "hf download" not in line, line
