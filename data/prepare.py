"""Tokenize a corpus once into token shards that training memory-maps.

`scripts/prepare_data.py` runs this with a pool of worker processes; train.py runs it for small raw
data at start-up, into a cache, with the ranks splitting the chunks among them. The output folder:

    tokens-00000.npy     the documents of input chunk 0 framed as their tokenizer frames a document
                         (data/tokenizers.py: Llama 3's BOS text EOS, Qwen3's text EOS), back to back: uint16 when
                         the vocabulary has fewer than 65,536 tokens, else uint32
    tokens-00000-001.npy part 1 of chunk 0 (and so on for each kind of file), where the chunk streams a
                         gzip file or a JSON array cut into parts of about the chunk size as it is read
    doc_ends-00000.npy   int64, where each of those documents ends in the shard
    loss_mask-00000.npy  chat data only (data/chat.py): uint8 per token, 1 on the assistant's tokens
                         (a conversation is its chat template's rendering, no BOS/EOS added); preference
                         pairs (data/preference.py): each pair's chosen and rejected sequence, 1 on a reply's
                         own text, 2 on the chat format's tokens inside it
    shard-00000.json     the shard's record (documents, tokens, sha256 of its input and of its tokens, its
                         part and whether it is the chunk's last), written after the two files: a rerun
                         skips the parts whose record matches
    prepare.json         what is being prepared (source, tokenizer, chunk size): a rerun into the
                         same folder must be the same preparation
    manifest.json        written last, so its presence means complete: format, dtype, tokenizer,
                         source, counts, and every shard (chunks in order, each chunk's parts in order)
    task-K-of-N.json     with `task=(K, N)` (a scheduler's array of N tasks, one per node): task K
                         read and tokenized chunks K, K + N, ... (and recorded the bytes it read); the
                         task that finds all N written writes the manifest (`finish` does it too, from
                         these records alone)

A chunk's shard depends on that chunk's input and the tokenizer only, and the chunks are planned from
the files' sizes and metadata (data/sources.py), so the token files are the same byte for byte
whatever the number of workers or tasks, and an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from data.chat import ChatRenderer, chat_renderer
from data.sources import Chunk, Reading, Source, read_chunks, texts, values
from data.tokenizers import Tokenizer, build_tokenizer
from errors import ConfigError

if TYPE_CHECKING:
    from data.preference import PairRenderer

FORMAT = "llama3-recipe/tokens-v1"
CHUNK_BYTES = 16 * 2**20


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned integer that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def is_prepared(folder: Path) -> bool:
    return (folder / "manifest.json").is_file()


def shard_name(index: int, kind: str, part: int = 0) -> str:
    """A file of chunk `index`'s shard, or of its part `part` (a streamed chunk's parts after the first)."""
    return f"{kind}-{index:05d}{f'-{part:03d}' if part else ''}.{'json' if kind == 'shard' else 'npy'}"


def plan(source: Source, tokenizer: Tokenizer, tokenizer_path: str, *, chunk_bytes: int) -> dict[str, Any]:
    """What a preparation is, as prepare.json records it (and a cache key hashes it)."""
    return {
        "format": FORMAT,
        "source": source.describe(),
        "tokenizer": {"path": tokenizer_path, "fingerprint": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size,
                      "eos_id": tokenizer.eos_id, "framing": tokenizer.framing.describe()},
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "chunk_bytes": chunk_bytes,
    } | ({"chat": {"template": chat_renderer(tokenizer_path).fingerprint}} if source.chat else {})  # fmt: skip


def begin(source: Source, tokenizer_path: str, output: Path, *, chunk_bytes: int = CHUNK_BYTES) -> Tokenizer:
    """Start (or check that `output` already holds) this preparation; returns the tokenizer."""
    tokenizer = build_tokenizer(tokenizer_path)
    start(output, plan(source, tokenizer, tokenizer_path, chunk_bytes=chunk_bytes))
    return tokenizer


def start(output: Path, the_plan: dict[str, Any]) -> None:
    """Create `output` for `the_plan`, or check that it already holds the same preparation."""
    output.mkdir(parents=True, exist_ok=True)
    record = output / "prepare.json"
    if record.is_file():
        before = json.loads(record.read_text())
        if before != the_plan:
            changed = sorted(k for k in the_plan if before.get(k) != the_plan[k])
            raise ConfigError(
                f"--output: {output} holds another preparation (its {', '.join(changed)} differ); choose an empty "
                "folder, or delete it to start over"
            )
        return
    _write_json(record, the_plan)


# ------------------------------------------------------------------------ one chunk


class _Worker:
    """Tokenizes chunks into shards; one per process (the tokenizer is built once per process)."""

    tokenizer: Tokenizer | None = None
    chat: ChatRenderer | PairRenderer | None = None

    @classmethod
    def init(cls, tokenizer_path: str, chat: bool = False, pairs: bool = False) -> None:
        # Each worker is one core: the Rust tokenizer would otherwise spread a batch over all of them.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        cls.tokenizer = build_tokenizer(tokenizer_path)
        cls.chat = renderer(tokenizer_path, chat=chat, pairs=pairs)

    @classmethod
    def run(cls, chunk: Chunk, output: Path, text_column: str, where: str) -> dict[str, Any]:
        assert cls.tokenizer is not None
        return write_shard(chunk, cls.tokenizer, output, text_column=text_column, where=where, chat=cls.chat)


def renderer(tokenizer_path: str, *, chat: bool, pairs: bool) -> ChatRenderer | PairRenderer | None:
    """What renders a source's rows: preference pairs, conversations, or nothing (texts)."""
    if pairs:
        from data.preference import PairRenderer

        return PairRenderer(tokenizer_path)
    return chat_renderer(tokenizer_path) if chat else None


