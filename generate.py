"""Generate text from a checkpoint: a DCP step folder written by train.py (any step, saved on any number of
ranks and any layout) or a Hugging Face folder (Llama or Qwen3, from config.json's model_type).

python generate.py --checkpoint outputs/debug/checkpoint/step-100 --prompt "Once upon a time"
python generate.py --checkpoint HF_FOLDER --prompt "Hi" --prompt "Tell me a story" --chat --temperature 0.7
python generate.py --checkpoint CKPT --prompts-file prompts.txt --compile --max-new-tokens 256

The run's config is read from config.toml beside the step folders (train.py writes it there when it
checkpoints), or given with --config. Each completion goes to stdout; prefill and decode tokens/s to stderr.

How it runs: the prompts, left-padded to one length, in one forward; then one token per forward, its keys
and values appended to a KV cache (models/kv_cache.py). The cache is created here and handed to the model
with every forward: the model holds no state, so no training forward can ever see a cache
(docs/failures.md #2). Its shapes are fixed, so --compile compiles the decode step once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from data.tokenizers import Tokenizer, build_tokenizer
from errors import ConfigError, RecipeError, is_rank0, report
from models.kv_cache import KVCache

CACHE_LENGTH_MULTIPLE = 128
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --chat: between the prompt and the reply (without --chat the completion continues the prompt on its line).
CHAT_REPLY = "\n---\n"


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    device, tp_mesh = init_tensor_parallel(opts.device)
    try:
        model, tokenizer_path = load_model(
            opts.checkpoint, config=opts.config, device=device, dtype=DTYPES[opts.dtype], tp_mesh=tp_mesh
        )
        return generate_and_print(opts, model, opts.tokenizer or tokenizer_path)
    finally:
        if tp_mesh is not None:
            dist.destroy_process_group()


def init_tensor_parallel(device_name: str | None) -> tuple[torch.device, DeviceMesh | None]:
    """This process's device, and under torchrun a tensor-parallel mesh of all its ranks (for a model one GPU
    cannot hold; the tokens equal those of one process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and device_name in (None, "cuda")
    if world == 1:
        return torch.device(device_name or ("cuda" if cuda else "cpu")), None
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    return device, init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))


def generate_and_print(opts: argparse.Namespace, model: nn.Module, tokenizer_path: str | None) -> int:
    if tokenizer_path is None:
        raise ConfigError(f"--tokenizer: {opts.checkpoint} holds no tokenizer.json; name a tokenizer folder")
    tokenizer = build_tokenizer(tokenizer_path, key="--tokenizer")
    texts = read_prompts(opts)
    prompts = encode_prompts(texts, tokenizer, tokenizer_path, chat=opts.chat)
    if (highest := max(max(p) for p in prompts)) >= model.args.vocab_size:
        raise ConfigError(
            f"--tokenizer: {tokenizer_path} gives token id {highest} but the model embeds only "
            f"{model.args.vocab_size} tokens; use the tokenizer it was trained with"
        )
    longest = max(len(p) for p in prompts) + opts.max_new_tokens
    if longest > model.args.max_seq_len:
        raise ConfigError(
            f"--max-new-tokens: the longest prompt ({longest - opts.max_new_tokens} tokens) plus {opts.max_new_tokens} "
            f"new ones exceeds the model's {model.args.max_seq_len} positions; ask for fewer"
        )
    generator = Generator(model, compile=opts.compile)
    sampling = Sampling(opts.temperature, opts.top_k, opts.top_p)
    completions = generator.generate(
        prompts,
        max_new_tokens=opts.max_new_tokens,
        sampling=sampling,
        stop_ids=stop_ids(tokenizer, tokenizer_path),
        seed=opts.seed,
    )
    if is_rank0():  # (under tensor parallel every rank holds the same tokens)
        for text, completion in zip(texts, completions, strict=True):
            print(f"{text}{CHAT_REPLY if opts.chat else ''}{tokenizer.decode(completion)}\n", flush=True)
        print(generator.timing.summary(), file=sys.stderr)
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="a DCP step-<N> folder or a Hugging Face folder")
    parser.add_argument("--config", type=Path, help="the run's TOML (default: config.toml beside the step folders)")
    parser.add_argument(
        "--tokenizer", help="tokenizer folder (default: the run's model.tokenizer_path / the HF folder)"
    )
    parser.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    parser.add_argument("--prompts-file", type=Path, help="one prompt per line")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample among the likeliest tokens of mass p")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step (compiled once)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--device", help="default: cuda when there is one, else cpu")
    opts = parser.parse_args(argv)
    problems = [
        f"--{name}: {why}"
        for name, bad, why in [
            ("max-new-tokens", opts.max_new_tokens < 1, "must be at least 1"),
            ("temperature", opts.temperature < 0, "must be 0 (greedy) or more"),
            ("top-k", opts.top_k < 0, "must be 0 (all tokens) or more"),
            ("top-p", not 0 < opts.top_p <= 1, "must be in (0, 1]"),
            ("prompt", not opts.prompt and opts.prompts_file is None, "give --prompt TEXT or --prompts-file FILE"),
        ]
        if bad
    ]
    if problems:
        raise ConfigError(*problems)
    return opts


