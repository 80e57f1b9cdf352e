"""Preference pairs: a prompt, the reply people preferred and the one they did not, as DPO trains on them (dpo.py).

A row has TRL's columns (data/sources.py PAIR_COLUMNS): `prompt`, `chosen`, `rejected`, in either of TRL's forms:

  * conversational: the prompt a list of messages, each reply a list of assistant messages; prompt + reply is
    rendered with the tokenizer folder's chat template through the chat path SFT uses (data/chat.py), so a pair
    is framed exactly as the model is prompted. Where the replies hold the whole conversation (TRL's implicit
    prompt, as UltraFeedback's rows do), the prompt is the messages they begin with alike and `prompt` is not read;
  * standard: three texts; the prompt is framed as the tokenizer frames a text (Llama 3's BOS first), and each
    reply is its tokens and the EOS.

Prepared, a pair is two documents back to back, the chosen and the rejected, and its loss mask marks each token:
0 for the prompt (never counted), 1 for a token of the reply's own text, 2 for a token the reply holds that is the
chat format's (the end of turn, an end of text, a header inside the reply's span). Llama 3 masks the 2s from
the loss (dpo.mask_format_tokens: both replies end in the same <|eot_id|>, so counted the model must raise and
lower one token at once; docs/failures.md #8), most DPO code counts them; the mask keeps both choices open.
Which tokens are format comes from the template itself: the reply's tokens that cover none of the characters of
its message's content, never from a list of token names.

Rows that cannot be a pair are dropped and counted in one line (`Dropped`): an empty reply, a chosen reply equal
to the rejected one, and a prompt that the template renders differently before the two replies (no shared
prompt to compare them on). A pair whose two sequences do not fit one window (training.seq_len + 1 tokens) is
dropped when the windows are laid out, also counted in one line.

The windows (`PreferenceWindows`): whole pairs, chosen then rejected, packed in corpus order (block-causal
attention keeps every sequence apart), or one pair per window with data.pad_samples, so that a pair never splits
across ranks or micro-batches.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

import numpy as np
import torch

from data.chat import assistant_mask, chat_renderer, check_messages
from errors import ConfigError, warn

CONTENT, FORMAT = 1, 2  # the loss mask's values on a reply's tokens (0: the prompt)
DROPPED = (
    "an empty reply",
    "the chosen reply equal to the rejected one",
    "a prompt rendered differently before each reply",
)


class Pairs(NamedTuple):
    """A micro-batch's pairs (data/loader.py Batch.pairs)."""

    # (bs, max pairs in a row) int64: row r's documents 2i and 2i + 1 are pair ids[r, i]; -1 past its last pair.
    ids: torch.Tensor
    chosen_tokens_per_pair: float  # the global batch's counted chosen tokens over its pairs (the sft term's mean)
    # (bs, max pairs in a row, 2): the reference's log-probabilities [chosen, rejected] of each pair, once placed on
    # the device (dpo.py PreferenceLoss.placed); None from the loader.
    reference: torch.Tensor | None = None


