"""Tokenizers, the packed token stream, and the global-batch data loader.

The corpus is tokenized once (Hugging Face `datasets`, cached on disk), every document is
wrapped as [BOS] text [EOS], and the documents are read as one long token stream cut into
windows of seq_len + 1 tokens (inputs are a window's first seq_len tokens, labels its last).

Window i is found by binary search in the documents' cumulative lengths, so any window can
be read without reading the ones before it. The loader uses that to make a step's batch a
function of the step alone: global step k reads windows [k*G, (k+1)*G) for a global batch of
G sequences, and each data-parallel rank takes its own slice. A run on 1, 2 or 8 ranks sees
the same tokens at every step, and the loader's whole state is one integer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from config import Data
from errors import ConfigError, warn

# ------------------------------------------------------------------- tokenizers


class Tokenizer(Protocol):
    bos_id: int
    eos_id: int
    vocab_size: int
    fingerprint: str  # changes whenever the token ids a text maps to could change

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then BOS = 256 and EOS = 257. Needs no file."""

    bos_id, eos_id, vocab_size, fingerprint = 256, 257, 258, "byte-v1"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>")


class HFTokenizer:
    """A `tokenizer.json` (tokenizers library) or a Hugging Face tokenizer folder."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as FastTokenizer

        json_file = path if path.is_file() else path / "tokenizer.json"
        if not json_file.is_file():
            raise ConfigError(
                f"model.tokenizer_path: {path} has no tokenizer.json; point it at a tokenizer.json file "
                'or a Hugging Face tokenizer folder that contains one, or use "byte"'
            )
        try:
            self._tok = FastTokenizer.from_file(str(json_file))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise ConfigError(f"model.tokenizer_path: {json_file} is not a valid tokenizer.json ({e})") from None
        special = _special_tokens(path) if path.is_dir() else {}
        self.bos_id = self._find(special.get("bos_token"), _BOS_NAMES, json_file, "BOS")
        self.eos_id = self._find(special.get("eos_token"), _EOS_NAMES, json_file, "EOS")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.fingerprint = hashlib.sha256(json_file.read_bytes() + json.dumps(special).encode()).hexdigest()[:16]

    def _find(self, configured: str | None, names: tuple[str, ...], file: Path, what: str) -> int:
        for name in (configured, *names):
            if name is not None and (token_id := self._tok.token_to_id(name)) is not None:
                return token_id
        raise ConfigError(f"model.tokenizer_path: {file} defines no {what} token (looked for {', '.join(names)})")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def _special_tokens(folder: Path) -> dict[str, str]:
    """bos/eos names from a HF folder's tokenizer_config.json (Llama 3 instruct: eos = <|eot_id|>)."""
    out: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"model.tokenizer_path: {file} is not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise ConfigError(f"model.tokenizer_path: {file} is not a JSON object")
        for key in ("bos_token", "eos_token"):
            value = config.get(key)
            if isinstance(value, dict):  # {"content": "<|begin_of_text|>", ...}
                value = value.get("content")
            if isinstance(value, str):
                out[key] = value
    return out


def build_tokenizer(tokenizer_path: str) -> Tokenizer:
    if tokenizer_path == "byte":
        return ByteTokenizer()
    path = Path(tokenizer_path)
    if not path.exists():
        raise ConfigError(
            f'model.tokenizer_path: {path} not found; point it at a tokenizer.json or tokenizer folder, or use "byte"'
        )
    return HFTokenizer(path)


# --------------------------------------------------------------- packed corpus


_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text", ".md": "text"}


