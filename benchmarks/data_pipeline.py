"""What the data pipeline costs: preparation throughput by workers, bytes per token, loader time per
step, and block-causal against causal attention.

    python -m benchmarks.data_pipeline --out outputs/bench/data_pipeline.json    # one process (+ workers)

Measured here, in one run:
  preparation   scripts/prepare_data.py's `prepare` on a jsonl of --mb MB (the shipped corpus repeated),
                with 1 and with 2 worker processes, each into a fresh folder: input MB per second, the
                speedup, and whether the token files are the same byte for byte.
  on disk       bytes per token of the token shards (uint16 below 65,536 tokens: 2, plus headers).
  loader        GlobalBatchLoader.next_step() of one rank at seq_len --seq-len, shuffled, global batch
                --global-batch: milliseconds per step (what the training loop waits for on the host).
  attention     forward + backward of the debug model at seq_len --attn-seq-len on windows of the
                shipped corpus, causal SDPA vs block_causal, taking turns: median milliseconds of
                --attn-steps steps. On CPU, where block_causal is SDPA with a dense mask: it buys
                correctness (no document sees another) and costs time. On CUDA block_causal is
                FlexAttention, which skips the blocks no query may see: `make bench-gpu` times it
                (benchmarks/cuda_paths.py), against the same mask dense.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import harness
from benchmarks.harness import Row
from config import REPO
from data.corpus import TokenCorpus
from data.loader import GlobalBatchLoader
from data.prepare import prepare
from data.sources import find_source
from models import with_seq_len
from models.llama3 import FLAVORS, Transformer

PROBLEM_PREP, PROBLEM_ATTN = "data preparation", "block-causal attention"
SHIPPED, TOKENIZER = REPO / "assets" / "corpus" / "stories.jsonl", str(REPO / "assets" / "tokenizer")


def preparation(folder: Path, *, mb: int) -> dict[str, Any]:
    corpus = folder / "corpus.jsonl"
    shipped = SHIPPED.read_bytes()
    with open(corpus, "wb") as f:
        for _ in range(max(1, round(mb * 1e6 / len(shipped)))):
            f.write(shipped)
    source = find_source(str(corpus))
    runs = {}
    for workers in (1, 2):
        out = folder / f"workers-{workers}"
        begin = time.perf_counter()
        # Chunks of 1 MiB: several per worker, balanced (the last, when under half a chunk, joins the one before).
        manifest = prepare(source, TOKENIZER, out, workers=workers, chunk_bytes=2**20)
        seconds = time.perf_counter() - begin
        runs[str(workers)] = {"seconds": seconds, "mb_per_s": source.input_bytes / 1e6 / seconds}
    files = [s["tokens_file"] for s in manifest["shards"]]
    identical = all((folder / "workers-1" / f).read_bytes() == (folder / "workers-2" / f).read_bytes() for f in files)
    on_disk = sum((folder / "workers-1" / f).stat().st_size for f in files)
    return {
        "input_mb": source.input_bytes / 1e6, "tokens": manifest["tokens"], "shards": len(files), "runs": runs,
        "speedup": runs["1"]["seconds"] / runs["2"]["seconds"], "identical": identical,
        "bytes_per_token": on_disk / manifest["tokens"], "input_bytes_per_token": source.input_bytes / manifest["tokens"],
    }  # fmt: skip


def loader_step(folder: Path, *, seq_len: int, global_batch: int, steps: int = 20) -> dict[str, Any]:
    corpus = TokenCorpus(folder)
    loader = GlobalBatchLoader(
        corpus,
        window=seq_len + 1,
        local_batch_size=global_batch // 8,
        global_batch_size=global_batch,
        dp_rank=0,
        dp_degree=8,
        shuffle=True,
        seed=0,
    )
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        list(loader.next_step())
        times.append(time.perf_counter() - begin)
    return {"ms": 1e3 * statistics.median(times), "seq_len": seq_len, "global_batch": global_batch, "ranks": 8}


def attention(folder: Path, *, seq_len: int, steps: int) -> dict[str, Any]:
    """Forward + backward of the debug model on real windows, causal vs block_causal, interleaved: each step runs
    both, which goes first alternating, so that both see the machine's load alike."""
    corpus = TokenCorpus(folder)
    loader = GlobalBatchLoader(
        corpus, window=seq_len + 1, local_batch_size=2, global_batch_size=2, dp_rank=0, dp_degree=1
    )
    batch = next(loader.next_step())
    models = {}
    for kind in ("causal", "block_causal"):
        torch.manual_seed(0)
        models[kind] = Transformer(
            dataclasses.replace(with_seq_len(FLAVORS["debugmodel"], seq_len), attn_mask_type=kind)
        )
        models[kind].init_weights()
    times: dict[str, list[float]] = {kind: [] for kind in models}
    for step in range(steps + 1):  # the first round warms up
        for kind in models if step % 2 == 0 else reversed(models):
            model = models[kind]
            begin = time.perf_counter()
            logits = model(batch.inputs, segments=batch.segments)
            F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).backward()
            if step:
                times[kind].append(time.perf_counter() - begin)
    documents = float((batch.segments[:, -1] + 1).float().mean())
    return {"ms": {kind: 1e3 * statistics.median(t) for kind, t in times.items()}, "seq_len": seq_len,
            "documents_per_window": documents}  # fmt: skip


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="data_bench_") as tmp:
        folder = Path(tmp)
        prep = preparation(folder, mb=args.mb)
        results = {
            "preparation": prep,
            "loader": loader_step(folder / "workers-1", seq_len=args.seq_len, global_batch=args.global_batch),
            "attention": attention(folder / "workers-1", seq_len=args.attn_seq_len, steps=args.attn_steps),
        }
        shutil.rmtree(folder, ignore_errors=True)
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    """Preparation by workers and bytes per token; block-causal vs causal, with a note that says which is the faster
    here and where block_causal is another kernel. (The loader's time per step has nothing to compare with: it is in
    the table and the JSON.)"""
    prep, attn = results["preparation"], results["attention"]
    runs, ms = prep["runs"], attn["ms"]
    faster, slower = sorted(("causal", "block_causal"), key=lambda kind: ms[kind])
    # Which side is faster where: here block_causal is a dense mask; on GPUs FlexAttention, which skips masked blocks.
    note = f"CPU, a dense mask: {faster} is {ms[slower] / ms[faster]:.2f}x faster.\nGPU, FlexAttention: make bench-gpu."
    return [
        Row(problem=PROBLEM_PREP, metric="tokenizing throughput (2 CPU cores)", unit="MB/s", broken="1 worker",
            broken_value=runs["1"]["mb_per_s"], fixed="2 workers", fixed_value=runs["2"]["mb_per_s"]),
        Row(problem=PROBLEM_PREP, metric="bytes on disk per token", unit="B", broken="raw jsonl",
            broken_value=prep["input_bytes_per_token"], fixed="token shards", fixed_value=prep["bytes_per_token"]),
        Row(problem=PROBLEM_ATTN, metric=f"forward + backward, debug model, seq {attn['seq_len']} (CPU)", unit="ms",
            broken="causal", broken_value=ms["causal"], fixed="block_causal", fixed_value=ms["block_causal"],
            note=note),
    ]  # fmt: skip


