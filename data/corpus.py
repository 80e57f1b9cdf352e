"""A prepared corpus, memory-mapped, and how train.py gets one from whatever `[data] path` names.

The token stream is the shards back to back. Any range of it is a slice of one memory map (two
when it straddles a shard boundary): O(1), whatever the document lengths, with no Python work per
document. Where documents begin inside a range (for block-causal attention) is a binary search in
the shard's `doc_ends`.

`[data] path` may name a prepared folder (it has a manifest.json), or raw files. Raw files are
prepared at start-up into a cache folder keyed on the files, the tokenizer and the format, with
the ranks dividing the chunks; where the cache folder is not shared between nodes, each node
prepares its own copy. The folder appears under its key only once complete (a folder of the run's
own, renamed), so a refused, failed or killed preparation leaves nothing the next start reads or
trips on. Raw data too large for that (minutes of tokenizing) is refused with the exact
`scripts/prepare_data.py` command.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
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
    """A prepared folder's token stream: `read(start, n)` and `doc_starts(start, n)` in O(1).

    key: the config key that named the folder, for errors. cached_from: `data.path PATH` when the folder is
    train.py's cache of that raw data: the fix for a damaged one is then to delete it (the next start prepares it
    again), not a preparation by hand."""

    def __init__(self, folder: Path, *, key: str = "data.path", cached_from: str | None = None):
        self.folder = folder
        again = (
            f"delete {folder}, the cache of {cached_from}: the next start prepares it again"
            if cached_from
            else "prepare the data again"
        )
        try:
            self.manifest: dict[str, Any] = json.loads((folder / "manifest.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{key}: {folder}/manifest.json is unreadable ({e}); {again}") from None
        if self.manifest.get("format") != FORMAT:
            raise ConfigError(
                f"{key}: {folder} was prepared in format {self.manifest.get('format')!r}, this recipe reads {FORMAT!r}; "
                f"{again if cached_from else 'prepare it again with scripts/prepare_data.py'}"
            )
        self.tokens, self.doc_ends = [], []
        # Chat data (data/chat.py): per token, 1 where the loss counts it (an assistant's token), else 0.
        self.loss_masks: list[np.ndarray] | None = [] if self.manifest.get("chat") else None
        # Preference pairs (data/preference.py): documents 2k and 2k + 1 are pair k's chosen and rejected.
        self.pairs = bool(self.manifest["source"].get("pairs"))
        for shard in self.manifest["shards"]:
            tokens, ends = (self._open(folder / shard[f"{kind}_file"], key, again) for kind in ("tokens", "doc_ends"))
            mask = self._open(folder / shard["loss_mask_file"], key, again) if self.loss_masks is not None else tokens
            if len(tokens) != shard["tokens"] or len(ends) != shard["documents"] or len(mask) != len(tokens):
                raise ConfigError(f"{key}: {folder / shard['tokens_file']} does not match the manifest; {again}")
            self.tokens.append(tokens)
            self.doc_ends.append(ends)
            if self.loss_masks is not None:
                self.loss_masks.append(mask)
        self.shard_starts = np.cumsum([0] + [len(t) for t in self.tokens])  # stream offset of each shard
        self.num_tokens = int(self.shard_starts[-1])
        self.tokenizer_fingerprint: str = self.manifest["tokenizer"]["fingerprint"]
        self.fingerprint: str = self.manifest["fingerprint"]

    @staticmethod
    def _open(path: Path, key: str, again: str) -> np.ndarray:
        try:
            return np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}: {path} is missing or damaged ({e}); {again}") from None

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


def open_corpus(
    cfg: Data, tokenizer: Tokenizer, tokenizer_path: str, *, key: str = "data.path", pairs: bool = False
) -> TokenCorpus:
    """The corpus `[data] path` names; raw files are prepared into the cache first (a collective).

    Every rank calls it. Under torch.distributed the ranks share the tokenizing and wait for each other.
    key: the config key that named the path (validation.dataset_path for held-out data), for errors. pairs: its rows
    are preference pairs (dpo.enable; data/preference.py).
    """
    path = Path(cfg.path)
    if is_prepared(path):
        corpus = TokenCorpus(path, key=key)
        if corpus.pairs != pairs:
            raise ConfigError(
                f"dpo.enable: {path} holds preference pairs; set dpo.enable = true to train on them with DPO"
                if corpus.pairs
                else f"dpo.enable: {path} holds no preference pairs; prepare them with prepare_data.py --chat --pairs"
            )
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
    source = dataclasses.replace(raw_source(cfg, key=key, tokenizer_path=tokenizer_path), pairs=pairs)
    if source.format == "hub":  # not in the local cache: a stream is prepared once, never at every start
        raise ConfigError(not_cached(source, tokenizer=tokenizer_path))
    if source.input_bytes > MAX_RAW_BYTES:
        raise ConfigError(
            f"{key}: {cfg.path} is {source.input_bytes / 2**20:,.0f} MiB of raw text: too much to tokenize at every "
            f"start; prepare it once with `{prepare_command(cfg, tokenizer_path)}`, then set {key} to that --output folder"
        )
    from distributed import collective_on_every_rank

    # Another chat template renders other tokens: another cache folder.
    chat = chat_renderer(tokenizer_path).fingerprint if cfg.chat else None
    cache = cache_folder(cfg, tokenizer, source.describe(), chat=chat)
    if not _prepared_on_every_rank(cache):
        prepare_cache(source, tokenizer_path, cache)
    # A damaged cache on one node only is refused on every rank.
    named = f"{key} {cfg.path}"
    corpus = collective_on_every_rank(lambda: TokenCorpus(cache, key="data.cache_folder", cached_from=named))
    if nulls := corpus.manifest["null_documents"]:
        total = nulls + corpus.manifest["documents"]
        warn(f"{key}: {nulls:,} of {total:,} documents of {cfg.path} have no text (null); they are skipped")
    if pairs:
        from data.preference import warn_dropped

        warn_dropped(corpus.manifest["dropped"], path=cfg.path, pairs=corpus.manifest["documents"] // 2)
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


def _prepared_on_every_rank(cache: Path) -> bool:
    """Whether every rank finds `cache` prepared (a collective under torch.distributed). A node-local cache may be
    prepared on some nodes only (a node new to the job): then every rank takes part in preparing it, or the ranks
    that found theirs would go on alone and the others would wait for them in their first collective."""
    import torch.distributed as dist

    here = is_prepared(cache)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return here
    everyone = [False] * dist.get_world_size()
    dist.all_gather_object(everyone, here)
    return all(everyone)


def prepare_cache(source: Source, tokenizer_path: str, cache: Path) -> None:
    """Every rank tokenizes its share of the chunks; one writes the manifest and publishes the folder as `cache`.

    The work goes into a folder of this run's own beside `cache` (`<cache key>.partial-<run id>`), renamed to `cache`
    once its manifest is written: a refused or failed preparation removes its folder, a killed one leaves it under a
    name no run reads, and two runs that prepare the same data at once each write their own (the later keeps the
    earlier's: the same key, the same tokens). A step that can fail on some ranks only stops every rank with the same
    error (distributed.collective_on_every_rank), so that rank 0 tells it once and no rank is left waiting for another.

    Where the ranks do not all see one folder (a node-local cache on several nodes), each node prepares its own copy:
    its ranks share the chunks, its local rank 0 writes the manifest and publishes it.
    """
    import torch.distributed as dist

    from distributed import collective_on_every_rank as together

    several = dist.is_initialized() and dist.get_world_size() > 1
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if several else (0, 1)
    run_id = [uuid.uuid4().hex[:12] if rank == 0 else ""]
    if several:
        dist.broadcast_object_list(run_id, src=0)
    partial = cache.with_name(f"{cache.name}.partial-{run_id[0]}")
    leader = rank == 0

    def begin_here() -> None:
        begin(source, tokenizer_path, partial, chunk_bytes=CACHE_CHUNK_BYTES)  # prepare.json, before any rank reads it

    def check_and_begin() -> None:
        writable_folder(cache.parent, key="data.cache_folder")
        if cache.exists() and not is_prepared(cache):  # publishing renames a complete folder: never half of one
            raise ConfigError(
                f"data.cache_folder: {cache}, the cache of {source.key} {source.path}, holds an unfinished "
                "preparation (no manifest.json) that an older version of this recipe left; delete that folder, then "
                "start again"
            )
        if leader:
            begin_here()

    try:
        together(check_and_begin)
        if several:
            seen = [False] * ranks
            dist.all_gather_object(seen, (partial / "prepare.json").is_file())
            if not all(seen):  # one folder per node
                rank, ranks = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
                leader = rank == 0
                together(lambda: begin_here() if leader and not seen[dist.get_rank()] else None)
        chunks = together(
            lambda: tokenize(
                source, tokenizer_path, partial, workers=0, chunk_bytes=CACHE_CHUNK_BYTES, share=(rank, ranks),
                progress=_log,
            )
        )  # fmt: skip
        together(lambda: _publish(partial, cache, chunks=chunks, key=source.key) if leader else None)
    finally:
        if leader:  # every rank is done with it: each step above ends on every rank together
            shutil.rmtree(partial, ignore_errors=True)


def _publish(partial: Path, cache: Path, *, chunks: int, key: str) -> None:
    """Write `partial`'s manifest, then rename it to `cache`, unless another run published `cache` meanwhile."""
    write_manifest(partial, chunks=chunks, key=key)
    try:
        os.rename(partial, cache)
    except OSError:  # `cache` exists: the other run's copy is kept (this one is removed)
        if not is_prepared(cache):
            raise


def _log(message: str) -> None:
    if is_rank0():
        print(f"[data] {message}", flush=True)
