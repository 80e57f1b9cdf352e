"""The forms `datasets` users hold corpora in (save_to_disk folders, hub-layout folders, cached dataset names),
each read as `datasets` reads it; chunks planned from sizes and metadata, so that task K of N reads its share."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from config import Data
from data.corpus import TokenCorpus, open_corpus
from data.prepare import prepare, shard_name, write_manifest
from data.sources import chunk_plan, find_source, read_chunks
from data.tokenizers import ByteTokenizer
from errors import ConfigError
from tests.launch import REPO, python

datasets = pytest.importorskip("datasets")
BYTE = ByteTokenizer()
TEXTS = [f"document {i}: " + "words " * (i % 13) for i in range(400)]


def stream(texts: list[str]) -> list[int]:
    return [t for text in texts for t in (256, *text.encode(), 257)]


def tokens(path: Path, **data: object) -> list[int]:
    corpus = open_corpus(Data(path=str(path), cache_folder=str(path.parent / "cache"), **data), BYTE, "byte")  # type: ignore[arg-type]
    return corpus.read(0, corpus.num_tokens).tolist()


def records(source_path: Path, *, chunk_bytes: int, **kw: object) -> list[object]:
    source = find_source(str(source_path), **kw)  # type: ignore[arg-type]
    return [r for chunk in read_chunks(source, chunk_bytes=chunk_bytes) for r in chunk.records]


# ------------------------------------------------------------------ the forms


def test_save_to_disk_folders_read_their_arrow_files_as_datasets_does(tmp_path: Path) -> None:
    """Dataset.save_to_disk (its state.json's files; a map()'s cache file beside them is not data) and
    DatasetDict.save_to_disk (data.split picks the folder); a chat column's rows pass through as they are."""
    messages = [[{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yes"}] for i in range(40)]
    train = datasets.Dataset.from_dict({"text": TEXTS[:40], "messages": messages})
    train.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    (tmp_path / "saved" / "cache-0123.arrow").write_bytes(b"not data")
    datasets.DatasetDict({"train": train, "test": train.select(range(3))}).save_to_disk(str(tmp_path / "dict"))
    reloaded = datasets.load_from_disk(str(tmp_path / "saved"))
    assert tokens(tmp_path / "saved") == stream(reloaded["text"])
    assert tokens(tmp_path / "dict", split="test") == stream(TEXTS[:3])
    assert records(tmp_path / "saved", chunk_bytes=100, text_column="messages") == reloaded["messages"]
    with pytest.raises(ConfigError, match=r"^data.split: .*dict has the splits train, test, not 'validation'; set"):
        find_source(str(tmp_path / "dict"), split="validation")
    with pytest.raises(ConfigError, match=r"^data.text_column: .*data-00000-of-00002.arrow has no column 'body' \("):
        list(read_chunks(find_source(str(tmp_path / "saved"), text_column="body"), chunk_bytes=100))


def hub_layout(folder: Path) -> Path:
    """What `hf download --repo-type dataset --local-dir` writes: data files beside a card and metadata."""
    (folder / "data").mkdir(parents=True)
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / "README.md").write_text("# tiny\n")
    (folder / ".gitattributes").write_text("*.parquet filter=lfs diff=lfs merge=lfs -text\n")
    (folder / "dataset_info.json").write_text("{}")
    (folder / ".cache" / "huggingface" / "download.metadata").write_text("x")
    for i, part in enumerate((TEXTS[:150], TEXTS[150:300])):
        pq.write_table(pa.table({"text": part}), folder / f"data/train-0000{i}-of-00002.parquet", row_group_size=40)
    pq.write_table(pa.table({"text": TEXTS[300:]}), folder / "data/test-00000-of-00001.parquet")
    return folder


def test_hub_layout_folders_take_the_split_and_configuration_datasets_resolves(tmp_path: Path) -> None:
    folder = hub_layout(tmp_path / "tiny")
    for split in ("train", "test"):
        expected = datasets.load_dataset(str(folder), split=split, cache_dir=str(tmp_path / "hf"))["text"]
        assert tokens(folder, split=split) == stream(expected), split
    # fineweb-edu's layout: configurations in the README, a sample under sample/10BT/.
    (folder / "sample" / "10BT").mkdir(parents=True)
    pq.write_table(pa.table({"text": ["a sample"]}), folder / "sample/10BT/000_00000.parquet")
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n"
        "- config_name: sample-10BT\n  data_files:\n  - split: train\n    path: sample/10BT/*\n---\n# tiny\n"
    )
    assert records(folder, chunk_bytes=2**20, name="sample-10BT") == ["a sample"]
    assert records(folder, chunk_bytes=2**20) == TEXTS[:300]
    with pytest.raises(ConfigError, match=r"^data.split: .*tiny has the splits train, not 'test'; set data.split"):
        find_source(str(folder), name="sample-10BT", split="test")
    (folder / "data" / "extra.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError) as info:
        find_source(str(folder))
    assert info.value.problems == [
        f"data.path: {folder} mixes formats: beside its parquet files, 1 of another format (data/extra.jsonl); move "
        "those out of the folder"
    ]


CACHE_CHECK = """
import json, sys
from data.sources import find_source
from errors import ConfigError
found = {}
for name in ("someuser/tiny", "someuser/snap"):
    source = find_source(name)
    found[name] = [source.format, [f.name for f in source.files]]
try:
    find_source("someuser/nope", key="data.path", tokenizer="assets/tokenizer")
except ConfigError as e:
    found["someuser/nope"] = e.problems
try:
    find_source("someuser/tiny", split="validation")
except ConfigError as e:
    found["validation"] = e.problems
found["streamed"] = find_source("someuser/tiny", fmt="hub", split="validation").format
print(json.dumps(found))
"""


def test_a_dataset_name_is_read_from_the_local_cache_without_a_network(tmp_path: Path) -> None:
    """load_dataset's prepared copy (HF_DATASETS_CACHE/someuser___tiny/...) and an `hf download` snapshot
    (HF_HUB_CACHE/datasets--someuser--snap/...), with HF_HUB_OFFLINE unset; a name in neither is one line."""
    cache, hub = tmp_path / "hf" / "datasets", tmp_path / "hf" / "hub"
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:20]))
    datasets.load_dataset(str(tmp_path / "tiny"), split="train", cache_dir=str(cache))
    shutil.move(cache / "tiny", cache / "someuser___tiny")  # as load_dataset("someuser/tiny") online leaves it
    snapshot = hub / "datasets--someuser--snap"
    hub_layout(snapshot / "snapshots" / "abc123")
    (snapshot / "refs").mkdir()
    (snapshot / "refs" / "main").write_text("abc123")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(cache), "HF_HUB_CACHE": str(hub)}
    env |= {"HF_HUB_OFFLINE": "", "HF_DATASETS_OFFLINE": ""}
    proc = python("-c", CACHE_CHECK, env=env)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["someuser/tiny"] == ["arrow", ["tiny-train.arrow"]]
    assert found["someuser/snap"] == ["parquet", ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]]
    (line,) = found["someuser/nope"]
    assert line.startswith(
        "data.path: someuser/nope is neither a local path nor a dataset in the local Hugging Face cache; for the "
        "hub's dataset, download it with `hf download someuser/nope --repo-type dataset --local-dir data/hf/nope` "
        "and set data.path = data/hf/nope, or prepare it from the hub with `python "
    )
    assert "prepare_data.py --source someuser/nope --format hub --split train --text-column text --tokenizer " in line
    assert "--output data/nope-tokens" in line and proc.stderr == ""
    (line,) = found["validation"]
    assert line.startswith("data.path: the cached dataset someuser/tiny has no split 'validation' (Unknown split")
    assert found["streamed"] == "hub"  # not cached: --format hub streams it


