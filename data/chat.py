"""Chat samples: a conversation rendered with the tokenizer folder's chat template, and the tokens the loss counts.

A chat row ([data] chat = true) is a list of messages, OpenAI-style: {"role": "system" | "user" |
"assistant" | ..., "content": text}. It is rendered by the tokenizer folder's chat template
(transformers' `apply_chat_template`: the template the model will be prompted with), then
tokenized. Only what the assistant says counts in the loss: each reply and the token that closes
it (EOS, Llama 3's <|eot_id|>, Qwen3's <|im_end|>), never the system prompt, the user's turns or
the role headers.

Which tokens are the assistant's comes from the template, one of three ways:

  * It marks what the assistant says with {% generation %} ... {% endgeneration %}: transformers renders it and
    masks the tokens of the marked characters (`apply_chat_template(..., return_assistant_tokens_mask=True)`), and
    its ids must be the ones our tokenizer gives the rendered text (tokenized as transformers does, no special
    tokens added).
  * A model family knows it (ModelFamily.training_chat_templates, by the template's exact text): the family's
    marked training variant of it is rendered the same way. It renders the same text as the template (the ids
    are checked against our tokenization of the template's own rendering), so thinking blocks are kept or
    dropped exactly as the template keeps or drops them. This is how a template that renders earlier turns
    differently once more follow (Qwen3's drops earlier turns' reasoning) is trained on.
  * Otherwise, from its renderings alone: the conversation before turn i, rendered with the generation prompt
    (what a model sees before it answers), is a prefix of the conversation through turn i, and the characters
    between the two are turn i's reply; a token is the assistant's when it covers a character of a reply (the
    rule transformers applies to the marks, which tests/test_chat.py checks we match). A template for which
    this fails is refused in one line that says how to mark it.

Prepared chat data stores a loss mask beside the tokens (data/prepare.py): 1 where a token is the
assistant's. The label of position t is token t + 1, and counts when that token's mask is 1
(data/loader.py puts IGNORE_INDEX elsewhere).
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path
from typing import Any

import numpy as np

from errors import ConfigError, warn

IGNORE_INDEX = -100  # the label of a position the loss skips (torch's cross_entropy default)
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")  # a template's marks, as transformers finds them


class ChatRenderer:
    """Renders conversations with the chat template of `tokenizer_path` into (token ids, loss mask)."""

    def __init__(self, tokenizer_path: str, *, key: str = "model.tokenizer_path"):
        from transformers import AutoTokenizer

        from data.tokenizers import HFTokenizer

        folder = Path(tokenizer_path)
        hf = AutoTokenizer.from_pretrained(str(folder)) if folder.is_dir() else None
        template = getattr(hf, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise ConfigError(
                f"data.chat: {key} {tokenizer_path} has no chat template (tokenizer_config.json's chat_template); "
                "use the tokenizer folder of an instruct model, or set data.chat = false to train on plain text"
            )
        self._hf, self.path = hf, tokenizer_path
        self.tokenizer = HFTokenizer(folder, key=key)
        # The template whose {% generation %} marks give the mask: the folder's own, or a family's variant of it.
        self.marked: str | None = template if GENERATION_MARK.search(template) else None
        self.marked_by: str | None = None  # the family whose variant it is
        if self.marked is None and (known := training_variant(template)) is not None:
            self.marked_by, self.marked = known
        # Another template, another tokenizer, or another way of finding the replies renders other tokens or
        # another mask: prepared data records this.
        what = self.tokenizer.fingerprint + template
        if self.marked is not None:
            what += "\n{% generation %} marks:\n" + self.marked
        self.fingerprint = hashlib.sha256(what.encode()).hexdigest()[:16]

    def _render(self, messages: list[dict[str, Any]], *, generation_prompt: bool = False) -> str:
        return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def replies(self, messages: list[dict[str, Any]], *, where: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the [start, end) characters of each assistant reply in it, found from the
        template's renderings alone (a template without marks)."""
        check_messages(messages, where=where)
        whole = self._render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:i], generation_prompt=True)
            through = self._render(messages[: i + 1])
            if not (through.startswith(before) and whole.startswith(through)):
                raise ConfigError(
                    f"data.chat: the chat template of {self.path} renders the turns before assistant turn {i} of "
                    f"{where} differently once more turns follow, so its reply cannot be told apart, and no model "
                    "family has a training variant of it; mark what the assistant says in the template with "
                    "{% generation %} ... {% endgeneration %} (the folder's chat_template.jinja or "
                    "tokenizer_config.json's chat_template, its rendering unchanged), or use a template that renders "
                    "each turn the same whatever follows"
                )
            spans.append((len(before), len(through)))
        return whole, spans

    def render(self, messages: list[dict[str, Any]], *, where: str) -> tuple[list[int], np.ndarray]:
        """Token ids of the conversation and its loss mask (uint8, 1 on the assistant's tokens)."""
        if self.marked is None:
            text, spans = self.replies(messages, where=where)
            ((ids, offsets),) = self.tokenizer.encode_with_offsets([text])
            return ids, assistant_mask(offsets, spans)
        check_messages(messages, where=where)
        out = self._hf.apply_chat_template(
            messages, chat_template=self.marked, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        text = self._render(messages)  # the template's own rendering: what the model is prompted with
        (ids,) = self.tokenizer.encode_batch([text])
        if ids != list(out["input_ids"]):
            raise self._mismatch(messages, text, where=where)
        return ids, np.asarray(out["assistant_masks"], dtype=np.uint8)

    def _mismatch(self, messages: list[dict[str, Any]], text: str, *, where: str) -> ConfigError:
        """Why transformers' ids of a conversation are not ours: another rendering, or another tokenization."""
        if self.marked_by is not None and (
            self._hf.apply_chat_template(messages, chat_template=self.marked, tokenize=False) != text
        ):
            return ConfigError(
                f"data.chat: models/{self.marked_by}/'s training variant of the chat template of {self.path} renders "
                f"{where} differently from the template; mark the replies in the folder's own chat_template with "
                "{% generation %} ... {% endgeneration %} instead"
            )
        return ConfigError(
            f"data.chat: transformers' tokenizer of {self.path} tokenizes {where} differently from its "
            "tokenizer.json; use a folder whose tokenizer_config.json loads that tokenizer.json unchanged "
            '(tokenizer_class "PreTrainedTokenizerFast")'
        )


def training_variant(template: str) -> tuple[str, str] | None:
    """(family, its marked training variant) of a chat template a model family knows (models/<family>/), or None."""
    from models import NAMES, family

    for name in NAMES:
        if (variant := family(name).training_chat_templates.get(template)) is not None:
            return name, variant
    return None


@functools.lru_cache(maxsize=4)
def chat_renderer(tokenizer_path: str) -> ChatRenderer:
    """The renderer of `tokenizer_path`, built once per process (transformers' import and tokenizer load take seconds)."""
    return ChatRenderer(tokenizer_path)


def assistant_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters [start, end) overlap a reply's span, else 0 (uint8)."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if not offsets:
        return mask
    starts, ends = np.array(offsets, dtype=np.int64).T
    for begin, end in spans:
        mask[(ends > begin) & (starts < end)] = 1
    return mask


def check_messages(messages: Any, *, where: str) -> None:
    """A conversation: a list of {"role": str, "content": str}; one line naming the row otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(
            f"data.messages_column: {where} holds {type(messages).__name__}, not a list of messages; point "
            "data.messages_column at the column of [{role, content}, ...] lists"
        )
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            raise ConfigError(f"data.messages_column: {where} has a message without a role: {str(message)[:80]}")
        if not isinstance(message.get("content"), str):
            raise ConfigError(
                f"data.messages_column: {where} has a {message['role']} message whose content is not text "
                f"({type(message.get('content')).__name__})"
            )


# ------------------------------------------------------------------ the windows of a chat corpus


class ChatWindows:
    """A prepared chat corpus as windows of `window` tokens, each holding whole samples.

    Packed (the default): samples in corpus order fill a window until the next one does not fit,
    which opens the next window; the rest of a window is padding. block_causal attention keeps the
    samples of a window apart (each is its own document). Padded (`pad`): one sample per window. A
    sample longer than the window is cut to it. Padding is EOS, a document of its own, never counted
    in the loss. The packing is computed once from the documents' lengths (O(documents)).
    """

    def __init__(self, corpus: Any, window: int, *, pad: bool = False):
        self.corpus, self.window = corpus, window
        starts, lengths, loss_sums, first_counted = [], [], [], []
        self.cut = 0  # samples longer than the window, cut to it
        for shard, (ends, mask) in enumerate(zip(corpus.doc_ends, corpus.loss_masks, strict=True)):
            begin = np.concatenate([[0], ends[:-1]]).astype(np.int64)
            length = np.minimum(ends - begin, window)
            # Loss tokens of each (cut) document: whole documents at once, the cut ones one by one.
            sums = np.add.reduceat(mask, begin, dtype=np.int64) if len(begin) else np.zeros(0, np.int64)
            for i in np.flatnonzero(ends - begin > window):
                sums[i] = int(mask[begin[i] : begin[i] + window].sum())
                self.cut += 1
            starts.append(begin + int(corpus.shard_starts[shard]))
            lengths.append(length)
            loss_sums.append(sums)
            first_counted.append(mask[begin] if len(begin) else np.zeros(0, np.uint8))
        self.starts, self.lengths = np.concatenate(starts), np.concatenate(lengths)
        self.first = self._pack(pad)  # first document of each window, then one past the last
        doc_sums, firsts = np.concatenate(loss_sums), np.concatenate(first_counted).astype(np.int64)
        # A window's counted labels: its documents' loss tokens but its first token's (no position predicts it).
        per_window = np.add.reduceat(doc_sums, self.first[:-1]) if len(doc_sums) else np.zeros(0, np.int64)
        self.labelled = per_window - firsts[self.first[:-1]]
        self.count = len(self.first) - 1
        self.pad_id = int(corpus.manifest["tokenizer"]["eos_id"])
        if self.cut:
            warn(
                f"data.chat: {self.cut:,} of {len(self.lengths):,} conversations of {corpus.folder} are longer than "
                f"training.seq_len + 1 = {window} tokens and are cut to it; raise training.seq_len to keep them whole"
            )

    def _pack(self, pad: bool) -> np.ndarray:
        if pad:
            return np.arange(len(self.lengths) + 1)
        first, used = [0], 0
        for i, length in enumerate(self.lengths.tolist()):
            if used + length > self.window:
                first.append(i)
                used = 0
            used += length
        return np.array([*first, len(self.lengths)])

    def get(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, document index per token, loss mask) of window j, padded to the window."""
        tokens = np.full(self.window, self.pad_id, dtype=np.int64)
        segments = np.empty(self.window, dtype=np.int32)
        mask = np.zeros(self.window, dtype=np.uint8)
        at = 0
        docs = range(int(self.first[j]), int(self.first[j + 1]))
        for document, d in enumerate(docs):
            start, length = int(self.starts[d]), int(self.lengths[d])
            tokens[at : at + length] = self.corpus.read(start, length)
            mask[at : at + length] = self.corpus.read_mask(start, length)
            segments[at : at + length] = document
            at += length
        segments[at:] = len(docs)  # the padding: a document of its own
        return tokens, segments, mask
