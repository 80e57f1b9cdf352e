"""Decoding speed of generate.py beside transformers' `generate`, on the same weights, batch 1.

    python -m benchmarks.generation --out outputs/bench/generation.json       # one process, CPU

Llama shapes: the debug model (6M parameters) and one of about 100M (dim 768, 12 layers, 12 heads, 4 KV heads,
32768 tokens) on CPU; Llama 3.2 1B's ("1b") and Llama 3.1 8B's ("8b": dim 4096, 32 layers, 32 heads, 8 KV heads,
intermediate 14336, vocab 128256) for a GPU. Up to 100M, a random transformers LlamaForCausalLM in fp32, saved as a
Hugging Face folder, and this repo's model loaded from that folder. At 1b and 8b (or any shape with --in-memory)
no folder: transformers' model is built on the device in --dtype, its weights drawn there, and ours holds the very
same tensors (8B's 16 GB in bf16 exist once and nothing is written to disk, which would take minutes). Each setup
greedily decodes `--new-tokens` tokens after a 16-token prompt, never stopping early:

    hf generate         transformers' generate(do_sample=False), its own KV cache
    no cache            our model, the whole sequence recomputed for every new token (what a stateless forward
                        costs without a cache); not at 1b and 8b (--in-memory), where it would take most of the run
    cache               generate.py's Generator: a prefill, then one token per forward from the KV cache
    cache + compile     the same with the decode step compiled (compiled before the timed rounds); on a CUDA GPU
                        also captured as a CUDA graph, replayed for every token (generate.py)

Decode tokens/s = (new_tokens - 1) / (time of new_tokens - time of 1 new token): the prompt's forward cancels,
for every setup alike; ms per token is its inverse. The setups take turns within each round (--rounds), so they
share the machine's noise; the median round counts. Whether all produce the same tokens is checked and recorded
(in bf16 a near tie may break differently in two implementations).

At batch 1 a decode step reads every weight once, so its limit is memory bandwidth: "weight bytes read / s" is the
parameter bytes times decode tokens/s, beside this machine's copy bandwidth measured in the same run (a 256 MiB
fp32 tensor copied: bytes read + written per second, STREAM's convention).

On a GPU (`--device cuda`, the default where there is one; `make bench-gpu` runs the "1b" and "8b" shapes in bf16)
it also reports the fraction of the GPU's peak memory bandwidth the compiled decode reaches: the bytes one decoded
token reads (every weight but the token embedding table, of which one row, plus the whole KV cache buffer, which
the fixed-shape decode step attends over) x decode tokens/s / the peak of PEAK_BANDWIDTH for this device's name; n/a
for a device not in that table or on CPU. 8B's roofline on an H100 by that count: 3.35 TB/s over 15.0 GB a token,
about 223 tokens/s (209 if the whole embedding table counted).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from benchmarks import harness
from benchmarks.harness import Row
from generate import Generator, cache_length
from models import family
from models.hf import from_hf, hf_to_ours
from tests.tiny_hf import unit_scale_init_

PROBLEM = "generation"
PROMPT = 16
SHAPES: dict[str, dict[str, Any]] = {
    "debug": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=16,
                  intermediate_size=768, vocab_size=2048),
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32768),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256),  # Llama 3.2 1B's shape, untied: make bench-gpu
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256),  # Llama 3.1 8B's shape: make bench-gpu
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=192, vocab_size=512),  # the benchmark's own test
}  # fmt: skip
SETUPS = ("hf generate", "no cache", "cache", "cache + compile")
IN_MEMORY = ("1b", "8b")  # built on the device without a folder, and without the "no cache" setup
# Peak memory bandwidth (bytes/s, vendor specs) by a substring of torch.cuda.get_device_name(), first match wins.
PEAK_BANDWIDTH = (
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 4.8e12),
    ("A100-SXM4-80GB", 2.0e12),
    ("A100 80GB", 2.0e12),
)


def peak_bandwidth(device_name: str) -> float | None:
    """PEAK_BANDWIDTH's bytes/s for this device name; None for a device not in it."""
    return next((bw for key, bw in PEAK_BANDWIDTH if key in device_name), None)


