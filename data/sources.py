"""Raw documents, cut into chunks whose boundaries follow from file sizes and metadata alone.

A source is one of the forms a `datasets` user holds a corpus in:

- a file or folder of `.jsonl`/`.json` (JSON lines, or one JSON array of objects), `.jsonl.gz`/`.json.gz`,
  `.parquet`, `.arrow` or `.txt`/`.md`/`.text` (one document per blank-line-separated paragraph);
- a `Dataset.save_to_disk` folder (its state.json lists its Arrow files) or a `DatasetDict.save_to_disk`
  folder (dataset_dict.json and one such folder per split);
- a hub-layout folder (what `hf download --repo-type dataset` writes: data files beside README.md,
  .gitattributes and dataset_info files): `datasets` itself resolves which files are configuration
  `name`'s `split`, from the README's `configs` or from file names (data/train-00000-of-00002.parquet);
- a dataset name ("someuser/tiny"): its copy in the local Hugging Face cache, found with the network off
  (what `load_dataset` prepared into HF_DATASETS_CACHE, else an `hf download` snapshot in HF_HUB_CACHE);
  with format "hub" and no cached copy, the hub's stream (needs a network).

A local source is cut into chunks before anything is read (`chunk_plan`), from sizes and metadata: JSON
lines and text files into byte ranges, a chunk owning the records whose first byte lies in its range
(Hadoop's input-split rule: seek to the range start, skip to the next record boundary, read until the
first record at or after the range end); parquet files by row groups and Arrow files by record batches,
from their footers and message headers; a gzip file or a JSON array cannot be entered in the middle and
is one piece, owned by one task, which streams it and cuts it as it reads into parts of about `chunk_bytes`
of uncompressed input (a chunk's parts, numbered from 0, each a shard), so memory stays flat whatever the
file's size. So task K of N reads its own chunks and nothing else, and the shards prepared from them are
the same whatever the number of tasks or workers. Only a hub stream is cut as it is read (a chunk closes
after `chunk_bytes` of text), so every task reads all of it.

JSON lines travel as raw bytes and are parsed by the worker that tokenizes them (`texts`); a column's
values travel as they are (a chat row is a list of messages): `texts` alone decides what a document is.

The libraries parse: `json.loads` each JSON line, `json.JSONDecoder.raw_decode` each element of a JSON
array, `gzip` and pyarrow (parquet, Arrow) their files. Kept here is what none of them does: start at a
byte offset (the first line at or after a range's start, a paragraph begun before it), count the bytes a
task reads (`_Counted`), and step over a JSON array's brackets and commas without holding the file
(`datasets` reads an array whole, and a text file's paragraphs from its start, split at "\n\n" only;
pyarrow's JSON reader takes JSON lines alone and gives typed columns, not the raw lines a chunk carries).
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from errors import ConfigError

Format = Literal["json", "parquet", "text", "arrow", "hub"]
_SUFFIXES: dict[str, Format] = {
    ".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json", ".parquet": "parquet",
    ".arrow": "arrow", ".txt": "text", ".text": "text", ".md": "text",
}  # fmt: skip
# What `datasets` and `hf download` write beside the data: never documents.
_METADATA = {
    "README.md",
    ".gitattributes",
    "dataset_info.json",
    "dataset_infos.json",
    "state.json",
    "dataset_dict.json",
}
_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")
# How a source is cut into chunks, recorded with it: a preparation or cache cut another way is not resumed.
CHUNKING = (
    "splits-v2: byte ranges of JSON lines and text, parquet row groups, Arrow record batches; gzip files and JSON "
    "arrays streamed in parts"
)

# A preference pair's columns, TRL's names (data/preference.py).
PAIR_COLUMNS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class Source:
    """What to read: `files` (local), or a hub dataset `path` with `name`/`split`, streamed."""

    path: str
    format: Format
    files: tuple[Path, ...] = ()
    text_column: str = "text"
    name: str | None = None
    split: str = "train"
    key: str = "data.path"  # the config key or command-line flag that named it, for messages
    chat: bool = False  # text_column holds conversations (data/chat.py), not texts
    pairs: bool = False  # rows are preference pairs, read whole: PAIR_COLUMNS (data/preference.py)

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns a row is read from: the text column, or a preference pair's three."""
        return PAIR_COLUMNS if self.pairs else (self.text_column,)

    @property
    def input_bytes(self) -> int:
        """Bytes on disk (compressed where compressed); 0 for a hub stream, whose size is unknown."""
        return sum(f.stat().st_size for f in self.files)

    def describe(self) -> dict[str, Any]:
        """What the source is, for manifests and cache keys (sizes and mtimes: a changed file is another source)."""
        files = [
            {"path": str(f.resolve()), "bytes": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns} for f in self.files
        ]
        return {"path": self.path, "format": self.format, "name": self.name, "split": self.split,
                "text_column": self.text_column, "files": files, "chunking": CHUNKING} | ({"chat": True} if self.chat else {}) | ({"pairs": True} if self.pairs else {})  # fmt: skip

    def setting(self, name: str) -> str:
        """How the user names another setting of this source, in its key's section: data.split beside data.path,
        validation.split beside validation.dataset_path, --split beside --source."""
        if self.key.startswith("--"):
            return f"--{name.replace('_', '-')}"
        return f"{self.key.split('.')[0]}.{name}"


