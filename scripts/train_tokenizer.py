"""Train the byte-level BPE tokenizer shipped in ``assets/tokenizer``.

The tokenizer follows Llama 3's layout at a much smaller size: the same
pre-tokenization regex (words, numbers in groups of at most three digits,
punctuation, whitespace), byte-level BPE over UTF-8 bytes (so every string
round-trips, whatever its script), and Llama 3's special-token names:

    id 0: <|begin_of_text|>   (BOS)
    id 1: <|end_of_text|>     (EOS)

Its post-processor frames a text as Llama 3's does: <|begin_of_text|> first, nothing after
(transformers' ``tokenizer(text)``). Training documents are <|begin_of_text|> text <|end_of_text|>
(data/tokenizers.py reads that framing from this file).

The output folder holds ``tokenizer.json`` (for the ``tokenizers`` library) plus
``tokenizer_config.json`` and ``special_tokens_map.json`` so that
``transformers.AutoTokenizer.from_pretrained(out)`` loads it as a fast tokenizer.

Usage:
    python scripts/train_tokenizer.py --corpus assets/corpus/stories.jsonl \\
        --vocab-size 2048 --out assets/tokenizer
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN]  # list order = token ids 0 and 1
# The chat template (transformers' `apply_chat_template`): each turn a role header then its text; an
# assistant turn ends with EOS, so a fine-tuned model stops there. No new tokens: the headers are
# plain text. {% generation %} marks what the assistant says (transformers' assistant-token mask).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>\n{% generation %}{{ message['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Llama 3's pre-tokenization pattern (the same as tiktoken's cl100k_base).
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def read_texts(corpus: Path) -> Iterator[str]:
    """Yield the ``"text"`` field of every line of a JSONL file."""
    with corpus.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["text"]


def build_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer with Llama 3's pre-tokenizer."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated"),
            # The regex above already split the text, so ByteLevel only maps bytes.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def frame_like_llama3(tokenizer: Tokenizer) -> None:
    """Llama 3's post-processor: BOS before each text (and before each of a pair), nothing after."""
    bos = (BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1", special_tokens=[bos]
    )


def train(corpus: Path, vocab_size: int) -> Tokenizer:
    tokenizer = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols are in the vocabulary even if the corpus lacks them,
        # so any UTF-8 input can be encoded without unknown tokens.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(read_texts(corpus), trainer=trainer)
    actual = tokenizer.get_vocab_size()
    if actual != vocab_size:
        raise SystemExit(f"trained vocab has {actual} tokens, expected {vocab_size}: corpus too small?")
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, f"{token} should have id {token_id}"
    frame_like_llama3(tokenizer)
    return tokenizer


def save(tokenizer: Tokenizer, out: Path) -> None:
    """Write tokenizer.json plus the config files ``transformers`` expects."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        # Keep decode(encode(x)) == x: do not "clean up" spaces before punctuation.
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}
    for name, content in [("tokenizer_config.json", config), ("special_tokens_map.json", special_tokens_map)]:
        (out / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=Path("assets/corpus/stories.jsonl"))
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("assets/tokenizer"))
    args = parser.parse_args()

    tokenizer = train(args.corpus, args.vocab_size)
    save(tokenizer, args.out)

    n_bytes = n_tokens = 0
    for text in read_texts(args.corpus):
        n_bytes += len(text.encode("utf-8"))
        n_tokens += len(tokenizer.encode(text, add_special_tokens=False).ids)
    print(
        f"vocab {tokenizer.get_vocab_size()} -> {args.out}; corpus: {n_tokens:,} tokens, "
        f"{n_bytes:,} text bytes, {n_tokens / n_bytes:.3f} tokens/byte"
    )


if __name__ == "__main__":
    main()