def write_shard(
    chunk: Chunk,
    tokenizer: Tokenizer,
    output: Path,
    *,
    text_column: str,
    where: str,
    chat: ChatRenderer | PairRenderer | None = None,
) -> dict[str, Any]:
    """Tokenize one chunk into its shard files (tmp + rename) and record; returns the record.

    With `chat` each document is a conversation, rendered by its template (BOS and the turns' ends included),
    and a third file, the loss mask, marks the assistant's tokens; with a PairRenderer each row is a preference
    pair, two documents (data/preference.py), and the record counts the rows dropped."""
    dropped = None
    if chat is None:
        flat, ends, nulls = _text_documents(chunk, tokenizer, text_column=text_column, where=where)
        arrays = {"tokens": flat, "doc_ends": ends}
    elif not isinstance(chat, ChatRenderer):
        from data.preference import pair_documents

        rows = values(chunk, column=None, key="data.path")
        flat, ends, mask, dropped = pair_documents(
            rows, chat, origin=chunk.origin, dtype=token_dtype(tokenizer.vocab_size)
        )
        arrays, nulls = {"tokens": flat, "doc_ends": ends, "loss_mask": mask}, sum(r is None for r in rows)
    else:
        flat, ends, mask, nulls = _chat_documents(chunk, chat, text_column=text_column, vocab_size=tokenizer.vocab_size)
        arrays = {"tokens": flat, "doc_ends": ends, "loss_mask": mask}
    record = (
        {
            "index": chunk.index,
            "part": chunk.part,
            "last_part": chunk.last_part,
            "documents": len(ends),
            "null_documents": nulls,
            "tokens": int(flat.size),
            "input_bytes": chunk.input_bytes,
            "input_sha256": chunk.digest,
            "tokens_sha256": hashlib.sha256(flat.tobytes()).hexdigest(),
        }
        | ({"loss_tokens": int((arrays["loss_mask"] > 0).sum())} if chat is not None else {})
        | ({"dropped": dropped} if dropped is not None else {})
    )
    for kind, array in arrays.items():
        tmp = output / (shard_name(chunk.index, kind, chunk.part) + ".tmp")
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, output / shard_name(chunk.index, kind, chunk.part))
    _write_json(output / shard_name(chunk.index, "shard", chunk.part), record)
    return record


def _text_documents(
    chunk: Chunk, tokenizer: Tokenizer, *, text_column: str, where: str
) -> tuple[np.ndarray, np.ndarray, int]:
    """(each document framed as its tokenizer frames one, back to back; where each ends; null documents skipped)."""
    documents = texts(chunk, text_column=text_column, where=where)
    present = [t for t in documents if t is not None]
    ids = tokenizer.encode_batch(present) if present else []
    before, closing = tokenizer.framing.before, tokenizer.framing.closing
    lengths = np.fromiter((len(before) + len(x) + len(closing) for x in ids), dtype=np.int64, count=len(ids))
    ends = np.cumsum(lengths)
    flat = np.empty(int(ends[-1]) if len(ends) else 0, dtype=token_dtype(tokenizer.vocab_size))
    starts = ends - lengths
    for begin, end, doc in zip(starts.tolist(), ends.tolist(), ids, strict=True):
        flat[begin : begin + len(before)] = before
        flat[begin + len(before) : end - len(closing)] = doc
        flat[end - len(closing) : end] = closing
    return flat, ends, len(documents) - len(present)