# ------------------------------------------------------------------------ finding the files


def find_source(
    path: str,
    *,
    fmt: str = "auto",
    text_column: str = "text",
    name: str | None = None,
    split: str = "train",
    key: str = "data.path",
    tokenizer: str = "TOKENIZER",
) -> Source:
    """The files of `path` and how to read them: a local file or folder, else a dataset name's copy in the
    local Hugging Face cache, else (fmt "hub") the hub's stream. tokenizer: for the command a refusal gives."""
    source = Source(path, "hub", text_column=text_column, name=name, split=split, key=key)
    if fmt != "hub" and Path(path).exists():
        return _local(source, Path(path), fmt)
    if fmt == "hub":  # the cached copy when there is one (its configuration and split), else the stream
        with contextlib.suppress(ConfigError):
            return _cached(source) or source
        return source
    if is_hub_name(path):
        if (cached := _cached(source)) is not None:
            return cached
        raise ConfigError(not_cached(source, tokenizer=tokenizer))
    raise ConfigError(
        f"{key}: {path} not found; point it at a local file or folder (json/jsonl/parquet/arrow/txt, a "
        "save_to_disk or hub-layout folder) or at a dataset name in the local Hugging Face cache"
    )


def is_hub_name(path: str) -> bool:
    """Whether `path` reads as a hub dataset name ("owner/name") rather than as a local path."""
    return _HUB_NAME.fullmatch(path) is not None and not Path(path).exists()


def not_cached(source: Source, *, tokenizer: str) -> str:
    """The one line for a dataset name this machine has no copy of: the command that downloads it, and the
    one that prepares it from the hub's stream."""
    folder = f"data/hf/{source.path.split('/')[-1]}"
    command = prepare_command(
        source.path, hub=True, name=source.name, split=source.split, text_column=source.text_column, tokenizer=tokenizer
    )
    return (
        f"{source.key}: {source.path} is neither a local path nor a dataset in the local Hugging Face cache; for the "
        f"hub's dataset, download it with `hf download {source.path} --repo-type dataset --local-dir {folder}` and "
        f"set {source.key} = {folder}, or prepare it from the hub with `{command}` and set {source.key} to that "
        "--output folder"
    )


