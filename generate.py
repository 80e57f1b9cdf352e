"""Generate text from a checkpoint: a DCP step folder written by train.py (any step, saved on any number of
ranks and any layout) or a Hugging Face folder (Llama or Qwen3, from config.json's model_type).

python generate.py --checkpoint outputs/debug/checkpoint/step-100 --prompt "Once upon a time"
python generate.py --checkpoint HF_FOLDER --prompt "Hi" --prompt "Tell me a story" --chat --temperature 0.7
python generate.py --checkpoint CKPT --prompts-file prompts.txt --compile --max-new-tokens 256
python generate.py --checkpoint HF_OR_DCP_BASE --adapter PEFT_FOLDER --prompt "Once upon a time"

The run's config is read from config.toml beside the step folders (train.py writes it there when it
checkpoints), or given with --config. A LoRA run's step is its base (the config's checkpoint.initial_load_path or
model.hf_assets_path, or --base) with the step's adapters merged into the weights once, in memory; --adapter merges a
PEFT adapter folder alike. Each completion goes to stdout; prefill and decode tokens/s to stderr.

How it runs: the prompts, left-padded to one length, in one forward (the prefill); then the decode step, one token
per row from a KV cache (models/kv_cache.py), the next token picked on the device, and no value read by the host but
every STOP_CHECK_EVERY tokens. The cache is created here and handed to the model with every forward: the model holds
no state, so no training forward can ever see a cache (docs/failures.md #2). Its shapes are fixed, so --compile
compiles the decode step once; on a CUDA GPU (one process) it is also captured once as a CUDA graph and replayed for
every token, so the GPU does not wait on Python between tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from config import env_world_size
from data.tokenizers import Tokenizer, build_tokenizer
from errors import ConfigError, RecipeError, is_rank0, report
from inference import add_adapter_arguments, hf_tokenizer, load_model
from models.kv_cache import KVCache

CACHE_LENGTH_MULTIPLE = 128
# The host reads whether every row has stopped once every this many tokens, not after each (a read waits for the GPU
# to finish all it was given): a batch whose rows all stopped runs at most this many - 1 steps more, cut at the end.
STOP_CHECK_EVERY = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --chat: between the prompt and the reply (without --chat the completion continues the prompt on its line).
CHAT_REPLY = "\n---\n"


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    device, tp_mesh = init_tensor_parallel(opts.device)
    try:
        model, tokenizer_path = load_model(
            opts.checkpoint,
            config=opts.config,
            device=device,
            dtype=DTYPES[opts.dtype],
            tp_mesh=tp_mesh,
            adapter=opts.adapter,
            base=opts.base,
        )
        return generate_and_print(opts, model, opts.tokenizer or tokenizer_path)
    finally:
        if tp_mesh is not None:
            dist.destroy_process_group()


def init_tensor_parallel(device_name: str | None) -> tuple[torch.device, DeviceMesh | None]:
    """This process's device, and under torchrun a tensor-parallel mesh of all its ranks (for a model one GPU
    cannot hold; the tokens equal those of one process)."""
    world = env_world_size() or 1
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
    add_adapter_arguments(parser)
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
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decode step, once per batch size and cache length; on a CUDA GPU (one process) it is "
        "also captured once as a CUDA graph and replayed for every token; on CPU and under torchrun, compiled only",
    )
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


# ------------------------------------------------------------------- prompts


def read_prompts(opts: argparse.Namespace) -> list[str]:
    texts = list(opts.prompt)
    if opts.prompts_file is not None:
        if not opts.prompts_file.is_file():
            raise ConfigError(f"--prompts-file: {opts.prompts_file} not found")
        texts += [line for line in opts.prompts_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    return texts


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


def cache_length(prompt: int, new_tokens: int, max_positions: int) -> int:
    """The KV cache's positions for prompts of `prompt` tokens (left-padded) and `new_tokens` more: rounded up to
    CACHE_LENGTH_MULTIPLE within the model's `max_positions`, so that calls of similar lengths share one decode state
    and its compiled, captured step."""
    need = prompt + new_tokens
    return max(min(-(-need // CACHE_LENGTH_MULTIPLE) * CACHE_LENGTH_MULTIPLE, max_positions), need)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0  # 1: no limit


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row of logits (bs, vocab): argmax at temperature 0, else a draw after top-k and top-p
    (`pick`, its noise drawn from `generator`)."""
    if sampling.temperature == 0:
        return pick(logits, sampling, None)
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(generator=generator)
    return pick(logits, sampling, noise)