class PairRenderer:
    """Renders preference rows into (chosen ids, chosen mask, rejected ids, rejected mask) with the tokenizer folder's
    chat template (conversational rows) or its framing of a text (standard rows)."""

    def __init__(self, tokenizer_path: str):
        self.chat = chat_renderer(tokenizer_path)
        self.tokenizer = self.chat.tokenizer

    def render(self, row: dict[str, Any], *, where: str) -> tuple[list[int], np.ndarray, list[int], np.ndarray] | str:
        """The pair's two sequences and masks, or why the row is dropped (a DROPPED entry)."""
        prompt, chosen, rejected = (row.get(name) for name in ("prompt", "chosen", "rejected"))
        if (
            isinstance(chosen, list)
            and isinstance(rejected, list)
            and any(isinstance(m, dict) and m.get("role") != "assistant" for m in chosen)
        ):  # TRL's implicit prompt (UltraFeedback's rows): the replies hold the conversation, the prompt is its start
            shared = 0
            while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
                shared += 1
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
            if not chosen.strip() or not rejected.strip():
                return DROPPED[0]
            if chosen == rejected:
                return DROPPED[1]
            (c_ids, c_mask), (r_ids, r_mask) = self._text(prompt, chosen), self._text(prompt, rejected)
            if (
                int(np.argmax(c_mask > 0)) != int(np.argmax(r_mask > 0))
                or c_ids[: int(np.argmax(c_mask > 0))] != r_ids[: int(np.argmax(r_mask > 0))]
            ):
                return DROPPED[2]
            return c_ids, c_mask, r_ids, r_mask
        for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, list):
                raise ConfigError(
                    f"data.path: {where} has a {name} of {type(value).__name__}; a preference row holds three texts, or "
                    "a prompt of messages and each reply as a list of assistant messages (TRL's formats)"
                )
        check_messages(prompt, where=where)
        for reply in (chosen, rejected):
            check_messages(reply, where=where)
            if any(m["role"] != "assistant" for m in reply):
                raise ConfigError(
                    f"data.path: {where} has a reply with a non-assistant message; replies are the assistant's"
                )
        if any(not m["content"].strip() for m in chosen + rejected):
            return DROPPED[0]
        if [m["content"] for m in chosen] == [m["content"] for m in rejected]:
            return DROPPED[1]
        rendered = [self._conversation(prompt, reply, where=where) for reply in (chosen, rejected)]
        (c_ids, c_mask, c_prompt), (r_ids, r_mask, r_prompt) = rendered
        if c_prompt < 0 or c_prompt != r_prompt or c_ids[:c_prompt] != r_ids[:r_prompt]:
            return DROPPED[2]
        return c_ids, c_mask, r_ids, r_mask

    def _text(self, prompt: str, reply: str) -> tuple[list[int], np.ndarray]:
        """A standard row as TRL frames it: the prompt as the tokenizer frames a text, the reply after it closed by EOS
        (the text tokenized whole, so that tokens merge across the boundary as they do)."""
        framing = self.tokenizer.framing
        prompt_ids, whole = self.tokenizer.encode_batch([prompt, prompt + reply])
        prompt_ids, ids = framing.prompt(prompt_ids), framing.prompt([*whole, self.tokenizer.eos_id])
        mask = np.zeros(len(ids), dtype=np.uint8)
        mask[_shared(prompt_ids, ids) :] = CONTENT
        mask[len(framing.before) + len(whole) :] = FORMAT  # the EOS and what the tokenizer puts after a text
        return ids, mask

    def _conversation(
        self, prompt: list[dict[str, Any]], reply: list[dict[str, Any]], *, where: str
    ) -> tuple[list[int], np.ndarray, int]:
        """ids and mask of prompt + reply as the template renders them, and the prompt's token count: the reply is
        every token after the prompt rendered with the generation prompt (TRL's split), its tokens of the messages'
        text 1, the rest of it 2. -1: the template renders the prompt otherwise before a reply."""
        text = self.chat._render(prompt + reply)
        before = self.chat._render(prompt, generation_prompt=True)
        ((ids, offsets),) = self.tokenizer.encode_with_offsets([text])
        if not text.startswith(before):
            return ids, np.zeros(len(ids), np.uint8), -1
        starts = np.array([start for start, _ in offsets], dtype=np.int64)
        spans, at = [], len(before)
        for message in reply:
            begin = text.find(message["content"], at)
            if begin < 0:  # a template that rewrites the content: no text of its own to tell apart
                raise ConfigError(
                    f"data.path: the chat template of {self.chat.path} does not render the reply of {where} as its "
                    "text; preference pairs need a template that keeps what the assistant says as it is"
                )
            spans.append((begin, begin + len(message["content"])))
            at = begin + len(message["content"])
        content = assistant_mask(offsets, spans).astype(bool)
        mask = np.where(starts >= len(before), np.where(content, CONTENT, FORMAT), 0).astype(np.uint8)
        return ids, mask, int(np.searchsorted(starts, len(before)))