def prepare_command(path: str, *, hub: bool, name: str | None, split: str, text_column: str, tokenizer: str) -> str:
    """The scripts/prepare_data.py command that prepares `path` into data/ (hub: from the hub's stream)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "prepare_data.py"
    output = Path(path.rstrip("/")).with_suffix("").name + "-tokens"  # data/tiny-tokens for someuser/tiny
    options = (" --format hub" if hub else "") + (f" --name {name}" if name else "")
    return (
        f"python {script} --source {path}{options} --split {split} --text-column {text_column} --tokenizer {tokenizer} "
        f"--output data/{output} --workers {os.cpu_count()}"
    )


def _local(source: Source, path: Path, fmt: str) -> Source:
    if path.is_file():
        return _with_files(source, [path], fmt)
    if (path / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: a Dataset folder per split
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if source.split not in splits:
            raise ConfigError(
                f"{source.setting('split')}: {path} has the splits {', '.join(splits)}, not {source.split!r}; set "
                f"{source.setting('split')} to one of them"
            )
        path = path / source.split
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():  # Dataset.save_to_disk
        # Its own list: a folder a loaded dataset was mapped in also holds cache-*.arrow files.
        state = json.loads((path / "state.json").read_text())
        return _with_files(source, [path / f["filename"] for f in state.get("_data_files", [])], "arrow")
    if fmt != "auto":
        return _with_files(source, sorted(p for p in path.rglob("*") if p.is_file()), fmt)
    return _with_files(source, _hub_layout(source, path), fmt)


def _with_files(source: Source, files: list[Path], fmt: str) -> Source:
    """`source` reading `files`, all of format `fmt` ("auto": told by their suffixes)."""
    files = [p for p in files if fmt != "auto" or _suffix(p) in _SUFFIXES]
    kinds = {fmt} if fmt != "auto" else {_SUFFIXES[_suffix(p)] for p in files}
    if not files or len(kinds) != 1:
        raise ConfigError(
            f"{source.key}: {source.path} holds no file it can read; use .jsonl/.json(.gz), .parquet, .arrow or "
            f".txt files, a save_to_disk or hub-layout folder, or set {source.setting('format')}"
        )
    if all(f.stat().st_size == 0 for f in files):
        raise ConfigError(f"{source.key}: {source.path} holds no documents; point it at a non-empty dataset")
    return replace(source, format=kinds.pop(), files=tuple(files))


def _hub_layout(source: Source, folder: Path) -> list[Path]:
    """The files of configuration `name`'s `split` in a folder of data files, as `datasets` resolves them; data
    files of another format beside them (which `datasets` would silently leave out) are named and refused."""
    import datasets

    try:
        with _hub_offline():
            builder = datasets.load_dataset_builder(str(folder), source.name)
    except Exception as e:  # in datasets' words: no data files, an unknown configuration, a bad README
        raise ConfigError(
            f"{source.key}: {folder} is not a dataset folder `datasets` can read ({type(e).__name__}: "
            f"{_first_line(e)}); check {source.setting('name')} and the folder's files"
        ) from None
    data_files = builder.config.data_files or {}
    if source.split not in data_files:
        raise ConfigError(
            f"{source.setting('split')}: {folder} has the splits {', '.join(data_files) or '(none)'}, not "
            f"{source.split!r}; set {source.setting('split')} to one of them"
        )
    files = [Path(f) for f in data_files[source.split]]
    kinds = {_SUFFIXES.get(_suffix(f)) for f in files}
    if odd := [p for p in _data_files(folder) if _SUFFIXES[_suffix(p)] not in kinds]:
        shown = ", ".join(str(p.relative_to(folder)) for p in odd[:3]) + (", ..." if len(odd) > 3 else "")
        raise ConfigError(
            f"{source.key}: {folder} mixes formats: beside its {'/'.join(sorted(map(str, kinds)))} files, {len(odd)} "
            f"of another format ({shown}); move those out of the folder"
        )
    return files


def _data_files(folder: Path) -> list[Path]:
    """The files under `folder` that hold documents by their name: not metadata, not under a hidden folder (.cache)."""
    return sorted(
        p for p in folder.rglob("*")
        if p.is_file() and p.name not in _METADATA and _suffix(p) in _SUFFIXES and p.suffix.lower() != ".md"
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )  # fmt: skip


def _cached(source: Source) -> Source | None:
    """A dataset name's copy in the local Hugging Face cache, found without a network; None when there is none.

    With the network off, `load_dataset` finds only what an earlier `load_dataset` prepared into
    HF_DATASETS_CACHE (its Arrow files, read here directly); a snapshot that `hf download` put into
    HF_HUB_CACHE is a hub-layout folder, resolved as one."""
    import datasets
    from huggingface_hub import snapshot_download

    try:
        with _hub_offline():
            dataset = datasets.load_dataset(source.path, source.name, split=source.split)
        return _with_files(source, [Path(f["filename"]) for f in dataset.cache_files], "arrow")
    except ConnectionError:  # not prepared into HF_DATASETS_CACHE (offline, datasets looks nowhere else)
        pass
    except ValueError as e:  # cached, but not this configuration or split
        what = f"configuration {source.name!r} with a split" if source.name else "split"
        raise ConfigError(
            f"{source.key}: the cached dataset {source.path} has no {what} {source.split!r} ({_first_line(e)}); set "
            f"{source.setting('name')} and {source.setting('split')} to one it has"
        ) from None
    try:
        with _hub_offline():
            folder = Path(snapshot_download(source.path, repo_type="dataset", local_files_only=True))
    except Exception:  # LocalEntryNotFoundError: no snapshot either
        return None
    return _with_files(source, _hub_layout(source, folder), "auto")


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """HF_HUB_OFFLINE=1 for one call, and quiet. datasets and huggingface_hub read the variable once, at import,
    into constants of their own: those are set and restored too."""
    import datasets
    import huggingface_hub.constants as hub
    from huggingface_hub.utils import logging as hub_logging

    saved = os.environ.get("HF_HUB_OFFLINE"), datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    verbosity = datasets.logging.get_verbosity(), hub_logging.get_verbosity()
    os.environ["HF_HUB_OFFLINE"] = "1"
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    # Not "Using the latest cached version ..." or "Repo card metadata block was not found" at every start.
    datasets.logging.set_verbosity_error()
    hub_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if saved[0] is None:
            os.environ.pop("HF_HUB_OFFLINE")
        else:
            os.environ["HF_HUB_OFFLINE"] = saved[0]
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved[1], saved[2]
        datasets.logging.set_verbosity(verbosity[0])
        hub_logging.set_verbosity(verbosity[1])


def _suffix(path: Path) -> str:
    suffixes = "".join(path.suffixes[-2:]).lower()
    return suffixes if suffixes in _SUFFIXES else path.suffix.lower()


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else ""


# ------------------------------------------------------------------------ planning the chunks


@dataclass(frozen=True)
class Piece:
    """The part of one file a chunk reads: bytes [start, stop) (JSON lines, text), row groups or record
    batches [start, stop) (parquet, Arrow), or all of it (gzip, a JSON array: bytes [0, size), streamed)."""

    file: Path
    start: int
    stop: int
    bytes: int  # its share of the file's bytes on disk
    first_document: int | None  # its first document's number in the file; None: not known before reading
    footer: Any = field(default=None, compare=False, repr=False)  # a parquet file's metadata, read once when planned


def chunk_plan(source: Source, *, chunk_bytes: int) -> list[tuple[Piece, ...]]:
    """The chunks of a local source, each about `chunk_bytes` of its files, from sizes and metadata alone.

    The files are one sequence of units: a byte range (JSON lines, text: cut anywhere), a row group, a
    record batch, or a whole file. A chunk closes once it holds `chunk_bytes`; what is left at the end joins
    the last chunk when it is under half a chunk (a small shard, often one without a record of its own)."""
    chunks: list[tuple[Piece, ...]] = []
    pieces: list[Piece] = []
    filled = 0
    for file in source.files:
        for unit, cuttable in _units(source, file):
            rest: Piece | None = unit
            while rest is not None:
                room = chunk_bytes - filled
                if cuttable and rest.bytes > room:
                    pieces.append(Piece(file, rest.start, rest.start + room, room, rest.first_document))
                    rest = Piece(file, rest.start + room, rest.stop, rest.bytes - room, None)
                else:
                    pieces.append(rest)
                    rest = None
                filled += pieces[-1].bytes
                if filled >= chunk_bytes:
                    chunks.append(_joined(pieces))
                    pieces, filled = [], 0
    if pieces and chunks and filled < chunk_bytes / 2:
        chunks[-1] = _joined([*chunks[-1], *pieces])
    elif pieces:
        chunks.append(_joined(pieces))
    return chunks


def _units(source: Source, file: Path) -> Iterator[tuple[Piece, bool]]:
    """(a unit of the file, whether it may be cut into byte ranges)."""
    size = file.stat().st_size
    with _named_if_damaged(source, file):
        if size == 0:
            return
        match source.format:
            case "parquet":
                yield from ((piece, False) for piece in _row_groups(source, file))
            case "arrow":
                yield from ((piece, False) for piece in _record_batches(source, file))
            case _:
                yield Piece(file, 0, size, size, 0), not file.name.endswith(".gz") and not _is_json_array(file)


def _joined(pieces: list[Piece]) -> tuple[Piece, ...]:
    """Consecutive byte ranges, row groups or record batches of one file as one piece."""
    out = [pieces[0]]
    for piece in pieces[1:]:
        last = out[-1]
        if piece.file == last.file and piece.start == last.stop:
            out[-1] = replace(last, stop=piece.stop, bytes=last.bytes + piece.bytes)
        else:
            out.append(piece)
    return tuple(out)


def _row_groups(source: Source, file: Path) -> Iterator[Piece]:
    """A parquet file's row groups and their bytes on disk, from its footer."""
    import pyarrow.parquet as pq

    footer = pq.ParquetFile(file).metadata
    _has_column(source, file, footer.schema.to_arrow_schema().names)
    first = 0
    for index in range(footer.num_row_groups):
        group = footer.row_group(index)
        size = sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        yield Piece(file, index, index + 1, size, first, footer)
        first += group.num_rows


