"""Tokenize a corpus once into the token shards train.py memory-maps (`[data] path = OUTPUT`).

    python scripts/prepare_data.py --source assets/corpus/stories.jsonl --tokenizer assets/tokenizer \\
        --output data/stories --workers 2
    python scripts/prepare_data.py --source HuggingFaceFW/fineweb-edu --format hub --name sample-10BT \\
        --tokenizer assets/hf/Llama-3.1-8B --output data/fineweb-edu-10BT-llama3 --workers 64
    # Across nodes: task K of N (a Slurm array: scripts/slurm/prepare_data.sbatch) writes chunks K, K + N, ...
    python scripts/prepare_data.py ... --task $SLURM_ARRAY_TASK_ID --tasks $SLURM_ARRAY_TASK_COUNT

SOURCE: a local .jsonl/.json(.gz)/.parquet/.txt file or a folder of them, or with --format hub a
Hugging Face dataset name, streamed (needs a network). Each worker process tokenizes chunks of
16 MB of input with one core; the token files do not depend on the number of workers, and a
rerun after an interruption skips the chunks already done. With --task/--tasks each task reads the
whole input (chunk boundaries need it) and tokenizes its share; the last task to finish writes the
manifest, and the result is byte for byte what one machine writes (`--finish` writes the manifest
from the tasks' records alone, should a shared filesystem have hidden one from the last task). The
output folder's layout is described in data/prepare.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# Runnable without installing the repo: its root holds data/ and errors.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.prepare import CHUNK_BYTES, finish, prepare  # noqa: E402
from data.sources import find_source  # noqa: E402
from data.tokenizers import build_tokenizer  # noqa: E402
from errors import ConfigError, report  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", help="file, folder, or hub dataset name (with --format hub); required but with --finish")
    p.add_argument("--format", default="auto", choices=["auto", "json", "parquet", "text", "hub"])
    p.add_argument("--name", default=None, help="hub dataset configuration, e.g. sample-10BT")
    p.add_argument("--split", default="train", help="hub dataset split")
    p.add_argument("--text-column", default="text")
    p.add_argument(
        "--tokenizer", help='tokenizer.json, a Hugging Face tokenizer folder, or "byte"; required but with --finish'
    )
    p.add_argument("--output", required=True, type=Path, help="the folder to write (resumed if it holds a partial run)")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizing processes (default: all cores)")
    p.add_argument("--chunk-mb", type=float, default=CHUNK_BYTES / 2**20, help="input per shard, MB (default 16)")
    p.add_argument("--task", type=int, default=0, help="this task's index, 0..tasks-1 (e.g. $SLURM_ARRAY_TASK_ID)")
    p.add_argument("--tasks", type=int, default=1, help="tasks sharing the preparation (one per node)")
    p.add_argument("--finish", action="store_true", help="write the manifest once all --tasks tasks are done")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.workers < 1:
            raise ConfigError(f"--workers: must be >= 1, got {args.workers}")
        if args.tasks < 1 or not 0 <= args.task < args.tasks:
            raise ConfigError(f"--task: must be in 0..{args.tasks - 1} (--tasks {args.tasks}), got {args.task}")
        if args.finish:
            manifest = finish(args.output, tasks=args.tasks)
            print(
                f"wrote {args.output / 'manifest.json'}: {manifest['tokens']:,} tokens, {len(manifest['shards'])} shards"
            )
            return 0
        for key in ("source", "tokenizer"):
            if getattr(args, key) is None:
                raise ConfigError(f"--{key}: required (only --finish goes without it)")
        source = find_source(
            args.source,
            fmt=args.format,
            text_column=args.text_column,
            name=args.name,
            split=args.split,
            key="--source",
        )
        build_tokenizer(args.tokenizer, key="--tokenizer")  # its problems in this script's words
        begin = time.perf_counter()
        manifest = prepare(
            source,
            args.tokenizer,
            args.output,
            workers=args.workers,
            chunk_bytes=int(args.chunk_mb * 2**20),
            task=(args.task, args.tasks),
            progress=lambda line: print(line, flush=True),
        )
    except ConfigError as e:
        return report(e)
    seconds = time.perf_counter() - begin
    if manifest is None:
        print(
            f"task {args.task} of {args.tasks}: its shards are written ({seconds:.1f} s); the last task to finish writes "
            f"the manifest (or: python {Path(__file__).resolve()} --output {args.output} --tasks {args.tasks} --finish)",
            flush=True,
        )
        return 0
    on_disk = sum((args.output / s["tokens_file"]).stat().st_size for s in manifest["shards"])
    print(
        f"wrote {args.output}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens ({manifest['dtype']}, "
        f"{on_disk / manifest['tokens']:.2f} bytes per token on disk), {len(manifest['shards'])} shards, from "
        f"{manifest['input_bytes'] / 1e6:,.1f} MB in {seconds:.1f} s ({manifest['input_bytes'] / 1e6 / seconds:,.2f} MB/s "
        f"with {args.workers} workers)",
        flush=True,
    )
    if manifest["null_documents"]:
        print(f"skipped {manifest['null_documents']:,} documents without text (null)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