def _chat_documents(
    chunk: Chunk, chat: ChatRenderer, *, text_column: str, vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(each conversation's tokens back to back, where each ends, their loss mask, null rows skipped)."""
    rows = values(chunk, column=text_column, key="data.messages_column")
    rendered = [chat.render(row, where=chunk.origin(i)) for i, row in enumerate(rows) if row is not None]
    lengths = np.fromiter((len(ids) for ids, _ in rendered), dtype=np.int64, count=len(rendered))
    flat = np.fromiter((t for ids, _ in rendered for t in ids), dtype=token_dtype(vocab_size), count=int(lengths.sum()))
    mask = np.concatenate([m for _, m in rendered]) if rendered else np.zeros(0, np.uint8)
    return flat, np.cumsum(lengths), mask, len(rows) - len(rendered)


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for count in counts:
        for reason, n in count.items():
            total[reason] = total.get(reason, 0) + n
    return total


def _done(output: Path, chunk: Chunk) -> dict[str, Any] | None:
    """The record of this chunk's (part's) shard when an earlier run already wrote it from the same input."""
    file = output / shard_name(chunk.index, "shard", chunk.part)
    if not file.is_file():
        return None
    record = json.loads(file.read_text())
    same = record.get("input_sha256") == chunk.digest and record.get("last_part") == chunk.last_part
    return record if same else None


# ------------------------------------------------------------------------ the corpus


def tokenize(
    source: Source,
    tokenizer_path: str,
    output: Path,
    *,
    workers: int,
    chunk_bytes: int = CHUNK_BYTES,
    share: tuple[int, int] = (0, 1),
    progress: Callable[[str], None] | None = None,
) -> int:
    """Write the shards of every chunk that is this process's share; returns the number of chunks.

    workers: 0 tokenizes in this process, N > 0 in a pool of N processes. share: (k, n) takes chunks
    k, k + n, k + 2n, ... (the ranks of a run, or the tasks of a preparation, dividing the work); a
    process reads its own chunks of local files only (every process reads all of a hub stream).
    """
    return _tokenize(
        source, tokenizer_path, output, workers=workers, chunk_bytes=chunk_bytes, share=share, progress=progress
    ).chunks


def _tokenize(
    source: Source,
    tokenizer_path: str,
    output: Path,
    *,
    workers: int,
    chunk_bytes: int,
    share: tuple[int, int],
    progress: Callable[[str], None] | None,
) -> Reading:
    """`tokenize`, returning what was read: the number of chunks and the bytes this share read."""
    tokenizer = begin(source, tokenizer_path, output, chunk_bytes=chunk_bytes)
    reading = read_chunks(source, chunk_bytes=chunk_bytes, share=share)
    meter = _Progress(reading, progress)
    where = source.path
    pool = None
    if workers > 0:
        # spawn: no inherited threads or tokenizer state in the workers.
        pool = multiprocessing.get_context("spawn").Pool(
            workers, initializer=_Worker.init, initargs=(tokenizer_path, source.chat, source.pairs)
        )
    else:
        _Worker.tokenizer, _Worker.chat = tokenizer, renderer(tokenizer_path, chat=source.chat, pairs=source.pairs)
    pending: deque[tuple[Chunk, Any]] = deque()
    try:
        for chunk in reading:
            if (record := _done(output, chunk)) is not None:
                meter.update(chunk, record)
            elif pool is None:
                meter.update(chunk, _Worker.run(chunk, output, source.text_column, where))
            else:
                pending.append((chunk, pool.apply_async(_Worker.run, (chunk, output, source.text_column, where))))
                # At most 2 chunks per worker in flight: memory stays bounded whatever the input size.
                while len(pending) > 2 * workers:
                    done, result = pending.popleft()
                    meter.update(done, result.get())  # a worker's ConfigError arrives here as itself
        while pending:
            done, result = pending.popleft()
            meter.update(done, result.get())
    finally:
        if pool is not None:
            pool.terminate()
    return reading


def write_manifest(output: Path, *, chunks: int, key: str = "--source") -> dict[str, Any]:
    """manifest.json from prepare.json and the shard records: the corpus is complete. The shards in source
    order: chunks 0..chunks-1, each chunk's parts up to the one its record calls the last. key: the setting that
    named the source (train.py's data.path), for the error when it holds no documents."""
    the_plan = json.loads((output / "prepare.json").read_text())
    shards = []
    for index in range(chunks):
        part, last = 0, False
        while not last:
            file = output / shard_name(index, "shard", part)
            if not file.is_file():
                what = f"shard {index}" + (f" part {part}" if part else "")
                raise ConfigError(f"--output: {output} lacks {what} ({file.name}); rerun the preparation to finish it")
            record = json.loads(file.read_text())
            kinds = ("tokens", "doc_ends", "loss_mask") if "chat" in the_plan else ("tokens", "doc_ends")
            shards.append({f"{kind}_file": shard_name(index, kind, part) for kind in kinds} | record)
            part, last = part + 1, record["last_part"]
    manifest = {
        **the_plan,
        "documents": sum(s["documents"] for s in shards),
        "null_documents": sum(s["null_documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        **({"loss_tokens": sum(s["loss_tokens"] for s in shards)} if "chat" in the_plan else {}),
        **({"dropped": _summed([s["dropped"] for s in shards])} if the_plan["source"].get("pairs") else {}),
        "input_bytes": sum(s["input_bytes"] for s in shards),
        "fingerprint": hashlib.sha256("".join(s["tokens_sha256"] for s in shards).encode()).hexdigest()[:16],
        "shards": shards,
    }
    if manifest["tokens"] == 0:
        nulls = f" (only {manifest['null_documents']:,} null ones)" if manifest["null_documents"] else ""
        raise ConfigError(
            f"{key}: {the_plan['source']['path']} holds no documents{nulls}; point it at a non-empty dataset"
        )
    _write_json(output / "manifest.json", manifest)
    return manifest


def prepare(
    source: Source,
    tokenizer_path: str,
    output: Path,
    *,
    workers: int,
    chunk_bytes: int = CHUNK_BYTES,
    task: tuple[int, int] = (0, 1),
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any] | None:
    """Tokenize `source` into `output` (resuming an interrupted run) and write its manifest.

    task: (K, N), task K of N tokenizes its share of the chunks (K, K + N, ...) and records that it is
    done; the manifest is written by the task that finds all N done (None for the others)."""
    reading = _tokenize(
        source, tokenizer_path, output, workers=workers, chunk_bytes=chunk_bytes, share=task, progress=progress
    )
    if task[1] == 1:
        return write_manifest(output, chunks=reading.chunks)
    record = {"chunks": reading.chunks, "read_bytes": reading.read_bytes, "share_bytes": reading.share_bytes}
    _write_json(output / _task_name(*task), record)
    return finish(output, tasks=task[1], missing_ok=True)


def task_record(output: Path, task: tuple[int, int]) -> dict[str, Any]:
    """What task (K, N) recorded when it finished: the source's chunks, the bytes it read, its share's bytes."""
    return json.loads((output / _task_name(*task)).read_text())


def finish(output: Path, *, tasks: int, missing_ok: bool = False) -> dict[str, Any] | None:
    """The manifest of a preparation by `tasks` tasks, once every one has recorded that it is done (None
    with missing_ok while some have not)."""
    records = [output / _task_name(k, tasks) for k in range(tasks)]
    if missing := [r.name for r in records if not r.is_file()]:
        if missing_ok:
            return None
        raise ConfigError(
            f"--output: {output} lacks {', '.join(missing)}: those tasks have not finished; rerun them (each resumes "
            "where it stopped), then --finish"
        )
    counts = {json.loads(r.read_text())["chunks"] for r in records}
    if len(counts) != 1:
        raise ConfigError(
            f"--output: the tasks of {output} read inputs of different lengths ({sorted(counts)} chunks): did the "
            "source change during the preparation? Prepare it again into an empty folder"
        )
    return write_manifest(output, chunks=counts.pop())


def _task_name(task: int, tasks: int) -> str:
    return f"task-{task}-of-{tasks}.json"


# ------------------------------------------------------------------------ small parts


class _Progress:
    """A line every few seconds: input done, rate, tokens, and the share of this process's part of the input
    done with an ETA (when its size is known: not for a hub stream)."""

    def __init__(self, reading: Reading, report: Callable[[str], None] | None, every_s: float = 5.0):
        self.report, self.every_s, self.total = report, every_s, reading.share_bytes
        self.whole = reading.share == (0, 1)
        self.begin = self.last = time.perf_counter()
        self.bytes = self.tokens = 0

    def update(self, chunk: Chunk, record: dict[str, Any]) -> None:
        self.bytes += chunk.input_bytes
        self.tokens += record["tokens"]
        now = time.perf_counter()
        if self.report is None or now - self.last < self.every_s:
            return
        self.last = now
        rate = self.bytes / max(now - self.begin, 1e-9)
        line = f"{self.bytes / 1e6:,.1f} MB read, {rate / 1e6:,.2f} MB/s, {self.tokens:,} tokens"
        if self.total:
            left = (self.total - self.bytes) / max(rate, 1e-9)
            part = "the input" if self.whole else "this share of the input"
            line += f", {100 * self.bytes / self.total:.0f}% of {part}, ETA {_duration(left)}"
        self.report(line)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