def bytes_per_token(model: nn.Module, *, prompt: int, new_tokens: int) -> dict[str, int]:
    """What one batch-1 decode step reads: the weights (the embedding table as one row) and the KV cache buffer
    Generator allocates for prompt + new_tokens (generate.py cache_length: rounded up, every position attended)."""
    args = model.args
    embedding = model.tok_embeddings.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= embedding.numel() * embedding.element_size() - args.dim * embedding.element_size()
    max_len = cache_length(prompt, new_tokens, args.max_seq_len)
    kv = 2 * args.n_layers * max_len * args.kv_heads * args.head_dim * embedding.element_size()
    return {"weights": weights, "kv_cache": kv}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(mib: int = 256, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Bytes read + written per second by a tensor copy of `mib` MiB on `device` (the best of `repeats`)."""
    device = torch.device(device)
    src = torch.randn(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def decoders(
    reference: nn.Module, ours: nn.Module, prompt: torch.Tensor, *, compiled: Generator, no_cache: bool = True
) -> dict[str, Callable[[int], list[int]]]:
    """Each setup as new_tokens -> the greedy tokens after `prompt` (1, PROMPT); "cache + compile" is `compiled`'s
    (a Generator of `ours` with compile=True), "no cache" is left out unless asked for."""

    def hf(n: int) -> list[int]:
        out = reference.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n, min_new_tokens=n,
            pad_token_id=0,
        )  # fmt: skip
        return out[0, prompt.shape[1] :].tolist()

    @torch.no_grad()
    def recompute(n: int) -> list[int]:
        tokens = prompt
        for _ in range(n):
            tokens = torch.cat([tokens, ours(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return tokens[0, prompt.shape[1] :].tolist()

    setups = {
        "hf generate": hf,
        "no cache": recompute,
        "cache": lambda n: Generator(ours).generate(prompt.tolist(), max_new_tokens=n)[0],
        "cache + compile": lambda n: compiled.generate(prompt.tolist(), max_new_tokens=n)[0],
    }
    if not no_cache:
        del setups["no cache"]
    return setups


@torch.no_grad()
def draw_weights_(model: nn.Module, *, seed: int) -> None:
    """tests/tiny_hf.py unit_scale_init_'s weights (O(1) activations and logits, so that greedy picks are no near
    ties), drawn in place on the model's device in its dtype: the CPU would take minutes for 8B."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1:  # RMSNorm gains
            p.normal_(1.0, 0.2, generator=gen)
        elif "embed" in name:
            p.normal_(0.0, 1.0, generator=gen)
        else:  # (out, in) projections: unit variance out for unit variance in
            p.normal_(0.0, p.shape[1] ** -0.5, generator=gen)