def _resolve_format(cfg: Data) -> str:
    if cfg.format != "auto":
        return cfg.format
    path = Path(cfg.path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    kinds = {_FORMATS.get(p.suffix.lower()) for p in files} - {None}
    if len(kinds) != 1:
        raise ConfigError(
            f"data.format: cannot tell the format of {path} from its file extensions; set data.format to json, parquet or text"
        )
    return kinds.pop()


def load_documents(cfg: Data):  # -> datasets.Dataset
    """The raw documents as a `datasets.Dataset`; hub names need data.format = "hub"."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    fmt = _resolve_format(cfg)
    empty = f"data.path: {cfg.path} holds no documents; point it at a non-empty dataset"
    try:
        if fmt == "hub":
            ds = datasets.load_dataset(cfg.path, split=cfg.split)
        else:
            path = Path(cfg.path)
            files = [p for p in sorted(path.rglob("*")) if p.is_file()] if path.is_dir() else [path]
            if all(p.stat().st_size == 0 for p in files):
                raise ConfigError(empty)
            # Plain text: one document per blank-line-separated paragraph.
            extra = {"sample_by": "paragraph"} if fmt == "text" else {}
            ds = datasets.load_dataset(fmt, data_files={cfg.split: [str(p) for p in files]}, split=cfg.split, **extra)
    except ConfigError:
        raise
    except Exception as e:  # datasets raises many types for unreadable input; name the cause
        cause = _root_cause(e)
        if isinstance(cause, UnicodeDecodeError):
            raise ConfigError(
                f"data.path: {cfg.path} is not UTF-8 text ({cause.reason} at byte {cause.start})"
            ) from None
        raise ConfigError(f"data.path: could not read {cfg.path} as {fmt} ({type(cause).__name__}: {cause})") from None
    if cfg.text_column not in ds.column_names:
        raise ConfigError(
            f"data.text_column: {cfg.path} has no column '{cfg.text_column}' (columns: {', '.join(ds.column_names)})"
        )
    kind = ds.features[cfg.text_column]
    if not isinstance(kind, datasets.Value) or kind.dtype not in ("string", "large_string", "null"):
        raise ConfigError(
            f"data.text_column: column '{cfg.text_column}' of {cfg.path} holds {kind}, not text; point "
            "data.text_column at the column with the documents"
        )
    if nulls := ds.data.column(cfg.text_column).null_count:
        warn(f"data.path: {nulls:,} of {len(ds):,} documents of {cfg.path} have no text (null); they are skipped")
        ds = ds.filter(lambda text: text is not None, input_columns=cfg.text_column)
    if len(ds) == 0:
        raise ConfigError(empty)
    return ds


def _root_cause(e: BaseException) -> BaseException:
    while (inner := e.__cause__ or e.__context__) is not None and inner is not e:
        e = inner
    return e


class PackedCorpus:
    """A tokenized corpus read as consecutive windows of `window` tokens, wrapping around."""

    def __init__(self, cfg: Data, tokenizer: Tokenizer, *, window: int):
        docs = load_documents(cfg)
        bos, eos, column = tokenizer.bos_id, tokenizer.eos_id, cfg.text_column

        def tokenize(batch: dict[str, list]) -> dict[str, list]:
            ids = [[bos, *x, eos] for x in tokenizer.encode_batch(batch[column])]
            return {"ids": ids, "num_tokens": [len(x) for x in ids]}

        # An explicit fingerprint makes the on-disk cache hit on every rank and every rerun
        # (datasets cannot hash a closure over a tokenizer object reliably).
        fingerprint = hashlib.sha256(f"{docs._fingerprint}|{tokenizer.fingerprint}|{column}".encode()).hexdigest()[:16]
        self._ids = docs.map(
            tokenize, batched=True, remove_columns=docs.column_names, new_fingerprint=fingerprint, desc="tokenizing"
        )
        self._ends = np.cumsum(
            np.asarray(self._ids["num_tokens"], dtype=np.int64)
        )  # token offset where each document ends
        self.num_tokens = int(self._ends[-1])
        self.window = window
        self.num_windows = self.num_tokens // window
        if self.num_windows == 0:
            raise ConfigError(
                f"data.path: {cfg.path} holds {self.num_tokens} tokens, fewer than one sequence of "
                f"training.seq_len + 1 = {window}; lower training.seq_len or add data"
            )

    def __getitem__(self, index: int) -> np.ndarray:
        """Window `index` (taken modulo the number of windows: epochs simply wrap around)."""
        start = (index % self.num_windows) * self.window
        end = start + self.window
        first = int(np.searchsorted(self._ends, start, side="right"))
        last = int(np.searchsorted(self._ends, end - 1, side="right"))
        docs = self._ids[first : last + 1]["ids"]
        doc_start = int(self._ends[first - 1]) if first else 0
        tokens = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs])
        return tokens[start - doc_start : end - doc_start]


# ------------------------------------------------------------------ the loader


@dataclass
class GlobalBatchLoader:
    """Yields this rank's micro-batches of each optimizer step.

    A step consumes `global_batch_size` sequences. They are split into `grad_accum`
    micro-batches of `local_batch_size x dp_degree` sequences each, and rank r takes rows
    [r * local_batch_size, (r + 1) * local_batch_size) of every micro-batch. Which sequences a
    step sees therefore depends on the global batch size only, never on the number of ranks.
    """

    corpus: PackedCorpus
    local_batch_size: int
    global_batch_size: int
    dp_rank: int
    dp_degree: int
    sample_index: int = 0  # sequences consumed by all ranks together: the checkpointed state

    def __post_init__(self) -> None:
        per_micro = self.local_batch_size * self.dp_degree
        if self.global_batch_size % per_micro:
            raise ConfigError(
                f"training.global_batch_size: {self.global_batch_size} is not a multiple of local_batch_size "
                f"{self.local_batch_size} x data-parallel degree {self.dp_degree}; use a multiple of {per_micro} or -1"
            )
        self.grad_accum = self.global_batch_size // per_micro

    def next_step(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, labels) of shape (local_batch_size, seq_len), grad_accum times."""
        base = self.sample_index
        self.sample_index += self.global_batch_size
        per_micro = self.local_batch_size * self.dp_degree
        for micro in range(self.grad_accum):
            first = base + micro * per_micro + self.dp_rank * self.local_batch_size
            rows = np.stack([self.corpus[first + j] for j in range(self.local_batch_size)])
            batch = torch.from_numpy(rows)
            yield batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"sample_index": self.sample_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sample_index = int(state["sample_index"])