def _shared(a: list[int], b: list[int]) -> int:
    """The length of the common prefix of a and b."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def pair_documents(
    rows: list[Any], renderer: PairRenderer, *, origin: Any, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """A chunk's pairs as documents (chosen, rejected, ...) back to back: (tokens, where each ends, the loss mask, the
    rows dropped by reason). origin(i): where row i came from, for messages."""
    sequences, dropped = [], Counter()
    for i, row in enumerate(rows):
        if row is None:
            continue
        out = renderer.render(row, where=origin(i))
        if isinstance(out, str):
            dropped[out] += 1
            continue
        c_ids, c_mask, r_ids, r_mask = out
        sequences += [(c_ids, c_mask), (r_ids, r_mask)]
    lengths = np.fromiter((len(ids) for ids, _ in sequences), dtype=np.int64, count=len(sequences))
    flat = np.fromiter((t for ids, _ in sequences for t in ids), dtype=dtype, count=int(lengths.sum()))
    mask = np.concatenate([m for _, m in sequences]) if sequences else np.zeros(0, np.uint8)
    return flat, np.cumsum(lengths), mask, dict(dropped)


def warn_dropped(dropped: dict[str, int], *, path: str, pairs: int) -> None:
    """One line counting the rows of `path` dropped while preparing, by reason."""
    if total := sum(dropped.values()):
        reasons = ", ".join(f"{n:,} with {reason}" for reason, n in dropped.items())
        warn(f"data.path: {total:,} of {total + pairs:,} preference rows of {path} are dropped ({reasons})")


class PreferenceWindows:
    """A prepared preference corpus as windows of `window` tokens, each holding whole pairs (module docstring).

    Pair k is documents 2k (chosen) and 2k + 1 (rejected) of the corpus; its id, k, is what the reference's
    log-probabilities are stored by (dpo.py)."""

    def __init__(self, corpus: Any, window: int, *, pad: bool = False):
        self.corpus, self.window = corpus, window
        starts, lengths = [], []
        for shard, ends in enumerate(corpus.doc_ends):
            begin = np.concatenate([[0], ends[:-1]]).astype(np.int64)
            starts.append(begin + int(corpus.shard_starts[shard]))
            lengths.append(ends - begin)
        self.starts, self.lengths = np.concatenate(starts), np.concatenate(lengths)
        assert len(self.lengths) % 2 == 0, "a preference corpus holds pairs of documents"
        self.pairs = len(self.lengths) // 2
        pair_lengths = self.lengths[0::2] + self.lengths[1::2]
        fits = np.flatnonzero(pair_lengths <= window)
        if not len(fits):
            raise ConfigError(
                f"training.seq_len: no preference pair of {corpus.folder} fits in training.seq_len + 1 = {window} "
                f"tokens (the shortest holds {int(pair_lengths.min()):,}); raise training.seq_len"
            )
        if too_long := self.pairs - len(fits):
            warn(
                f"data.path: {too_long:,} of {self.pairs:,} preference pairs of {corpus.folder} do not fit in "
                f"training.seq_len + 1 = {window} tokens with both replies and are dropped; raise training.seq_len "
                "to keep them"
            )
        self.kept = fits  # the ids of the pairs trained on, in corpus order
        first, used = [0], 0
        for i, length in enumerate(pair_lengths[fits].tolist()):
            if pad or used + length > window:
                if i:
                    first.append(i)
                used = 0
            used += length
        self.first = np.array([*first, len(fits)])  # into self.kept: each window's first pair, then one past the last
        self.count = len(self.first) - 1
        self.pairs_in = np.diff(self.first)  # pairs per window
        # Each window's counted chosen tokens, the format tokens counted (True) or not (False): the sft term's mean.
        chosen = [2 * k for k in fits.tolist()]
        self.chosen_tokens = {}
        for count_format in (False, True):
            per_doc = np.array([self._counted(d, count_format) for d in chosen], dtype=np.int64)
            self.chosen_tokens[count_format] = np.add.reduceat(per_doc, self.first[:-1]) if len(per_doc) else per_doc
        self.pad_id = int(corpus.manifest["tokenizer"]["eos_id"])

    def _counted(self, document: int, count_format: bool) -> int:
        mask = self.corpus.read_mask(int(self.starts[document]), int(self.lengths[document]))
        return int((mask > 0).sum() if count_format else (mask == CONTENT).sum())

    def get(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, document index per token, loss mask, the ids of its pairs) of window j, padded to the window;
        documents 2i and 2i + 1 of the window are its pair i's chosen and rejected."""
        tokens = np.full(self.window, self.pad_id, dtype=np.int64)
        segments = np.empty(self.window, dtype=np.int32)
        mask = np.zeros(self.window, dtype=np.uint8)
        pairs = self.kept[int(self.first[j]) : int(self.first[j + 1])]
        at = 0
        for document, d in enumerate(d for k in pairs.tolist() for d in (2 * k, 2 * k + 1)):
            start, length = int(self.starts[d]), int(self.lengths[d])
            tokens[at : at + length] = self.corpus.read(start, length)
            mask[at : at + length] = self.corpus.read_mask(start, length)
            segments[at : at + length] = document
            at += length
        segments[at:] = 2 * len(pairs)  # the padding: a document of its own
        return tokens, segments, mask, pairs.astype(np.int64)