def models_in_memory(config: LlamaConfig, *, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """transformers' model built on `device` in `dtype`, its weights drawn there, and ours (eval) holding the very
    same tensors, by transformers' names mapped to ours (models/hf.py): no folder, no copy."""
    with torch.device(device):
        reference = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    draw_weights_(reference, seed=0)
    fam = family("llama3")
    args = fam.hf.model_args_from_hf_config(config.to_dict(), source="benchmarks/generation.py")
    names = hf_to_ours(fam, args)
    with torch.device("meta"):
        ours = fam.model_cls(args)
    ours.load_state_dict({names[k]: v for k, v in reference.state_dict().items() if k in names}, assign=True)
    ours.init_buffers(device)  # the RoPE table, derived from args
    return reference, ours.eval()


def llama_config(shape: str) -> LlamaConfig:
    """transformers' config of a shape of SHAPES."""
    return LlamaConfig(**SHAPES[shape], max_position_embeddings=512, rope_theta=500000.0, attn_implementation="sdpa")


def measure_shape(
    shape: str,
    *,
    new_tokens: int,
    rounds: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    in_memory: bool | None = None,
) -> dict[str, Any]:
    """One shape's setups, timed. in_memory: build both models on the device without a folder and skip "no cache"
    (default: for the shapes of IN_MEMORY)."""
    device = torch.device(device)
    in_memory = shape in IN_MEMORY if in_memory is None else in_memory
    config = llama_config(shape)
    if in_memory:
        reference, ours = models_in_memory(config, device=device, dtype=dtype)
    else:
        reference = LlamaForCausalLM(config).float().eval()
        unit_scale_init_(reference, seed=0)
        with tempfile.TemporaryDirectory(prefix="generation_bench_") as tmp:
            reference.save_pretrained(tmp)
            ours, _ = from_hf(Path(tmp), dtype=dtype, device=device)
        reference = reference.to(device=device, dtype=dtype)
        ours.eval()
    prompt = torch.randint(3, config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0)).to(device)
    compiled = Generator(ours, compile=True)
    setups = decoders(reference, ours, prompt, compiled=compiled, no_cache=not in_memory)
    tokens = {name: decode(new_tokens) for name, decode in setups.items()}  # warm-up: compiles and captures
    setups["cache + compile"](1)
    seconds: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(rounds):
        for name, decode in setups.items():
            _sync(device)
            t0 = time.perf_counter()
            decode(1)
            _sync(device)
            t1 = time.perf_counter()
            decode(new_tokens)
            _sync(device)
            t2 = time.perf_counter()
            seconds[name].append((t2 - t1) - (t1 - t0))
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    rate = {name: (new_tokens - 1) / statistics.median(s) for name, s in seconds.items()}
    read = bytes_per_token(ours, prompt=PROMPT, new_tokens=new_tokens)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "weights": "built on the device, shared" if in_memory else "saved and loaded",
        "cuda_graphs": compiled.cuda_graphs,
        "bytes_read_per_token": read,
        "parameters": sum(p.numel() for p in ours.parameters()),
        "weight_bytes": weight_bytes,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "decode_tokens_per_s": rate,
        "ms_per_token": {name: 1e3 / r for name, r in rate.items()},
        "weight_bytes_read_per_s": {name: r * weight_bytes for name, r in rate.items()},
        "same_tokens": all(t == tokens["hf generate"] for t in tokens.values()),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results: dict[str, Any] = {"device": device.type, "device_name": name, "peak_bytes_per_s": peak_bandwidth(name)}
    results["copy_bytes_per_s"] = copy_bandwidth(device=device)
    results["shapes"] = {}
    for shape in args.shapes:
        results["shapes"][shape] = measure_shape(
            shape, new_tokens=args.new_tokens, rounds=args.rounds, device=device, dtype=dtype,
            in_memory=True if args.in_memory else None,
        )  # fmt: skip
        torch._dynamo.reset()  # the compiled step's code refers to this shape's model: let it go before the next
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def bandwidth_fraction(results: dict[str, Any], shape: str) -> float | None:
    """Bytes one decoded token reads x the compiled decode's tokens/s / the device's peak bandwidth; None where the
    peak is unknown (CPU, a GPU not in PEAK_BANDWIDTH)."""
    peak, r = results.get("peak_bytes_per_s"), results["shapes"][shape]
    if not peak or "bytes_read_per_token" not in r:
        return None
    return sum(r["bytes_read_per_token"].values()) * r["decode_tokens_per_s"]["cache + compile"] / peak


