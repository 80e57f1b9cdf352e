"""A prepared corpus, memory-mapped, and how train.py gets one from whatever `[data] path` names.

The token stream is the shards back to back. Any range of it is a slice of one memory map (two
when it straddles a shard boundary): O(1), whatever the document lengths, with no Python work per
document. Where documents begin inside a range (for block-causal attention) is a binary search in
the shard's `doc_ends`.

`[data] path` may name a prepared folder (it has a manifest.json), or raw files. Raw files are
prepared at start-up into a cache folder keyed on the files, the tokenizer and the format, with
the ranks dividing the chunks; where the cache folder is not shared between nodes, each node
prepares its own copy. Raw data too large for that (minutes of tokenizing) is refused with the
exact `scripts/prepare_data.py` command.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from config import Data
from data.chat import chat_renderer
from data.prepare import FORMAT, begin, is_prepared, tokenize, write_manifest
from data.sources import Source, find_source, not_cached
from data.sources import prepare_command as source_command
from data.tokenizers import Tokenizer
from errors import ConfigError, is_rank0, warn, writable_folder

# Raw data above this is refused at start-up: ~3 MB/s of text per core means minutes of tokenizing.
MAX_RAW_BYTES = 256 * 2**20
# Small chunks for the cache, so that the ranks have several each to share.
CACHE_CHUNK_BYTES = 2**20


class TokenCorpus:
    """A prepared folder's token stream: `read(start, n)` and `doc_starts(start, n)` in O(1)."""

    def __init__(self, folder: Path, *, key: str = "data.path"):
        self.folder = folder
        try:
            self.manifest: dict[str, Any] = json.loads((folder / "manifest.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{key}: {folder}/manifest.json is unreadable ({e}); prepare the data again") from None
        if self.manifest.get("format") != FORMAT:
            raise ConfigError(
                f"{key}: {folder} was prepared in format {self.manifest.get('format')!r}, this recipe reads {FORMAT!r}; "
                "prepare it again with scripts/prepare_data.py"
            )
        self.tokens, self.doc_ends = [], []
        # Chat data (data/chat.py): per token, 1 where the loss counts it (an assistant's token), else 0.
        self.loss_masks: list[np.ndarray] | None = [] if self.manifest.get("chat") else None
        for shard in self.manifest["shards"]:
            tokens, ends = (self._open(folder / shard[f"{kind}_file"], key) for kind in ("tokens", "doc_ends"))
            mask = self._open(folder / shard["loss_mask_file"], key) if self.loss_masks is not None else tokens
            if len(tokens) != shard["tokens"] or len(ends) != shard["documents"] or len(mask) != len(tokens):
                raise ConfigError(
                    f"{key}: {folder / shard['tokens_file']} does not match the manifest; prepare the data again"
                )
            self.tokens.append(tokens)
            self.doc_ends.append(ends)
            if self.loss_masks is not None:
                self.loss_masks.append(mask)
        self.shard_starts = np.cumsum([0] + [len(t) for t in self.tokens])  # stream offset of each shard
        self.num_tokens = int(self.shard_starts[-1])
        self.tokenizer_fingerprint: str = self.manifest["tokenizer"]["fingerprint"]
        self.fingerprint: str = self.manifest["fingerprint"]

    @staticmethod
    def _open(path: Path, key: str) -> np.ndarray:
        try:
            return np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}: {path} is missing or damaged ({e}); prepare the data again") from None

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream as int64."""
        return self._read(self.tokens, start, length, np.int64)

    def read_mask(self, start: int, length: int) -> np.ndarray:
        """The loss mask of tokens [start, start + length) (chat data only), uint8."""
        assert self.loss_masks is not None, "only chat data has a loss mask"
        return self._read(self.loss_masks, start, length, np.uint8)

    def _read(self, shards: list[np.ndarray], start: int, length: int, dtype: type) -> np.ndarray:
        out = np.empty(length, dtype=dtype)
        done = 0
        while done < length:
            shard = int(np.searchsorted(self.shard_starts, start + done, side="right")) - 1
            offset = start + done - int(self.shard_starts[shard])
            take = min(length - done, len(shards[shard]) - offset)
            out[done : done + take] = shards[shard][offset : offset + take]
            done += take
        return out

    def doc_starts(self, start: int, length: int) -> np.ndarray:
        """Offsets, relative to `start`, of the documents that begin in [start, start + length)."""
        found = []
        position = start
        while position < start + length:
            shard = int(np.searchsorted(self.shard_starts, position, side="right")) - 1
            base = int(self.shard_starts[shard])
            lo, hi = position - base, min(start + length - base, len(self.tokens[shard]))
            # A shard's documents begin at 0 and where each one but the last ends.
            begins = self.doc_ends[shard][:-1]
            inside = begins[int(np.searchsorted(begins, lo)) : int(np.searchsorted(begins, hi))]
            found.append([b + base - start for b in ([0] if lo == 0 else []) + inside.tolist()])
            position = base + hi
        return np.array([b for part in found for b in part], dtype=np.int64)


# ------------------------------------------------------------------ train.py's corpus


def open_corpus(cfg: Data, tokenizer: Tokenizer, tokenizer_path: str, *, key: str = "data.path") -> TokenCorpus:
    """The corpus `[data] path` names; raw files are prepared into the cache first (a collective).

    Every rank calls it. Under torch.distributed the ranks share the tokenizing and wait for each other.
    key: the config key that named the path (validation.dataset_path for held-out data), for errors.
    """
    path = Path(cfg.path)
    if is_prepared(path):
        corpus = TokenCorpus(path, key=key)
        if (corpus.loss_masks is not None) != cfg.chat:
            what = "chat data (a loss mask beside the tokens)" if cfg.chat else "plain text"
            raise ConfigError(
                f"data.chat: {path} was not prepared as {what}; set data.chat = {str(not cfg.chat).lower()}, or "
                f"prepare it again{' with prepare_data.py --chat' if cfg.chat else ''}"
            )
        if corpus.tokenizer_fingerprint != tokenizer.fingerprint and "framing" not in corpus.manifest["tokenizer"]:
            raise ConfigError(
                f"{key}: {path} was prepared before documents were framed as their tokenizer frames them "
                f"(data/tokenizers.py); prepare it again with `{reprepare_command(corpus.manifest, tokenizer_path)}` "
                f"and set {key} to that --output folder"
            )
        if corpus.tokenizer_fingerprint != tokenizer.fingerprint:
            raise ConfigError(
                f"{key}: {path} was tokenized by {corpus.manifest['tokenizer']['path']}, not by "
                f"model.tokenizer_path; point model.tokenizer_path at that tokenizer, or prepare the data again"
            )
        return corpus
    source = raw_source(cfg, key=key, tokenizer_path=tokenizer_path)
    if source.format == "hub":  # not in the local cache: a stream is prepared once, never at every start
        raise ConfigError(not_cached(source, tokenizer=tokenizer_path))
    if source.input_bytes > MAX_RAW_BYTES:
        raise ConfigError(
            f"{key}: {cfg.path} is {source.input_bytes / 2**20:,.0f} MiB of raw text: too much to tokenize at every "
            f"start; prepare it once with `{prepare_command(cfg, tokenizer_path)}`, then set {key} to that --output folder"
        )
    # Another chat template renders other tokens: another cache folder.
    chat = chat_renderer(tokenizer_path).fingerprint if cfg.chat else None
    cache = cache_folder(cfg, tokenizer, source.describe(), chat=chat)
    if not is_prepared(cache):
        writable_folder(cache, key="data.cache_folder")
        _prepare_shared(source, tokenizer_path, cache)
    corpus = TokenCorpus(cache, key=key)
    if nulls := corpus.manifest["null_documents"]:
        total = nulls + corpus.manifest["documents"]
        warn(f"{key}: {nulls:,} of {total:,} documents of {cfg.path} have no text (null); they are skipped")
    return corpus


def corpus_size(cfg: Data, tokenizer: Tokenizer) -> tuple[int, bool]:
    """(tokens, exact) of the corpus `[data] path` names, without tokenizing: from its manifest (a
    prepared folder, or raw data already in the cache), else about 4 bytes of raw text per token."""
    path = Path(cfg.path)
    if is_prepared(path):
        return int(json.loads((path / "manifest.json").read_text())["tokens"]), True
    source = raw_source(cfg, key="data.path")
    if source.format == "hub":
        return 0, False
    cache = cache_folder(cfg, tokenizer, source.describe())
    if is_prepared(cache):
        return int(json.loads((cache / "manifest.json").read_text())["tokens"]), True
    return source.input_bytes // 4, False


def prepare_command(cfg: Data, tokenizer_path: str) -> str:
    """The scripts/prepare_data.py command that prepares what `[data] path` names (with --format hub, a hub stream)."""
    return source_command(
        cfg.path, hub=cfg.format == "hub", name=cfg.name, split=cfg.split, text_column=cfg.text_column,
        tokenizer=tokenizer_path,
    )  # fmt: skip


def reprepare_command(manifest: dict[str, Any], tokenizer_path: str) -> str:
    """The scripts/prepare_data.py command that prepares a prepared folder's source again."""
    source = manifest["source"]
    command = source_command(
        source["path"], hub=source["format"] == "hub", name=source.get("name"), split=source["split"],
        text_column=source["text_column"], tokenizer=tokenizer_path,
    )  # fmt: skip
    return command + (" --chat" if manifest.get("chat") else "")