# ------------------------------------------------------------------ chunks planned from metadata


def test_byte_range_chunks_hold_exactly_the_records_one_chunk_holds(tmp_path: Path) -> None:
    """Hadoop's rule on JSON lines and text paragraphs: chunks of 1 to 97 bytes, whose ranges start inside
    records, on blank lines, in runs of blank lines and whitespace-only lines, give the records in order."""
    lines = [json.dumps({"text": t}) for t in TEXTS[:60]]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(line if i % 7 else f"{line}\n \n" for i, line in enumerate(lines)) + "\n\n")
    paragraphs = ["one line", "two\nlines", "  indented\n\tand tabbed", "x", "café ✓ naïve\nagain", "last one"]
    text = tmp_path / "d.txt"
    text.write_text("\n\n".join(paragraphs * 5).replace("x\n\n", "x\n \t\n\n\n") + "\n")
    for path in (jsonl, text):
        whole = records(path, chunk_bytes=2**20)
        assert len(whole) == (60 if path == jsonl else 30)
        for chunk_bytes in (1, 2, 3, 5, 8, 13, 97):
            assert records(path, chunk_bytes=chunk_bytes) == whole, (path.name, chunk_bytes)


def test_each_of_four_tasks_reads_a_quarter_of_the_input(tmp_path: Path) -> None:
    """1 MB of JSON lines and of text cut into 64 KiB byte ranges, 16 parquet row groups: each task reads at
    most a quarter of the input, a chunk and its buffer's worth (the reader's own count of bytes read)."""
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 40))
    text = tmp_path / "d.txt"
    text.write_text("\n\n".join(TEXTS * 48) + "\n")  # 16 chunks, as the others
    parquet = tmp_path / "d.parquet"
    many = [f"document {i}: " + "words " * (i % 13) for i in range(16_000)]
    pq.write_table(pa.table({"text": many}), parquet, row_group_size=1000)
    for path, chunk_bytes in ((jsonl, 2**16), (text, 2**16), (parquet, 1)):
        source = find_source(str(path))
        chunks = len(chunk_plan(source, chunk_bytes=chunk_bytes))
        assert chunks >= 12, (path.name, chunks)
        read, owned = [], []
        for k in range(4):
            reading = read_chunks(source, chunk_bytes=chunk_bytes, share=(k, 4))
            owned += [chunk.index for chunk in reading]
            read.append(reading.read_bytes)
        size = path.stat().st_size
        assert sorted(owned) == list(range(chunks))
        assert all(size / 4 - 2**16 <= r <= size / 4 + 2**16 + 8192 for r in read), (path.name, read, size)


