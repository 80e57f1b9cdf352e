"""Tokenizers: a `tokenizer.json` or Hugging Face tokenizer folder, or the built-in byte tokenizer.

Every tokenizer has BOS and EOS ids (documents are packed as BOS text EOS) and a fingerprint that
changes whenever the ids a text maps to could change; prepared data records it, so that data
tokenized by one tokenizer is never trained with another.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol

from errors import ConfigError


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

    def __init__(self, path: Path, *, key: str = "model.tokenizer_path"):
        from tokenizers import Tokenizer as FastTokenizer

        self.key = key
        json_file = path if path.is_file() else path / "tokenizer.json"
        if not json_file.is_file():
            raise ConfigError(
                f"{key}: {path} has no tokenizer.json; point it at a tokenizer.json file "
                'or a Hugging Face tokenizer folder that contains one, or use "byte"'
            )
        try:
            self._tok = FastTokenizer.from_file(str(json_file))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise ConfigError(f"{key}: {json_file} is not a valid tokenizer.json ({e})") from None
        special = _special_tokens(path, key=key) if path.is_dir() else {}
        self.bos_id = self._find(special.get("bos_token"), _BOS_NAMES, json_file, "BOS")
        self.eos_id = self._find(special.get("eos_token"), _EOS_NAMES, json_file, "EOS")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.fingerprint = hashlib.sha256(json_file.read_bytes() + json.dumps(special).encode()).hexdigest()[:16]

    def _find(self, configured: str | None, names: tuple[str, ...], file: Path, what: str) -> int:
        for name in (configured, *names):
            if name is not None and (token_id := self._tok.token_to_id(name)) is not None:
                return token_id
        raise ConfigError(f"{self.key}: {file} defines no {what} token (looked for {', '.join(names)})")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Each text's ids and, per token, the [start, end) characters of the text it covers (the chat mask)."""
        return [(e.ids, e.offsets) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def _special_tokens(folder: Path, *, key: str) -> dict[str, str]:
    """bos/eos names from a HF folder's tokenizer_config.json (Llama 3 instruct: eos = <|eot_id|>)."""
    out: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{key}: {file} is not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{key}: {file} is not a JSON object")
        for token in ("bos_token", "eos_token"):
            value = config.get(token)
            if isinstance(value, dict):  # {"content": "<|begin_of_text|>", ...}
                value = value.get("content")
            if isinstance(value, str):
                out[token] = value
    return out


def build_tokenizer(tokenizer_path: str, *, key: str = "model.tokenizer_path") -> Tokenizer:
    """The tokenizer at `tokenizer_path`; key: the setting that named it, for errors (a script's flag)."""
    if tokenizer_path == "byte":
        return ByteTokenizer()
    path = Path(tokenizer_path)
    if not path.exists():
        raise ConfigError(f'{key}: {path} not found; point it at a tokenizer.json or tokenizer folder, or use "byte"')
    return HFTokenizer(path, key=key)