def raw_source(cfg: Data, *, key: str, tokenizer_path: str = "TOKENIZER") -> Source:
    """The raw files `[data] path` names (a dataset name: its copy in the local Hugging Face cache); chat data
    reads data.messages_column. tokenizer_path: for the command a refusal gives."""
    column = cfg.messages_column if cfg.chat else cfg.text_column
    source = find_source(
        cfg.path, fmt=cfg.format, text_column=column, name=cfg.name, split=cfg.split, key=key, tokenizer=tokenizer_path
    )
    return dataclasses.replace(source, chat=cfg.chat)


def cache_folder(cfg: Data, tokenizer: Tokenizer, source: dict[str, Any], *, chat: str | None = None) -> Path:
    what = {"format": FORMAT, "source": source, "tokenizer": tokenizer.fingerprint, "chunk_bytes": CACHE_CHUNK_BYTES}
    what |= {"chat": chat} if chat else {}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cfg.cache_folder).expanduser() / digest


def _prepare_shared(source: Any, tokenizer_path: str, cache: Path) -> None:
    """Every rank tokenizes its share of the chunks into `cache`; then one writes the manifest.

    Where the ranks do not all see one folder (a node-local cache on several nodes), each node
    prepares its own copy: its ranks share the chunks, its local rank 0 writes the manifest.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        chunks = tokenize(source, tokenizer_path, cache, workers=0, chunk_bytes=CACHE_CHUNK_BYTES, progress=_log)
        write_manifest(cache, chunks=chunks)
        return
    cache.mkdir(parents=True, exist_ok=True)
    probe = [f".shared-{uuid.uuid4().hex}" if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(probe, src=0)
    if dist.get_rank() == 0:
        (cache / probe[0]).touch()
    dist.barrier()
    seen = [False] * dist.get_world_size()
    dist.all_gather_object(seen, (cache / probe[0]).exists())
    dist.barrier()
    if dist.get_rank() == 0:
        (cache / probe[0]).unlink()
    if all(seen):  # one folder for everyone
        rank, ranks, leader = dist.get_rank(), dist.get_world_size(), dist.get_rank() == 0
    else:  # one folder per node
        rank, ranks = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        leader = rank == 0
    if leader:
        begin(source, tokenizer_path, cache, chunk_bytes=CACHE_CHUNK_BYTES)  # prepare.json, before any rank checks it
    dist.barrier()
    chunks, problems = 0, None
    try:
        chunks = tokenize(
            source, tokenizer_path, cache, workers=0, chunk_bytes=CACHE_CHUNK_BYTES, share=(rank, ranks), progress=_log
        )
    except ConfigError as e:  # bad input in this rank's chunks: every rank must stop, not wait
        problems = e.problems
    everyone: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    if found := next((p for p in everyone if p), None):
        raise ConfigError(*found)
    if leader:
        write_manifest(cache, chunks=chunks)
    dist.barrier()


def _log(message: str) -> None:
    if is_rank0():
        print(f"[data] {message}", flush=True)