def _record_batches(source: Source, file: Path) -> Iterator[Piece]:
    """An Arrow file's record batches and their sizes, from their message headers (memory-mapped: the batches'
    data is not read)."""
    import pyarrow as pa

    with pa.memory_map(str(file)) as mapped:
        schema, batches = _arrow_batches(mapped)
        _has_column(source, file, schema.names)
        first = 0
        for index, batch in enumerate(batches):
            yield Piece(file, index, index + 1, batch.nbytes, first)
            first += batch.num_rows


def _arrow_batches(mapped: Any) -> tuple[Any, Iterator[Any]]:
    """(schema, record batches) of an Arrow IPC stream (what `datasets` writes) or IPC file."""
    import pyarrow as pa

    if mapped.read(6) == b"ARROW1":
        reader = pa.ipc.open_file(mapped)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    mapped.seek(0)
    stream = pa.ipc.open_stream(mapped)
    return stream.schema, iter(stream)


def _has_column(source: Source, file: Path, names: list[str]) -> None:
    if source.pairs and (missing := [c for c in PAIR_COLUMNS if c not in names]):
        raise ConfigError(
            f"{source.key}: {file} has no column {', '.join(missing)} (columns: {', '.join(names)}); preference data "
            f"has TRL's columns {', '.join(PAIR_COLUMNS)}"
        )
    if not source.pairs and source.text_column not in names:
        key = source.setting("messages_column" if source.chat else "text_column")
        raise ConfigError(f"{key}: {file} has no column '{source.text_column}' (columns: {', '.join(names)})")


