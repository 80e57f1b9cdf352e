"""Raw documents, read in order and cut into chunks of about `chunk_bytes` of input.

A source is a local file or folder of `.jsonl`/`.json` (JSON lines, or one JSON array of objects),
`.jsonl.gz`/`.json.gz`, `.parquet`, `.txt`/`.md`/`.text` (one document per blank-line-separated
paragraph), or a Hugging Face hub dataset (streamed; needs a network). A folder is read file by
file in sorted order.

Chunks depend on the input alone: one closes as soon as it holds `chunk_bytes` of input, whatever
reads or tokenizes it, so the shards prepared from them are the same with 1 worker or 64. JSON
lines travel as raw bytes and are parsed by the worker that tokenizes them (`texts`): the reading
process only splits lines.
"""

from __future__ import annotations

import bisect
import gzip
import hashlib
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from errors import ConfigError

Format = Literal["json", "parquet", "text", "hub"]
_SUFFIXES: dict[str, Format] = {
    ".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json", ".parquet": "parquet",
    ".txt": "text", ".text": "text", ".md": "text",
}  # fmt: skip
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


@dataclass(frozen=True)
class Source:
    """What to read: `files` (local) or a hub dataset `path` with `name`/`split`."""

    path: str
    format: Format
    files: tuple[Path, ...] = ()
    text_column: str = "text"
    name: str | None = None
    split: str = "train"
    key: str = "data.path"  # the config key or command-line flag that named it, for messages
    chat: bool = False  # text_column holds conversations (data/chat.py), not texts

    @property
    def input_bytes(self) -> int:
        """Bytes on disk (compressed where compressed); 0 for a hub dataset, whose size is unknown."""
        return sum(f.stat().st_size for f in self.files)

    def describe(self) -> dict[str, Any]:
        """What the source is, for manifests and cache keys (sizes and mtimes: a changed file is another source)."""
        files = [
            {"path": str(f.resolve()), "bytes": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns} for f in self.files
        ]
        return {"path": self.path, "format": self.format, "name": self.name, "split": self.split,
                "text_column": self.text_column, "files": files} | ({"chat": True} if self.chat else {})  # fmt: skip


def _suffix(path: Path) -> str:
    suffixes = "".join(path.suffixes[-2:]).lower()
    return suffixes if suffixes in _SUFFIXES else path.suffix.lower()


def find_source(
    path: str,
    *,
    fmt: str = "auto",
    text_column: str = "text",
    name: str | None = None,
    split: str = "train",
    key: str = "data.path",
) -> Source:
    """The files of `path` and how to read them; a hub dataset when fmt is "hub" (or a local path does not exist)."""
    if fmt == "hub":
        return Source(path, "hub", text_column=text_column, name=name, split=split, key=key)
    local = Path(path)
    if not local.exists():
        raise ConfigError(f"{key}: {path} not found; point it at a local file or folder (json/jsonl/parquet/txt)")
    candidates = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
    files = [p for p in candidates if fmt != "auto" or _suffix(p) in _SUFFIXES]
    kinds = {fmt} if fmt != "auto" else {_SUFFIXES[_suffix(p)] for p in files}
    if not files or len(kinds) != 1:
        found = "no file it can read" if not files else f"several formats ({', '.join(sorted(kinds))})"
        raise ConfigError(
            f"{key}: {path} holds {found}; use .jsonl/.json(.gz), .parquet or .txt files, or set data.format"
        )
    if all(f.stat().st_size == 0 for f in files):
        raise ConfigError(f"{key}: {path} holds no documents; point it at a non-empty dataset")
    return Source(path, kinds.pop(), tuple(files), text_column=text_column, name=name, split=split, key=key)  # type: ignore[arg-type]


@dataclass
class Chunk:
    """Consecutive documents of a source: raw JSON lines ("json") or texts (None: a null document)."""

    index: int
    kind: Literal["json", "texts"]
    records: list[Any] = field(default_factory=list)
    first_document: int = 0  # index of the chunk's first document in the whole source
    input_bytes: int = 0
    position: int = 0  # bytes of the source's files consumed when the chunk closed (for progress)
    digest: str = ""  # sha256 of the records: the same input gives the same digest
    # Where each file's records begin: (index in records, file, that record's document number in the file).
    files: list[tuple[int, str, int]] = field(default_factory=list)

    def origin(self, index: int) -> str:
        """Which file record `index` came from, and its document number there, for messages."""
        at = bisect.bisect_right([start for start, _, _ in self.files], index) - 1
        if at < 0:
            return f"document {self.first_document + index}"
        start, file, number = self.files[at]
        return f"document {number + index - start} of {file}"

    def seal(self) -> Chunk:
        h = hashlib.sha256()
        for record in self.records:
            h.update(record if isinstance(record, bytes) else b"\0" if record is None else record.encode())
            h.update(b"\n")
        self.digest = h.hexdigest()
        return self


