"""Decoding speed of generate.py beside transformers' `generate`, on the same weights, batch 1.

    python -m benchmarks.generation --out outputs/bench/generation.json       # one process, CPU

Two Llama shapes: the debug model (6M parameters) and one of about 100M (dim 768, 12 layers, 12 heads, 4 KV heads,
32768 tokens). A random transformers LlamaForCausalLM in fp32, saved as a Hugging Face folder, and this repo's model
loaded from that folder. Each setup greedily decodes `--new-tokens` tokens after a 16-token prompt, never stopping
early:

    hf generate         transformers' generate(do_sample=False), its own KV cache
    no cache            our model, the whole sequence recomputed for every new token (what a stateless forward
                        costs without a cache)
    cache               generate.py's Generator: a prefill, then one token per forward from the KV cache
    cache + compile     the same with the decode step compiled (compiled before the timed rounds)

Decode tokens/s = (new_tokens - 1) / (time of new_tokens - time of 1 new token): the prompt's forward cancels,
for every setup alike. The setups take turns within each round (--rounds), so they share the machine's noise; the
median round counts. All four produce the same tokens (checked).

At batch 1 a decode step reads every weight once, so its limit is memory bandwidth: "weight bytes read / s" is the
parameter bytes times decode tokens/s, beside this machine's copy bandwidth measured in the same run (a 256 MiB
fp32 tensor copied: bytes read + written per second, STREAM's convention).

On a GPU (`--device cuda`, the default where there is one; `make bench-gpu` runs the "1b" shape, Llama 3.2 1B's,
in bf16) it also reports the fraction of the GPU's peak memory bandwidth the compiled decode reaches: the bytes
one decoded token reads (every weight but the token embedding table, of which one row, plus the whole KV cache
buffer, which the fixed-shape decode step attends over) x decode tokens/s / the peak of PEAK_BANDWIDTH for this
device's name; n/a for a device not in that table or on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import harness
from benchmarks.harness import Row
from generate import CACHE_LENGTH_MULTIPLE, Generator
from models.hf import from_hf
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
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=192, vocab_size=512),  # the benchmark's own test
}  # fmt: skip
SETUPS = ("hf generate", "no cache", "cache", "cache + compile")
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
    Generator allocates for prompt + new_tokens (models/kv_cache.py: max_len rounded up, every position attended)."""
    args = model.args
    embedding = model.tok_embeddings.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= embedding.numel() * embedding.element_size() - args.dim * embedding.element_size()
    max_len = min(-(-(prompt + new_tokens) // CACHE_LENGTH_MULTIPLE) * CACHE_LENGTH_MULTIPLE, args.max_seq_len)
    max_len = max(max_len, prompt + new_tokens)
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


def decoders(reference: nn.Module, ours: nn.Module, prompt: torch.Tensor) -> dict[str, Callable[[int], list[int]]]:
    """Each setup as new_tokens -> the greedy tokens after `prompt` (1, PROMPT)."""
    compiled = Generator(ours, compile=True)

    def hf(n: int) -> list[int]:
        out = reference.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n, min_new_tokens=n,
            pad_token_id=0,
        )  # fmt: skip
        return out[0, prompt.shape[1] :].tolist()

    @torch.no_grad()
    def no_cache(n: int) -> list[int]:
        tokens = prompt
        for _ in range(n):
            tokens = torch.cat([tokens, ours(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return tokens[0, prompt.shape[1] :].tolist()

    return {
        "hf generate": hf,
        "no cache": no_cache,
        "cache": lambda n: Generator(ours).generate(prompt.tolist(), max_new_tokens=n)[0],
        "cache + compile": lambda n: compiled.generate(prompt.tolist(), max_new_tokens=n)[0],
    }


def measure_shape(
    shape: str, *, new_tokens: int, rounds: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    device = torch.device(device)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=512, rope_theta=500000.0,
                         attn_implementation="sdpa")  # fmt: skip
    reference = LlamaForCausalLM(config).float().eval()
    unit_scale_init_(reference, seed=0)
    with tempfile.TemporaryDirectory(prefix="generation_bench_") as tmp:
        reference.save_pretrained(tmp)
        ours, _ = from_hf(Path(tmp), dtype=dtype, device=device)
    reference = reference.to(device=device, dtype=dtype)
    ours.eval()
    prompt = torch.randint(3, config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0)).to(device)
    setups = decoders(reference, ours, prompt)
    tokens = {name: decode(new_tokens) for name, decode in setups.items()}  # warm-up: compiles the decode step
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
        "bytes_read_per_token": read,
        "parameters": sum(p.numel() for p in ours.parameters()),
        "weight_bytes": weight_bytes,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "decode_tokens_per_s": rate,
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
    results["shapes"] = {
        s: measure_shape(s, new_tokens=args.new_tokens, rounds=args.rounds, device=device, dtype=dtype)
        for s in args.shapes
    }
    return results


def bandwidth_fraction(results: dict[str, Any], shape: str) -> float | None:
    """Bytes one decoded token reads x the compiled decode's tokens/s / the device's peak bandwidth; None where the
    peak is unknown (CPU, a GPU not in PEAK_BANDWIDTH)."""
    peak, r = results.get("peak_bytes_per_s"), results["shapes"][shape]
    if not peak or "bytes_read_per_token" not in r:
        return None
    return sum(r["bytes_read_per_token"].values()) * r["decode_tokens_per_s"]["cache + compile"] / peak


def rows(results: dict[str, Any]) -> list[Row]:
    """Per shape: transformers vs ours with cache + compile (the headline), no cache vs cache, and the weight bytes
    read per second beside the machine's copy bandwidth."""
    out = []
    where = "GPU" if results.get("device") == "cuda" else "CPU"
    for shape, r in results["shapes"].items():
        rate, label = r["decode_tokens_per_s"], f"{r['parameters'] / 1e6:.0f}M" if shape != "debug" else "debug"
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
                broken="no cache", broken_value=rate["no cache"], fixed="cache", fixed_value=rate["cache"]),
            Row(problem=PROBLEM, metric=f"weight bytes read / s, {label} ({where})", unit="GB/s",
                broken="copy bandwidth", broken_value=results["copy_bytes_per_s"] / 1e9, fixed="cache + compile",
                fixed_value=r["weight_bytes_read_per_s"]["cache + compile"] / 1e9),
        ]  # fmt: skip
    return out


def table(results: dict[str, Any]) -> str:
    lines = [f"copy bandwidth: {results['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + written)"]
    if "device_name" in results:
        peak = results["peak_bytes_per_s"]
        lines.append(
            f"device: {results['device_name']}, peak bandwidth " + (f"{peak / 1e12:.2f} TB/s" if peak else "n/a")
        )
    for shape, r in results["shapes"].items():
        lines.append(
            f"{shape} ({r['parameters']:,} parameters, {r['weight_bytes'] / 2**20:.0f} MiB), {r['new_tokens']} new tokens, "
            f"median of {r['rounds']} rounds, same tokens: {r['same_tokens']}"
        )
        for name in SETUPS:
            lines.append(
                f"  {name:16s} {r['decode_tokens_per_s'][name]:8.1f} tokens/s  "
                f"{r['weight_bytes_read_per_s'][name] / 1e9:6.2f} GB/s of weights"
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


def main(argv: list[str] | None = None) -> int:
    return harness.main("generation", argv, doc=__doc__, add_args=add_args, measure=measure, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