def _is_json_array(file: Path) -> bool:
    opener = gzip.open if file.name.endswith(".gz") else open
    with opener(file, "rb") as f:
        return f.read(4096).lstrip()[:1] == b"["


@contextlib.contextmanager
def _named_if_damaged(source: Source, file: Path) -> Iterator[None]:
    """A file that cannot be read (truncated, corrupt, unreadable) stops here in one line naming it."""
    try:
        yield
    except ConfigError:
        raise
    except (OSError, EOFError, ValueError, zlib.error) as e:  # gzip, pyarrow (ArrowInvalid is a ValueError)
        raise ConfigError(
            f"{source.key}: {file} is damaged or unreadable ({type(e).__name__}: {_first_line(e)}); replace the file "
            "(a truncated download?) or remove it from the dataset"
        ) from None


# ------------------------------------------------------------------------ reading the chunks


@dataclass
class Chunk:
    """Consecutive documents of a source: raw JSON lines ("json") or column values ("texts"; None: a null one)."""

    index: int  # of the planned chunk (the unit of work a task owns)
    kind: Literal["json", "texts"]
    records: list[Any] = field(default_factory=list)
    input_bytes: int = 0  # its share of the source's bytes on disk (of text, for a hub stream)
    read_bytes: int = 0  # bytes read to produce it (the skip to a range's first record and its last record's end)
    digest: str = ""  # sha256 of the records: the same input gives the same digest
    # Where each piece's records begin: (index in records, file, that record's document number in the file or
    # None where unknown, the byte of the file it was counted from).
    files: list[tuple[int, str, int | None, int]] = field(default_factory=list)
    # A streamed gzip file or JSON array cuts its chunk into parts as it is read: this is part `part`, and
    # whether another follows (known once the next part's first record is read).
    part: int = 0
    last_part: bool = True

    def origin(self, index: int) -> str:
        """Which file record `index` came from, and its document number there, for messages."""
        at = bisect.bisect_right([start for start, _, _, _ in self.files], index) - 1
        start, file, number, byte = self.files[max(at, 0)]
        if number is None:
            return f"document {index - start} of {file} counted from byte {byte}"
        return f"document {number + index - start} of {file}"

    def seal(self) -> Chunk:
        h = hashlib.sha256()
        for record in self.records:
            h.update(record if isinstance(record, bytes) else b"\0" if record is None else _encoded(record))
            h.update(b"\n")
        self.digest = h.hexdigest()
        return self