def test_tasks_cutting_row_groups_and_paragraphs_write_what_one_machine_writes(tmp_path: Path) -> None:
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": TEXTS, "id": list(range(400))}), parquet, row_group_size=50)
    text = tmp_path / "d.txt"
    text.write_text("\n\n".join(TEXTS) + "\n")
    for path, chunk_bytes in ((parquet, 1), (text, 1500)):  # a row group per chunk; paragraphs cut anywhere
        source = find_source(str(path))
        one = prepare(source, "byte", tmp_path / f"{path.name}-one", workers=0, chunk_bytes=chunk_bytes)
        out = tmp_path / f"{path.name}-tasks"
        for k in (3, 1, 0, 2):
            prepare(source, "byte", out, workers=0, chunk_bytes=chunk_bytes, task=(k, 4))
        assert len(one["shards"]) >= 8 and one["documents"] == 400
        for name in [*(s["tokens_file"] for s in one["shards"]), "manifest.json"]:
            assert (out / name).read_bytes() == (tmp_path / f"{path.name}-one" / name).read_bytes(), name


ONE_TASK = """
import json, sys
from pathlib import Path
import data.prepare, data.sources, data.tokenizers, numpy  # imported before counting
def rchar():
    return int(next(l for l in open("/proc/self/io") if l.startswith("rchar")).split()[1])
source, out = data.sources.find_source(sys.argv[1]), Path(sys.argv[2])
before = rchar()
data.prepare.prepare(source, "byte", out, workers=0, chunk_bytes=65536, task=(1, 4))
print(json.dumps({"rchar": rchar() - before, "ours": data.prepare.task_record(out, (1, 4))["read_bytes"]}))
"""


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's /proc/self/io")
def test_one_task_reads_a_quarter_of_the_input_by_the_operating_systems_count(tmp_path: Path) -> None:
    """Task 1 of 4 of a 1 MB JSON lines file, counted by the kernel (rchar: every read() of the process
    while it prepares), against the reader's own count."""
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 10))
    size = jsonl.stat().st_size
    proc = subprocess.run(
        [sys.executable, "-c", ONE_TASK, str(jsonl), str(tmp_path / "out")],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    counted = json.loads(proc.stdout)
    assert size / 4 - 65536 <= counted["ours"] <= size / 4 + 65536 + 8192, (counted, size)
    assert counted["ours"] <= counted["rchar"] <= counted["ours"] + 64 * 1024, (counted, size)


def test_an_old_preparation_cut_another_way_is_not_resumed(tmp_path: Path) -> None:
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    source, out = find_source(str(jsonl)), tmp_path / "out"
    prepare(source, "byte", out, workers=0, chunk_bytes=4096, task=(0, 2))
    old = json.loads((out / "prepare.json").read_text())
    del old["source"]["chunking"]  # as the sequential chunking recorded it
    (out / "prepare.json").write_text(json.dumps(old))
    with pytest.raises(ConfigError, match=r"holds another preparation \(its source differ\)"):
        prepare(source, "byte", out, workers=0, chunk_bytes=4096, task=(1, 2))


# ------------------------------------------------------------------ gzip files and JSON arrays, streamed in parts


def streamed_folder(folder: Path) -> Path:
    """A gzip file of JSON lines and a JSON array (each many chunks of 1 KiB: the gzip file by its uncompressed
    size), a small file of JSON lines between them."""
    folder.mkdir()
    lines = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS)
    (folder / "a.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (folder / "b.jsonl").write_text("".join(lines.splitlines(keepends=True)[:40]))
    (folder / "c.json").write_text(json.dumps([{"text": t, "n": 1.5e3} for t in TEXTS], indent=1))
    return folder


def test_a_gzip_file_or_json_array_is_read_in_parts_of_about_chunk_bytes(tmp_path: Path) -> None:
    """Each streamed file is one chunk of the plan (one task's work), read as parts that hold no more than
    chunk_bytes and one record of input: memory is flat in the file's size."""
    folder = streamed_folder(tmp_path / "d")
    source = find_source(str(folder))
    reading = read_chunks(source, chunk_bytes=1024)
    parts = list(reading)
    longest = max(len(r) for part in parts for r in part.records)
    assert all(sum(len(r) for r in part.records) <= 1024 + longest for part in parts)
    by_chunk = {i: [(p.part, p.last_part) for p in parts if p.index == i] for i in range(reading.chunks)}
    # the gzip file; two byte ranges of b.jsonl, one part each; b.jsonl's tail and the JSON array
    assert [len(ps) >= 20 for ps in by_chunk.values()] == [True, False, False, True], by_chunk
    assert len(by_chunk[1]) == len(by_chunk[2]) == 1
    for ps in by_chunk.values():
        assert ps == [(j, j == len(ps) - 1) for j in range(len(ps))]
    assert sum(p.input_bytes for p in parts) == source.input_bytes <= reading.read_bytes
    rows = [json.loads(r) for part in parts for r in part.records]
    assert [row["text"] for row in rows] == TEXTS + [
        json.loads(line)["text"] for line in (folder / "b.jsonl").read_text().splitlines()
    ] + TEXTS
    assert parts[-1].origin(len(parts[-1].records) - 1) == f"document 399 of {folder / 'c.json'}"
    (folder / "c.json").write_text(json.dumps([{"text": t} for t in TEXTS])[:-20])
    with pytest.raises(ConfigError, match=r"^data.path: .*c.json is not valid JSON \(a value that does not parse"):
        list(read_chunks(find_source(str(folder)), chunk_bytes=1024))


def test_streamed_parts_are_the_same_shards_whatever_the_tasks_and_workers(tmp_path: Path) -> None:
    """One task without workers, two tasks, two workers: the same shards byte for byte, in source order; a
    rerun tokenizes only the parts it lacks."""
    source = find_source(str(streamed_folder(tmp_path / "d")))
    one = prepare(source, "byte", tmp_path / "one", workers=0, chunk_bytes=1024)
    assert one is not None and len(one["shards"]) >= 40
    assert [s["tokens_file"] for s in one["shards"][:2]] == ["tokens-00000.npy", "tokens-00000-001.npy"]
    for out, workers, tasks in (("tasks", 0, (1, 0)), ("workers", 2, (0,))):
        for k in tasks:
            prepare(source, "byte", tmp_path / out, workers=workers, chunk_bytes=1024, task=(k, len(tasks)))
        for name in [*(s["tokens_file"] for s in one["shards"]), "manifest.json"]:
            assert (tmp_path / out / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), (out, name)
    rows = [json.loads(line)["text"] for line in (tmp_path / "d" / "b.jsonl").read_text().splitlines()]
    assert TokenCorpus(tmp_path / "one").read(0, one["tokens"]).tolist() == stream(TEXTS + rows + TEXTS)
    out = tmp_path / "one"
    (out / "manifest.json").unlink()
    (out / shard_name(0, "shard", 3)).unlink()
    kept = {f.name: f.stat().st_mtime_ns for f in out.glob("tokens-*.npy")}
    time.sleep(0.01)
    with pytest.raises(ConfigError, match=r"lacks shard 0 part 3 \(shard-00000-003.json\); rerun the preparation"):
        write_manifest(out, chunks=4)
    assert prepare(source, "byte", out, workers=0, chunk_bytes=1024) == one
    assert {f.name: f.stat().st_mtime_ns for f in out.glob("tokens-*.npy")} == kept | {
        "tokens-00000-003.npy": (out / "tokens-00000-003.npy").stat().st_mtime_ns
    }
    assert kept["tokens-00000-003.npy"] != (out / "tokens-00000-003.npy").stat().st_mtime_ns


def test_a_setting_is_named_in_the_section_of_the_key_that_named_the_source(tmp_path: Path) -> None:
    (tmp_path / "dict").mkdir()
    (tmp_path / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    for key, setting in (("validation.dataset_path", "validation.split"), ("data.path", "data.split"),
                         ("--source", "--split")):  # fmt: skip
        with pytest.raises(ConfigError, match=rf"^{setting}: .*dict has the splits train, not 'test'; set {setting} "):
            find_source(str(tmp_path / "dict"), split="test", key=key)