def pick(logits: torch.Tensor, sampling: Sampling, noise: torch.Tensor | None) -> torch.Tensor:
    """The next token of each row of logits (bs, vocab): argmax at temperature 0; else, among the tokens top-k and
    top-p keep, the argmax of p_i / noise_i for noise (bs, vocab) of independent Exp(1) draws, which is token i with
    probability p_i (the exponential race: noise_i / p_i is exponential of rate p_i, and the least of independent
    exponentials is the i-th with probability its rate over their sum). No random number generator and no host
    read inside: the decode step calls it under torch.compile and a CUDA graph, its noise drawn before each step."""
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
    # log(p_i / noise_i) up to a constant; a draw of exactly 0 is clamped, where -log(0) = inf would make a token
    # top-k or top-p dropped (-inf) NaN, which argmax takes for the largest.
    return (logits - noise.clamp_min(torch.finfo(noise.dtype).tiny).log()).argmax(dim=-1)


@dataclass
class DecodeState:
    """What the decode step reads and writes, on the model's device: allocated once per batch size, cache length,
    sampling and number of stop ids (Generator._decode_state) and then only written in place, so a CUDA graph
    captured over the step replays on these very addresses, call after call."""

    cache: KVCache
    tokens: torch.Tensor  # (bs, max_len) int64: each row's tokens by cache position, the prompt left-padded
    position: torch.Tensor  # (1,) int64: the cache position of the token the next step feeds
    done: torch.Tensor  # (bs,) bool: the row has picked a stop id
    stop: torch.Tensor  # (n,) int64: the stop ids (-1: none)
    noise: torch.Tensor | None  # (bs, vocab) float32: `pick`'s Exp(1) draws for the next step; None when greedy
    sampling: Sampling


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
    """Prompts in, completions out, over a model it never changes: the KV cache belongs to the generator and is
    passed to each forward.

    The prompts run in one eager forward (the prefill), which writes their keys and values and picks each row's
    first token; then the decode step (`_decode_step`) runs once per further token on a DecodeState, in place: the
    forward of one token per row from the cache, the next token picked on the device, written after it, the
    position advanced, `done` updated. The host reads `done` once every STOP_CHECK_EVERY steps and the tokens once
    at the end. The state is kept for the next call of the same batch size, cache length (`cache_length`) and
    sampling, whose step is then neither compiled nor captured again.

    compile: the decode step compiled once (fixed shapes); on CUDA in one process it is then captured once as a CUDA
    graph, replayed for every token. On CPU and under tensor parallel the compiled step runs without a graph;
    without compile the same step runs eagerly.
    """

    def __init__(self, model: nn.Module, *, compile: bool = False):
        self.model = model
        self.max_positions = model.args.max_seq_len  # the RoPE table's length
        self.device = next(model.parameters()).device
        self.step = torch.compile(self._decode_step, dynamic=False) if compile else self._decode_step
        # Captured by hand (torch.cuda.CUDAGraph) rather than by torch.compile(mode="reduce-overhead"): CUDA graph
        # trees treat only parameters, buffers and tensors marked static (a private dynamo API) as fixed addresses,
        # copy other inputs in at each replay and run a step that writes into them without a graph, and their
        # outputs are overwritten by the next replay. The cache is an argument here, not a module buffer: this
        # class owns the addresses instead (DecodeState), a replay is one call with no guard to evaluate, and a
        # host read inside the step fails the capture instead of silently costing the graph. Not under tensor
        # parallel, whose all-reduces the graph would hold: that path is compiled only.
        tensor_parallel = any(isinstance(p, DTensor) for p in model.parameters())
        self.cuda_graphs = compile and self.device.type == "cuda" and not tensor_parallel
        self.timing = Timing()
        self._state: DecodeState | None = None
        self._graph: torch.cuda.CUDAGraph | None = None

    def _decode_step(self, s: DecodeState) -> None:
        """One token per row, in place on `s`: feed the token at `s.position`, write the next one after it."""
        token = s.tokens.index_select(1, s.position)  # (bs, 1)
        logits = self.model(token, positions=s.position, cache=s.cache)[:, -1]
        new = pick(logits, s.sampling, s.noise)  # (bs,)
        s.tokens.index_copy_(1, s.position + 1, new[:, None])
        s.done.logical_or_((new[:, None] == s.stop[None, :]).any(dim=-1))
        s.position.add_(1)

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
        device = self.device
        bs, width = len(prompts), max(len(p) for p in prompts)
        padded = torch.zeros(bs, width, dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends at position width - 1
            padded[row, width - len(prompt) :] = torch.tensor(prompt)
        max_len = cache_length(width, max_new_tokens, self.max_positions)
        s = self._decode_state(bs, max_len, sampling, list(stop_ids) or [-1])
        s.cache.reset(torch.tensor([width - len(p) for p in prompts]))
        s.tokens[:, :width].copy_(padded)
        generator = torch.Generator(device=device).manual_seed(seed)

        t0 = time.perf_counter()
        logits = self.model(s.tokens[:, :width], positions=torch.arange(width, device=device), cache=s.cache)[:, -1]
        first = sample(logits, sampling, generator)
        s.tokens[:, width] = first
        s.done.copy_((first[:, None] == s.stop[None, :]).any(dim=-1))
        s.position.fill_(width)
        self._sync(device)
        t1 = time.perf_counter()
        steps = 1  # new tokens in s.tokens
        while steps < max_new_tokens:
            if steps % STOP_CHECK_EVERY == 1 and bool(s.done.all()):  # the host's one read per STOP_CHECK_EVERY
                break
            if s.noise is not None:
                s.noise.exponential_(generator=generator)  # outside the graph: the generator's state moves on
            if self._graph is not None:
                self._graph.replay()
            else:
                self.step(s)
            steps += 1
        new = s.tokens[:, width : width + steps].tolist()  # (bs, steps); one read at the end
        t2 = time.perf_counter()

        completions = [_until_stop(row, set(stop_ids)) for row in new]
        self.timing.prefill_tokens += sum(len(p) for p in prompts)
        self.timing.prefill_s += t1 - t0
        self.timing.decode_tokens += sum(max(len(c) - 1, 0) for c in completions)  # the first came from prefill
        self.timing.decode_s += t2 - t1
        return completions

    def _decode_state(self, bs: int, max_len: int, sampling: Sampling, stop: list[int]) -> DecodeState:
        """The last call's state if this call's shapes and sampling are the same (its step compiled and captured
        already), else a new one, allocated here, its step captured when cuda_graphs. The stop ids copied in."""
        s = self._state
        if s is None or s.tokens.shape != (bs, max_len) or s.sampling != sampling or s.stop.numel() != len(stop):
            self._state = self._graph = s = None  # the old buffers and graph go before the new ones are allocated
            device = self.device
            s = DecodeState(
                cache=KVCache.for_model(self.model, torch.zeros(bs, dtype=torch.long), max_len),
                tokens=torch.zeros(bs, max_len, dtype=torch.long, device=device),
                position=torch.zeros(1, dtype=torch.long, device=device),
                done=torch.zeros(bs, dtype=torch.bool, device=device),
                stop=torch.zeros(len(stop), dtype=torch.long, device=device),
                noise=None
                if sampling.temperature == 0
                else torch.ones(bs, self.model.args.vocab_size, dtype=torch.float32, device=device),
                sampling=sampling,
            )
            self._state = s
            if self.cuda_graphs:
                self._graph = self._capture(s)
        s.stop.copy_(torch.tensor(stop))
        return s

    def _capture(self, s: DecodeState) -> torch.cuda.CUDAGraph:
        """The decode step on `s` as a CUDA graph. Warmed up first on a side stream, as capture requires (the first
        call compiles; kernels initialize lazily): those steps write at position 0, which the prefill overwrites."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(s)
                s.position.zero_()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step(s)
        return graph

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