class Reading:
    """One share of a source's chunks, read in order: chunks k, k + n, k + 2n, ... of share (k, n). Counts
    what it reads; iterate it once."""

    def __init__(self, source: Source, *, chunk_bytes: int, share: tuple[int, int] = (0, 1)):
        self.source, self.chunk_bytes, self.share = source, chunk_bytes, share
        self.plan = None if source.format == "hub" else chunk_plan(source, chunk_bytes=chunk_bytes)
        self.chunks = len(self.plan) if self.plan is not None else 0  # a stream's: once read to its end
        owned = self.plan[share[0] :: share[1]] if self.plan is not None else []
        self.share_bytes = sum(piece.bytes for pieces in owned for piece in pieces)  # 0 for a stream: unknown
        self.read_bytes = 0  # bytes read from the files (or of the stream's text) so far

    def __iter__(self) -> Iterator[Chunk]:
        if self.plan is None:
            yield from self._stream()
            return
        for index in range(self.share[0], len(self.plan), self.share[1]):
            for chunk in read_parts(self.source, index, self.plan[index], chunk_bytes=self.chunk_bytes):
                self.read_bytes += chunk.read_bytes
                yield chunk

    def _stream(self) -> Iterator[Chunk]:
        """A hub stream's chunks, each closed after `chunk_bytes` of text; all read, this share's yielded."""
        chunk = Chunk(0, "texts")
        for documents, value in enumerate(_hub_texts(self.source)):
            if not chunk.records:
                chunk.files.append((0, self.source.path, documents, 0))
            size = len(_encoded(value)) if value is not None else 1
            chunk.records.append(value)
            chunk.input_bytes += size
            chunk.read_bytes += size
            self.read_bytes += size
            if chunk.input_bytes >= self.chunk_bytes:
                if chunk.index % self.share[1] == self.share[0]:
                    yield chunk.seal()
                chunk = Chunk(chunk.index + 1, "texts")
        self.chunks = chunk.index + (1 if chunk.records else 0)
        if chunk.records and chunk.index % self.share[1] == self.share[0]:
            yield chunk.seal()


def read_chunks(source: Source, *, chunk_bytes: int, share: tuple[int, int] = (0, 1)) -> Reading:
    """Share (k, n) of the source's chunks, each about `chunk_bytes` of input: a local source reads chunks
    k, k + n, ... and nothing else; a hub stream is read whole."""
    return Reading(source, chunk_bytes=chunk_bytes, share=share)


def read_parts(source: Source, index: int, pieces: tuple[Piece, ...], *, chunk_bytes: int) -> Iterator[Chunk]:
    """Chunk `index` of a local source, from its pieces alone: one part, or where it streams a gzip file or a
    JSON array, parts closed once they hold `chunk_bytes` of input (the record that fills one ends it), so no
    part holds much more than `chunk_bytes` whatever the file's size. A part's input_bytes and read_bytes are
    its share of the bytes on disk read as it filled: a chunk's parts add up to its pieces'."""
    part = Chunk(index, "json" if source.format == "json" else "texts")
    held = 0  # the part's input: its records' bytes (a byte range, row group or batch: its bytes on disk)
    streaming = False  # the last records came from a streamed piece (only those cut a chunk)
    for piece in pieces:
        with _named_if_damaged(source, piece.file):
            if not _streamed(source, piece):
                if streaming and held >= chunk_bytes:
                    yield replace(part, last_part=False).seal()
                    part, held = Chunk(index, part.kind, part=part.part + 1), 0
                part.files.append((len(part.records), str(piece.file), piece.first_document, piece.start))
                part.input_bytes += piece.bytes
                part.read_bytes += _read_piece(source, piece, part.records)
                held += piece.bytes
                streaming = False
                continue
            streaming = True
            with _Counted(piece.file) as raw:
                given = 0  # of the file's bytes read, those given to parts so far
                part.files.append((len(part.records), str(piece.file), 0, 0))
                for number, record in enumerate(_streamed_records(source, piece, io.BufferedReader(raw))):
                    if held >= chunk_bytes:  # full, and a record follows: the part is done
                        yield replace(part, last_part=False).seal()
                        part, held = Chunk(index, part.kind, part=part.part + 1), 0
                        part.files.append((0, str(piece.file), number, 0))
                    part.records.append(record)
                    held += len(record)
                    if held >= chunk_bytes:
                        part.input_bytes += min(raw.read_bytes, piece.bytes) - min(given, piece.bytes)
                        part.read_bytes += raw.read_bytes - given
                        given = raw.read_bytes
                part.input_bytes += piece.bytes - min(given, piece.bytes)
                part.read_bytes += raw.read_bytes - given
    yield part.seal()


class _Counted(io.FileIO):
    """A file that counts the bytes the operating system gave it."""

    read_bytes = 0

    def readinto(self, buffer: Any) -> int | None:
        n = super().readinto(buffer)
        self.read_bytes += n or 0
        return n

    def read(self, size: int = -1) -> bytes | None:
        data = super().read(size)
        self.read_bytes += len(data or b"")
        return data

    def readall(self) -> bytes:
        data = super().readall()
        self.read_bytes += len(data)
        return data


