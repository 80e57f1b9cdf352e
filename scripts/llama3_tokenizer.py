"""Meta's Llama 3 tokenizer as the Hugging Face tokenizer folder the recipes read, without a gated download.

    pip install llama-models            # Meta's package on PyPI: ships llama_models/llama3/tokenizer.model
    python scripts/llama3_tokenizer.py --output assets/hf/Llama-3.1-8B

The recipes' other route is `hf download meta-llama/Llama-3.1-8B --include "tokenizer*" ...`, which
needs a Hugging Face account and an approved licence request. Both give the same ids for text: the
same BPE ranks (128,000 tokens, tiktoken's format), split by the same regular expression. The 256
special tokens (ids 128,000-128,255: <|begin_of_text|>, <|end_of_text|>, the chat headers, reserved
ones) are named as llama-models' own `Tokenizer` names them; transformers' TikTokenConverter turns the
ranks into a byte-level BPE `tokenizer.json`. tests/test_data.py checks the ids against tiktoken's
encoding of the same texts through llama-models, special tokens included, and prepares a corpus with
the folder (uint32 token shards: the vocabulary is past 65,536).

The Llama 3 Community License applies to the tokenizer as to the weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Runnable without installing the repo: its root holds errors.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from errors import ConfigError  # noqa: E402


def meta_tokenizer(model: Path | None):  # -> llama_models.llama3.tokenizer.Tokenizer
    """llama-models' Llama 3 tokenizer, of `model` (a tokenizer.model file) or of the package's own file."""
    try:
        from llama_models.llama3.tokenizer import Tokenizer
    except ImportError as e:
        raise ConfigError(
            f"llama-models: cannot import it ({e}); pip install llama-models (Meta's package on PyPI, with tiktoken)"
        ) from None
    if model is None:
        return Tokenizer.get_instance()
    if not model.is_file():
        raise ConfigError(f"--model: {model} not found; point it at a Llama 3 tokenizer.model (tiktoken format)")
    return Tokenizer(model)


def convert(model: Path | None, output: Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `output`."""
    meta = meta_tokenizer(model)
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = sorted(meta.special_tokens, key=meta.special_tokens.get)  # in id order: ids follow the ranks
    source = model or Path(sys.modules[type(meta).__module__].__file__).parent / "tokenizer.model"
    fast = TikTokenConverter(vocab_file=str(source), pattern=meta.pat_str, extra_special_tokens=specials).converted()
    for token in specials:  # the converter appends them in order: check that the ids are Meta's
        if fast.token_to_id(token) != meta.special_tokens[token]:
            raise ConfigError(
                f"--model: {token} got id {fast.token_to_id(token)}, Meta's is {meta.special_tokens[token]}"
            )
    # Meta's own tokenizer.json frames a text as <|begin_of_text|> text (transformers' `tokenizer(text)`).
    bos = ("<|begin_of_text|>", meta.special_tokens["<|begin_of_text|>"])
    template = processors.TemplateProcessing(
        single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B:1", special_tokens=[bos]
    )
    fast.post_processor = processors.Sequence([fast.post_processor, template]) if fast.post_processor else template
    output.mkdir(parents=True, exist_ok=True)
    fast.save(str(output / "tokenizer.json"))
    names = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (output / "special_tokens_map.json").write_text(json.dumps(names, indent=1) + "\n")
    config = {
        **names,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": True,
    }
    (output / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return output


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, type=Path, help="the tokenizer folder to write (model.tokenizer_path)")
    p.add_argument("--model", type=Path, help="a tokenizer.model to convert (default: the one llama-models ships)")
    args = p.parse_args(argv)
    try:
        folder = convert(args.model, args.output)
    except ConfigError as e:
        for problem in e.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    print(
        f"wrote {folder}: tokenizer.json ({len(json.loads((folder / 'tokenizer.json').read_text())['model']['vocab']):,} "
        "BPE tokens + 256 special), tokenizer_config.json, special_tokens_map.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