# ------------------------------------------------------------------- loading


def load_model(
    path: Path, *, config: Path | None, device: torch.device, dtype: torch.dtype, tp_mesh: DeviceMesh | None = None
) -> tuple[nn.Module, str | None]:
    """The model of a DCP step folder or a Hugging Face folder, in eval mode (split over `tp_mesh` when given), and
    its tokenizer path (None: an HF folder without tokenizer.json). Built on the meta device, the weights read once."""
    from models import family

    if (path / "config.json").is_file():  # a Hugging Face folder
        from models.hf import family_of_hf_config, model_args_from_hf

        fam = family_of_hf_config(path)
        args = model_args_from_hf(fam, path)
        tokenizer_path = str(path) if (path / "tokenizer.json").is_file() else None
    else:
        from checkpoint import refuse_folder_of_steps
        from config import load_config, model_args

        refuse_folder_of_steps(path, key="--checkpoint")  # a run folder or its checkpoint folder, not a step
        config = config or path.parent / "config.toml"
        if not config.is_file():
            raise ConfigError(
                f"--config: no config.toml beside {path} (train.py writes one when it checkpoints); pass the TOML it "
                "was trained with, --config FILE"
            )
        cfg = load_config(["--config", str(config)])
        fam, args, tokenizer_path = family(cfg.model.name), model_args(cfg.model), cfg.model.tokenizer_path
    with torch.device("meta"):
        model = fam.model_cls(args)
    if tp_mesh is not None:
        from parallelisms.tp import apply_tp_inference

        apply_tp_inference(model, tp_mesh, block_plan=fam.tp_plan)
    model.to_empty(device=device)
    if (path / "config.json").is_file():
        from models.hf import load_hf_weights

        load_hf_weights(model, path, fam, args)
    else:
        from checkpoint import load_model_weights

        load_model_weights(path, model, key="--checkpoint")  # DCP reshards onto this layout
    model.to(dtype)
    model.init_buffers(device)  # the RoPE table stays float32 whatever the weights' dtype
    return model.eval(), tokenizer_path