def _read_piece(source: Source, piece: Piece, records: list[Any]) -> int:
    """Append the piece's records to `records`; returns the bytes read."""
    if source.format == "arrow":
        return _read_batches(source, piece, records)
    with _Counted(piece.file) as raw:
        match source.format:
            case "parquet":
                _read_row_groups(source, piece, raw, records)
            case "json":
                records.extend(_json_records(source, piece, io.BufferedReader(raw)))
            case "text":
                records.extend(_paragraphs(source, piece, io.BufferedReader(raw)))
        return raw.read_bytes


def _streamed(source: Source, piece: Piece) -> bool:
    """Whether the piece is a whole gzip file or JSON array, which is read as a stream (and cut into parts)."""
    return source.format == "json" and (piece.file.name.endswith(".gz") or _is_json_array(piece.file))


def _streamed_records(source: Source, piece: Piece, stream: Any) -> Iterator[bytes]:
    """A gzip file's JSON lines as raw bytes, or a JSON array's objects re-encoded as lines, one at a time."""
    if piece.file.name.endswith(".gz"):
        stream = gzip.GzipFile(fileobj=stream)
    if _is_json_array(piece.file):
        yield from (json.dumps(row).encode() for row in _array_rows(source, piece.file, stream))
        return
    yield from (line for line in stream if line.strip())


def _array_rows(source: Source, file: Path, stream: Any, block: int = 2**20) -> Iterator[Any]:
    """The elements of a JSON array, each decoded by `json.JSONDecoder.raw_decode` from a stream read in blocks
    (`json.load`, and `datasets` too, hold the whole file); only the brackets and commas between elements are
    read here. A value is taken only when text follows it or the file has ended (a number may go on)."""
    text = io.TextIOWrapper(stream, encoding="utf-8")
    decoder = json.JSONDecoder()
    buffer, at, done, eof = "", 0, 0, False  # done: characters dropped from the buffer's front

    def read(size: int) -> None:  # the buffer from `at` on, and up to `size` more characters
        nonlocal buffer, at, done, eof
        more = text.read(size)
        eof = not more
        done, buffer, at = done + at, buffer[at:] + more, 0

    def next_character() -> str:  # the next non-blank character ("" at the end), `at` left on it
        nonlocal at
        while (at := _JSON_BLANK.match(buffer, at).end()) == len(buffer) and not eof:
            read(block)
        return buffer[at : at + 1]

    def value() -> Any:  # the value at the next non-blank character, `at` left after it
        nonlocal at
        next_character()
        while True:
            try:
                found, end = decoder.raw_decode(buffer, at)
                if end < len(buffer) or eof:
                    at = end
                    return found
            except json.JSONDecodeError:
                if eof:
                    raise refuse("a value that does not parse") from None
            read(max(block, len(buffer)))  # doubling: a long value is not parsed again and again

    def refuse(what: str) -> ConfigError:
        return ConfigError(f"{source.key}: {file} is not valid JSON ({what} at character {done + at})")

    if next_character() != "[":
        raise refuse("expected '['")
    at += 1
    separator = ","
    if next_character() == "]":
        at, separator = at + 1, "]"
    while separator == ",":
        yield value()
        separator = next_character()
        if separator not in (",", "]"):
            raise refuse("expected ',' or ']'")
        at += 1
    if next_character() != "":
        raise refuse("text after the array")


_JSON_BLANK = re.compile(r"[ \t\n\r]*")  # what JSON allows between values (json.decoder's WHITESPACE)


def _json_records(source: Source, piece: Piece, stream: Any) -> Iterator[bytes]:
    """JSON lines as raw bytes, those of the piece's byte range."""
    position, _ = _first_record(stream, piece.start)
    while position < piece.stop and (line := stream.readline()):
        position += len(line)
        if line.strip():
            yield line


def _first_record(stream: Any, start: int) -> tuple[int, bytes]:
    """Seek to the first line that begins at or after byte `start`: (where it begins, the end of the line
    before it from byte start - 1 on, which may be just its newline)."""
    if start == 0:
        return 0, b""
    stream.seek(start - 1)
    tail = stream.readline()
    return stream.tell(), tail