def read_chunks(source: Source, *, chunk_bytes: int) -> Iterator[Chunk]:
    """The source's documents in order, in chunks of at least `chunk_bytes` of input (the last may be smaller)."""
    kind: Literal["json", "texts"] = "json" if source.format == "json" else "texts"
    chunk = Chunk(0, kind)
    file, in_file = None, 0
    for documents, (record, size, position, origin) in enumerate(_records(source), 1):
        in_file = in_file + 1 if origin == file else 0
        if origin != file or not chunk.records:
            file = origin
            chunk.files.append((len(chunk.records), str(origin), in_file))
        chunk.records.append(record)
        chunk.input_bytes += size
        if chunk.input_bytes >= chunk_bytes:
            chunk.position = position
            yield chunk.seal()
            chunk = Chunk(chunk.index + 1, kind, first_document=documents)
    if chunk.records:
        chunk.position = source.input_bytes
        yield chunk.seal()


def _records(source: Source) -> Iterator[tuple[Any, int, int, str]]:
    """(record, its input bytes, bytes of the files read so far, its file) for every document of the source.

    A file that cannot be read to its end (truncated, corrupt, unreadable) stops here in one line naming it."""
    done = 0
    if source.format == "hub":
        for text in _hub_texts(source):
            size = len(text.encode()) if isinstance(text, str) else 1
            done += size
            yield text, size, done, source.path
        return
    for file in source.files:
        try:
            with open(file, "rb") as raw:
                stream = gzip.GzipFile(fileobj=raw) if file.name.endswith(".gz") else raw
                match source.format:
                    case "json":
                        for line, size, position in _json_records(file, stream, raw, done):
                            yield line, size, position, file
                    case "text":
                        for paragraph in _paragraphs(file, stream):
                            yield paragraph, len(paragraph.encode()), done + raw.tell(), file
                    case "parquet":
                        for text in _parquet_texts(file, source.text_column, source.key):
                            yield text, len(text.encode()) if isinstance(text, str) else 1, done + raw.tell(), file
        except ConfigError:
            raise
        except (OSError, EOFError, ValueError, zlib.error) as e:  # gzip, pyarrow (ArrowInvalid is a ValueError)
            detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            raise ConfigError(
                f"{source.key}: {file} is damaged or unreadable ({type(e).__name__}: {detail}); replace the file "
                "(a truncated download?) or remove it from the dataset"
            ) from None
        done += file.stat().st_size


def _json_records(file: Path, stream: Any, raw: Any, done: int) -> Iterator[tuple[Any, int, int]]:
    """JSON lines as raw bytes; a file that is one JSON array yields its objects' lines re-encoded."""
    if _starts_with_bracket(file):
        try:
            rows = json.load(stream)
        except json.JSONDecodeError as e:
            raise ConfigError(f"data.path: {file} is not valid JSON ({e})") from None
        for row in rows:
            line = json.dumps(row).encode()
            yield line, len(line), done + raw.tell()
        return
    for line in stream:
        if line.strip():
            yield line, len(line), done + raw.tell()


def _starts_with_bracket(file: Path) -> bool:
    opener = gzip.open if file.name.endswith(".gz") else open
    with opener(file, "rb") as f:
        return f.read(4096).lstrip()[:1] == b"["


def _paragraphs(file: Path, stream: Any) -> Iterator[str]:
    """Blank-line-separated paragraphs of a UTF-8 text file, read line by line."""
    lines: list[str] = []
    for number, raw_line in enumerate(stream, 1):
        try:
            line = raw_line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"data.path: {file} is not UTF-8 text ({e.reason} on line {number})") from None
        if line.strip():
            lines.append(line)
        elif lines:
            yield "".join(lines).strip("\n")
            lines = []
    if lines:
        yield "".join(lines).strip("\n")


def _parquet_texts(file: Path, column: str, key: str) -> Iterator[str | None]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(file)
    if column not in parquet.schema_arrow.names:
        names = ", ".join(parquet.schema_arrow.names)
        raise ConfigError(f"data.text_column: {file} has no column '{column}' (columns: {names})")
    for batch in parquet.iter_batches(columns=[column], batch_size=4096):
        yield from batch.column(0).to_pylist()


def _hub_texts(source: Source) -> Iterator[str | None]:
    import datasets

    datasets.disable_progress_bars()
    try:
        stream = datasets.load_dataset(source.path, source.name, split=source.split, streaming=True)
    except Exception as e:  # no network, unknown name, ...
        raise ConfigError(
            f"{source.key}: could not open the hub dataset {source.path} ({type(e).__name__}: {e})"
        ) from None
    for row in stream:
        yield row.get(source.text_column)


def values(chunk: Chunk, *, column: str, key: str = "data.text_column") -> list[Any]:
    """The chunk's values of `column`, one per document (JSON lines parsed here, in the worker)."""
    if chunk.kind == "texts":
        return chunk.records
    out = []
    for i, line in enumerate(chunk.records):
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"data.path: {chunk.origin(i)} is not valid JSON ({e})") from None
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