def table(results: dict[str, Any]) -> str:
    prep, loader, attn = results["preparation"], results["loader"], results["attention"]
    r1, r2 = prep["runs"]["1"], prep["runs"]["2"]
    return "\n".join(
        [
            f"preparation of {prep['input_mb']:.1f} MB ({prep['tokens']:,} tokens, {prep['shards']} shards): "
            f"1 worker {r1['seconds']:.1f} s ({r1['mb_per_s']:.2f} MB/s), 2 workers {r2['seconds']:.1f} s "
            f"({r2['mb_per_s']:.2f} MB/s), speedup {prep['speedup']:.2f}x, same token files: {prep['identical']}",
            f"on disk: {prep['bytes_per_token']:.3f} bytes per token (raw text: {prep['input_bytes_per_token']:.2f})",
            f"loader: {loader['ms']:.2f} ms per step (seq {loader['seq_len']}, global batch {loader['global_batch']} "
            f"on {loader['ranks']} ranks, shuffled, one rank's share)",
            f"attention, debug model fwd+bwd at seq {attn['seq_len']} ({attn['documents_per_window']:.1f} documents per "
            f"window): causal {attn['ms']['causal']:.0f} ms, block_causal {attn['ms']['block_causal']:.0f} ms",
        ]
    )


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", type=int, default=50, help="size of the corpus to prepare, MB")
    p.add_argument("--seq-len", type=int, default=8192, help="the loader's seq_len")
    p.add_argument("--global-batch", type=int, default=64, help="the loader's global batch (8 ranks)")
    p.add_argument("--attn-seq-len", type=int, default=1024, help="seq_len of the attention comparison")
    p.add_argument("--attn-steps", type=int, default=5, help="timed steps of each attention (after one warm-up)")


def main(argv: list[str] | None = None) -> int:
    return harness.main("data_pipeline", argv, doc=__doc__, add_args=add_args, measure=measure, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