def _paragraphs(source: Source, piece: Piece, stream: Any) -> Iterator[str]:
    """The blank-line-separated paragraphs that begin in the piece's byte range, read line by line.

    A paragraph begins at a non-blank line after a blank one (or at the file's start): the range's first
    lines may end a paragraph that began before it, and the last paragraph read may end after it."""
    position, tail = _first_record(stream, piece.start)
    # Inside a paragraph begun before the range when the line before is not blank: seen in its end, most often.
    inside = position > 0 and (_VISIBLE.search(tail) is not None or not _blank(_line_before(stream, position)))
    lines: list[str] = []
    while line := stream.readline():
        at, position = position, position + len(line)
        if _blank(line):
            if lines:
                yield "".join(lines).strip("\n")
                lines = []
            inside = False
            if at >= piece.stop:
                return
        elif inside:
            continue
        elif lines or at < piece.stop:
            lines.append(_decoded(source, piece.file, line, at))
        else:
            return
    if lines:
        yield "".join(lines).strip("\n")


_VISIBLE = re.compile(rb"[!-~]")  # a printable ASCII character: not a blank line, whatever else it holds


def _blank(line: bytes) -> bool:
    return not line.decode("utf-8", errors="replace").strip()


def _decoded(source: Source, file: Path, line: bytes, at: int) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source.key}: {file} is not UTF-8 text ({e.reason} in the line at byte {at})") from None


def _line_before(stream: Any, end: int) -> bytes:
    """The line whose newline is byte end - 1 (without it), read backwards; the stream is left at `end`."""
    data, low = b"", end - 1
    while low > 0:
        step = min(low, 4096)
        low -= step
        stream.seek(low)
        data = stream.read(step) + data
        if (cut := data.rfind(b"\n")) >= 0:
            data = data[cut + 1 :]
            break
    stream.seek(end)
    return data


def _read_row_groups(source: Source, piece: Piece, raw: _Counted, records: list[Any]) -> None:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(raw, metadata=piece.footer)  # the footer is not read again for every chunk
    groups = range(piece.start, piece.stop)
    for batch in parquet.iter_batches(row_groups=groups, columns=list(source.columns), batch_size=4096):
        records.extend(batch.to_pylist() if source.pairs else batch.column(0).to_pylist())


def _read_batches(source: Source, piece: Piece, records: list[Any]) -> int:
    """Record batches [start, stop) of a memory-mapped Arrow file: only the column's buffers are read."""
    import pyarrow as pa

    read = 0
    with pa.memory_map(str(piece.file)) as mapped:
        schema, batches = _arrow_batches(mapped)
        columns = [schema.get_field_index(name) for name in source.columns]
        for index, batch in enumerate(batches):
            if index >= piece.stop:
                break
            if index >= piece.start:
                values = batch.select(columns)
                records.extend(values.to_pylist() if source.pairs else values.column(0).to_pylist())
                read += values.nbytes
    return read


def _encoded(value: Any) -> bytes:
    """A value's bytes for digests and sizes: a text's UTF-8, anything else (a chat row) as JSON."""
    return value.encode() if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str).encode()


def _hub_texts(source: Source) -> Iterator[Any]:
    import datasets

    datasets.disable_progress_bars()
    try:
        stream = datasets.load_dataset(source.path, source.name, split=source.split, streaming=True)
    except Exception as e:  # no network, unknown name, ...
        raise ConfigError(
            f"{source.key}: could not open the hub dataset {source.path} ({type(e).__name__}: {e})"
        ) from None
    for row in stream:
        yield {name: row.get(name) for name in PAIR_COLUMNS} if source.pairs else row.get(source.text_column)


def values(chunk: Chunk, *, column: str | None, key: str = "data.text_column") -> list[Any]:
    """The chunk's values of `column`, one per document (JSON lines parsed here, in the worker); None: the rows whole
    (preference pairs)."""
    if chunk.kind == "texts":
        return chunk.records
    out = []
    for i, line in enumerate(chunk.records):
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"data.path: {chunk.origin(i)} is not valid JSON ({e})") from None
        if column is None and isinstance(row, dict):
            out.append(row)
            continue
        if not isinstance(row, dict) or column not in row:
            have = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise ConfigError(f"{key}: {chunk.origin(i)} has no column '{column}' (it has: {have})")
        out.append(row[column])
    return out


def texts(chunk: Chunk, *, text_column: str, where: str) -> list[str | None]:
    """The chunk's documents as texts (None for a null one); the worker's half of reading."""
    out = values(chunk, column=text_column)
    for i, text in enumerate(out):
        if text is not None and not isinstance(text, str):
            raise ConfigError(
                f"data.text_column: column '{text_column}' of {where} holds {type(text).__name__} values ("
                f"{chunk.origin(i)}), not text; point data.text_column at the column with the documents"
            )
    return out