def rows(results: dict[str, Any]) -> list[Row]:
    """Per shape: transformers vs ours with cache + compile (the headline), no cache vs cache (where "no cache" ran;
    else the eager cache vs cache + compile), and the weight bytes read per second beside the machine's copy
    bandwidth; on a GPU of PEAK_BANDWIDTH first the fraction of its peak the compiled decode reaches."""
    out = []
    where = "GPU" if results.get("device") == "cuda" else "CPU"
    for shape, r in results["shapes"].items():
        rate, label = r["decode_tokens_per_s"], parameters_label(shape, r["parameters"])
        if (fraction := bandwidth_fraction(results, shape)) is not None:
            out.append(
                Row(problem=PROBLEM, metric=f"fraction of peak memory bandwidth, decode, {label}", unit="",
                    broken="peak", broken_value=1.0, fixed="cache + compile", fixed_value=fraction)
            )  # fmt: skip
        out += [
            Row(problem=PROBLEM, metric=f"decode tokens/s, batch 1, {label} ({where})", unit="tok/s",
                broken="hf generate", broken_value=rate["hf generate"], fixed="cache + compile",
                fixed_value=rate["cache + compile"]),
            Row(problem=PROBLEM, metric=f"decode tokens/s, batch 1, {label}, eager ({where})", unit="tok/s",
                broken="no cache", broken_value=rate["no cache"], fixed="cache", fixed_value=rate["cache"])
            if "no cache" in rate else
            Row(problem=PROBLEM, metric=f"decode tokens/s, batch 1, {label}, eager vs compiled ({where})",
                unit="tok/s", broken="cache", broken_value=rate["cache"], fixed="cache + compile",
                fixed_value=rate["cache + compile"]),
            Row(problem=PROBLEM, metric=f"weight bytes read / s, {label} ({where})", unit="GB/s",
                broken="copy bandwidth", broken_value=results["copy_bytes_per_s"] / 1e9, fixed="cache + compile",
                fixed_value=r["weight_bytes_read_per_s"]["cache + compile"] / 1e9),
        ]  # fmt: skip
    return out


def parameters_label(shape: str, parameters: int) -> str:
    """A shape's name in a row: "debug", "126M", "8.0B"."""
    if shape == "debug":
        return "debug"
    return f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.0f}M"


def table(results: dict[str, Any]) -> str:
    lines = [f"copy bandwidth: {results['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + written)"]
    if "device_name" in results:
        peak = results["peak_bytes_per_s"]
        lines.append(
            f"device: {results['device_name']}, peak bandwidth " + (f"{peak / 1e12:.2f} TB/s" if peak else "n/a")
        )
    for shape, r in results["shapes"].items():
        lines.append(
            f"{shape} ({r['parameters']:,} parameters, {r['weight_bytes'] / 2**20:.0f} MiB, {r['dtype']}, weights "
            f"{r['weights']}), {r['new_tokens']} new tokens, median of {r['rounds']} rounds, same tokens: "
            f"{r['same_tokens']}; cache + compile "
            + ("in a CUDA graph" if r["cuda_graphs"] else "without a CUDA graph")
        )
        if "no cache" not in r["decode_tokens_per_s"]:
            lines.append("  no cache         not run (built in memory: a whole-sequence forward per token)")
        for name in SETUPS:
            if name in r["decode_tokens_per_s"]:
                lines.append(
                    f"  {name:16s} {r['decode_tokens_per_s'][name]:8.1f} tokens/s  {r['ms_per_token'][name]:7.2f} ms "
                    f"a token  {r['weight_bytes_read_per_s'][name] / 1e9:6.2f} GB/s of weights"
                )
        if "bytes_read_per_token" in r:
            fraction = bandwidth_fraction(results, shape)
            read = r["bytes_read_per_token"]
            lines.append(
                f"  bytes read per decoded token: {read['weights'] / 2**20:.1f} MiB weights + "
                f"{read['kv_cache'] / 2**20:.1f} MiB KV cache; cache + compile reaches "
                + (f"{fraction:.1%} of the peak bandwidth" if fraction is not None else "n/a of the peak bandwidth")
            )
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=["debug", "100m"])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where there is one, else cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both models' weights")
    p.add_argument(
        "--in-memory",
        action="store_true",
        help=f"every shape as {' and '.join(IN_MEMORY)} are run: built on the device without a folder, no 'no cache'",
    )


def main(argv: list[str] | None = None) -> int:
    return harness.main("generation", argv, doc=__doc__, add_args=add_args, measure=measure, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
