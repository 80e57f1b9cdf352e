"""Tokenizers: a `tokenizer.json` or Hugging Face tokenizer folder, or the built-in byte tokenizer.

How a text is framed is the tokenizer's own rule, read from its files and written here once (`Framing`):

    a prompt    the ids its post-processor puts around a text: what transformers' `tokenizer(text)` gives
                (Llama 3: <|begin_of_text|> text; SmolLM2, Qwen3: text alone)
    a document  the same, closed by its eos_token, as the family was pretrained (Llama 3:
                <|begin_of_text|> doc <|end_of_text|>; a Qwen3 base folder: doc <|endoftext|>)

The post-processor is tokenizer.json's, unless tokenizer_config.json sets add_bos_token / add_eos_token:
then, as transformers does, those flags decide. No BOS is ever looked up by name: a tokenizer that adds
none frames with none. The byte tokenizer and the shipped tokenizer frame as Llama 3.

Every tokenizer has a fingerprint that changes whenever the ids a text or a document maps to could change
(the files and the framing); prepared data records it, so that data tokenized or framed one way is never
trained as another.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from errors import ConfigError


@dataclass(frozen=True)
class Framing:
    """The ids a tokenizer puts before and after a text (its post-processor's), and its end-of-text id."""

    before: tuple[int, ...]
    after: tuple[int, ...]
    eos: int

    def prompt(self, ids: list[int]) -> list[int]:
        """A prompt's ids, as transformers' `tokenizer(text)` frames the text."""
        return [*self.before, *ids, *self.after]

    @property
    def closing(self) -> tuple[int, ...]:
        """What follows a document's text: the post-processor's ids, then end-of-text unless they end with it."""
        return self.after if self.after[-1:] == (self.eos,) else (*self.after, self.eos)

    def document(self, ids: list[int]) -> list[int]:
        """A document's ids as the family was pretrained on it, for a corpus of documents back to back."""
        return [*self.before, *ids, *self.closing]

    def describe(self) -> dict[str, list[int]]:
        return {"before": list(self.before), "after": list(self.after), "eos": [self.eos]}


class Tokenizer(Protocol):
    eos_id: int
    vocab_size: int
    framing: Framing
    fingerprint: str  # changes whenever the token ids a text or a document maps to could change

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then BOS = 256 and EOS = 257, framed as Llama 3. Needs no file."""

    eos_id, vocab_size, fingerprint = 257, 258, "byte-v1"
    framing = Framing(before=(256,), after=(), eos=257)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


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
        # The BOS it names (lm-eval scores an empty context after it), never one guessed by name.
        self.bos_id = self._tok.token_to_id(special["bos_token"]) if "bos_token" in special else None
        self.eos_id = self._find_eos(special.get("eos_token"), json_file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.framing = self._framing(special, json_file)
        what = json_file.read_bytes() + json.dumps(special).encode() + json.dumps(self.framing.describe()).encode()
        self.fingerprint = hashlib.sha256(what).hexdigest()[:16]

    def _find_eos(self, configured: str | None, file: Path) -> int:
        for name in (configured, *_EOS_NAMES):  # (a bare tokenizer.json names no EOS: its end-of-text by name)
            if name is not None and (token_id := self._tok.token_to_id(name)) is not None:
                return token_id
        raise ConfigError(
            f"{self.key}: {file} defines no end-of-text token (looked for {', '.join(_EOS_NAMES)}); name it as "
            "eos_token in the folder's tokenizer_config.json"
        )

    def _framing(self, special: dict, file: Path) -> Framing:
        """The ids around a text: tokenizer_config.json's add_bos_token / add_eos_token when it sets either
        (transformers then rebuilds the post-processor from them), else tokenizer.json's post-processor."""
        if "add_bos_token" in special or "add_eos_token" in special:
            bos = (self.bos_id,) if special.get("add_bos_token") and self.bos_id is not None else ()
            eos = (self.eos_id,) if special.get("add_eos_token") and "eos_token" in special else ()
            return Framing(before=bos, after=eos, eos=self.eos_id)
        probe = "Once upon a time"
        plain = self._tok.encode(probe, add_special_tokens=False).ids
        framed = self._tok.encode(probe).ids
        at = next((i for i in range(len(framed) - len(plain) + 1) if framed[i : i + len(plain)] == plain), None)
        if at is None:
            raise ConfigError(
                f"{self.key}: {file}'s post-processor changes a text's own tokens, not only what surrounds them; "
                "use a tokenizer whose post-processor adds special tokens around the text (or none)"
            )
        return Framing(before=tuple(framed[:at]), after=tuple(framed[at + len(plain) :]), eos=self.eos_id)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Each text's ids and, per token, the [start, end) characters of the text it covers (the chat mask)."""
        return [(e.ids, e.offsets) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def vocab(self) -> dict[str, int]:
        """Every token and its id, added tokens included (distill.py compares a teacher's with the student's)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def _special_tokens(folder: Path, *, key: str) -> dict[str, str | bool]:
    """bos/eos names and add_bos_token / add_eos_token from a HF folder's tokenizer_config.json (Llama 3 instruct:
    eos = <|eot_id|>; Qwen3: no bos_token)."""
    out: dict[str, str | bool] = {}
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
        for flag in ("add_bos_token", "add_eos_token"):
            if isinstance(config.get(flag), bool):
                out[flag] = config[flag]
    return out


def build_tokenizer(tokenizer_path: str, *, key: str = "model.tokenizer_path") -> Tokenizer:
    """The tokenizer at `tokenizer_path`; key: the setting that named it, for errors (a script's flag)."""
    if tokenizer_path == "byte":
        return ByteTokenizer()
    path = Path(tokenizer_path)
    if not path.exists():
        raise ConfigError(f'{key}: {path} not found; point it at a tokenizer.json or tokenizer folder, or use "byte"')
    return HFTokenizer(path, key=key)
