"""Write ``assets/tokenizer_qwen3``: the shipped BPE tokenizer with Qwen3's special tokens and chat template.

It lets the Qwen3 debug model (2,048 embeddings) be chat fine-tuned offline as Qwen3 is: conversations
rendered by Qwen3's own chat template (models/qwen3/chat_template.jinja), turns opened by <|im_start|> and
closed by <|im_end|>, thinking in <think> ... </think>. The BPE is the shipped one (assets/tokenizer:
vocabulary, merges, pre-tokenizer, decoder), and every ordinary token keeps its id. Qwen3's five special
tokens take the ids that are freed, in Qwen3's order:

    id 0     <|endoftext|>   (the pad token)       were <|begin_of_text|> and <|end_of_text|>,
    id 1     <|im_start|>                           which it does not have
    id 2045  <|im_end|>      (EOS, as Qwen3's      were the results of the last three merges
    id 2046  <think>          post-trained          (' rise', ' shadows', ' Cookies'), which it
    id 2047  </think>         releases have it)     drops: those words take two tokens instead

As Qwen3's tokenizer, it has no BOS and no post-processor: a text is its tokens alone. Its
tokenizer_config.json loads tokenizer.json unchanged (PreTrainedTokenizerFast), so transformers and
data/tokenizers.py give the same ids.

Usage (regenerates the folder byte for byte; tests/test_chat.py checks that it does):
    python scripts/make_qwen3_tokenizer.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parents[1]
SPECIALS = {  # token -> (id, special: transformers' skip_special_tokens drops it), as Qwen3 marks them
    "<|endoftext|>": (0, True),
    "<|im_start|>": (1, True),
    "<|im_end|>": (2045, True),
    "<think>": (2046, False),
    "</think>": (2047, False),
}
DROPPED_MERGES = 3  # the last ones: their three ids go to <|im_end|>, <think> and </think>


def build(shipped: Path) -> Tokenizer:
    """The shipped tokenizer.json with Qwen3's special tokens in place of its own and of its last merges."""
    spec = json.loads((shipped / "tokenizer.json").read_text(encoding="utf-8"))
    model = spec["model"]
    vocab = dict(model["vocab"])
    for token in spec["added_tokens"]:  # the shipped special tokens
        del vocab[token["content"]]
    merges, dropped = model["merges"][:-DROPPED_MERGES], model["merges"][-DROPPED_MERGES:]
    for left, right in dropped:
        del vocab[left + right]
    assert sorted(vocab.values()) == sorted(set(range(len(vocab) + len(SPECIALS))) - {i for i, _ in SPECIALS.values()})
    vocab |= {token: token_id for token, (token_id, _) in SPECIALS.items()}
    spec["model"] = model | {"vocab": dict(sorted(vocab.items(), key=lambda item: item[1])), "merges": merges}
    spec["added_tokens"] = [
        {"id": token_id, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": special}
        for token, (token_id, special) in sorted(SPECIALS.items(), key=lambda item: item[1][0])
    ]  # fmt: skip
    spec["post_processor"] = None
    return Tokenizer.from_str(json.dumps(spec))


def write(shipped: Path, out: Path) -> None:
    tokenizer = build(shipped)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    template = (REPO / "models" / "qwen3" / "chat_template.jinja").read_text(encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": template,
    }
    special_tokens_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    for name, content in [("tokenizer_config.json", config), ("special_tokens_map.json", special_tokens_map)]:
        (out / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    print(f"vocab {tokenizer.get_vocab_size()} -> {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shipped", type=Path, default=REPO / "assets" / "tokenizer")
    parser.add_argument("--out", type=Path, default=REPO / "assets" / "tokenizer_qwen3")
    args = parser.parse_args()
    write(args.shipped, args.out)


if __name__ == "__main__":
    main()