def read_prompts(opts: argparse.Namespace) -> list[str]:
    texts = list(opts.prompt)
    if opts.prompts_file is not None:
        if not opts.prompts_file.is_file():
            raise ConfigError(f"--prompts-file: {opts.prompts_file} not found")
        texts += [line for line in opts.prompts_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    return texts


def hf_tokenizer(tokenizer_path: str) -> Any:
    """transformers' tokenizer of a tokenizer folder (or tokenizer.json): its chat template, lm-eval's encoding."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(tokenizer_path)
    if path.is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    return AutoTokenizer.from_pretrained(str(path))


def encode_prompts(texts: list[str], tokenizer: Tokenizer, tokenizer_path: str, *, chat: bool) -> list[list[int]]:
    """Token ids of each prompt: the text framed as its tokenizer frames one (data/tokenizers.py: Llama 3's
    <|begin_of_text|> first, Qwen3's nothing), or the tokenizer folder's chat template."""
    if not chat:
        return [tokenizer.framing.prompt(ids) for ids in tokenizer.encode_batch(texts)]
    template = hf_tokenizer(tokenizer_path)
    if not getattr(template, "chat_template", None):
        raise ConfigError(f"--chat: {tokenizer_path} has no chat_template (tokenizer_config.json); drop --chat")
    messages = [[{"role": "user", "content": text}] for text in texts]
    rendered = [template.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    return tokenizer.encode_batch(rendered)  # the template writes BOS itself


def stop_ids(tokenizer: Tokenizer, tokenizer_path: str) -> list[int]:
    """EOS, and the end-of-turn ids generation_config.json lists (Llama 3 instruct's <|eot_id|>)."""
    ids = [tokenizer.eos_id]
    file = Path(tokenizer_path) / "generation_config.json"
    if file.is_file():
        listed = json.loads(file.read_text()).get("eos_token_id")
        ids += [listed] if isinstance(listed, int) else list(listed or [])
    return sorted(set(ids))


# ---------------------------------------------------------------- generation


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0  # 1: no limit


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row of logits (bs, vocab): argmax at temperature 0, else a draw after top-k and top-p."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        mass_before = sorted_logits.softmax(dim=-1).cumsum(dim=-1) - sorted_logits.softmax(dim=-1)
        sorted_logits = sorted_logits.masked_fill(mass_before >= sampling.top_p, float("-inf"))  # keeps the first
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    draw = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
    return draw.squeeze(-1)


@dataclass
class Timing:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    def summary(self) -> str:
        rate = lambda n, s: f"{n / s:,.0f}" if s > 0 else "-"  # noqa: E731
        return (
            f"prefill: {self.prefill_tokens} tokens in {self.prefill_s:.3f} s ({rate(self.prefill_tokens, self.prefill_s)}"
            f" tokens/s); decode: {self.decode_tokens} tokens in {self.decode_s:.3f} s "
            f"({rate(self.decode_tokens, self.decode_s)} tokens/s)"
        )


class Generator:
    """Prompts in, completions out, over a model it never changes: the KV cache is created per call and
    passed to each forward. compile: the decode step (one token per row, fixed shapes) is compiled once."""

    def __init__(self, model: nn.Module, *, compile: bool = False):
        self.model = model
        self.max_positions = model.args.max_seq_len  # the RoPE table's length
        self.decode = torch.compile(self._last_logits, dynamic=False) if compile else self._last_logits
        self.timing = Timing()

    def _last_logits(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return self.model(tokens, positions=positions, cache=cache)[:, -1]

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        stop_ids: list[int] = (),
        seed: int = 0,
    ) -> list[list[int]]:
        """The new tokens of each prompt, up to and with the first stop id, at most max_new_tokens."""
        device = next(self.model.parameters()).device
        bs, width = len(prompts), max(len(p) for p in prompts)
        tokens = torch.zeros(bs, width, dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends at position width - 1
            tokens[row, width - len(prompt) :] = torch.tensor(prompt)
        starts = torch.tensor([width - len(p) for p in prompts], device=device)
        # Rounded up, so that calls of similar lengths share one compiled decode step (its shapes include max_len).
        max_len = min(-(-(width + max_new_tokens) // CACHE_LENGTH_MULTIPLE) * CACHE_LENGTH_MULTIPLE, self.max_positions)
        cache = KVCache(starts, max_len=max(max_len, width + max_new_tokens))
        generator = torch.Generator(device=device).manual_seed(seed)
        stop = torch.tensor(list(stop_ids) or [-1], device=device)

        t0 = time.perf_counter()
        logits = self._last_logits(tokens.to(device), torch.arange(width, device=device), cache)  # the prefill
        out = [sample(logits, sampling, generator)]
        done = torch.isin(out[-1], stop)
        self._sync(device)
        t1 = time.perf_counter()
        for pos in range(width, width + max_new_tokens - 1):
            if bool(done.all()):
                break
            logits = self.decode(out[-1][:, None], torch.tensor([pos], device=device), cache)
            out.append(sample(logits, sampling, generator))
            done |= torch.isin(out[-1], stop)
        new = torch.stack(out, dim=1).tolist()  # (bs, steps); one read at the end
        t2 = time.perf_counter()

        completions = [_until_stop(row, set(stop_ids)) for row in new]
        self.timing.prefill_tokens += sum(len(p) for p in prompts)
        self.timing.prefill_s += t1 - t0
        self.timing.decode_tokens += sum(max(len(c) - 1, 0) for c in completions)  # the first came from prefill
        self.timing.decode_s += t2 - t1
        return completions

    @staticmethod
    def _sync(device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()


def _until_stop(tokens: list[int], stop: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in stop:
            return tokens[: i + 1]
    return tokens


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except RecipeError as e:
        sys.exit(report(e))
