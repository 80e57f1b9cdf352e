"""Tokenize a corpus once into the token shards train.py memory-maps (`[data] path = OUTPUT`).

    python scripts/prepare_data.py --source assets/corpus/stories.jsonl --tokenizer assets/tokenizer \\
        --output data/stories --workers 2
    python scripts/prepare_data.py --source data/hf/fineweb-edu --name sample-10BT \\
        --tokenizer assets/hf/Llama-3.1-8B --output data/fineweb-edu-10BT-llama3 --workers 64
    python scripts/prepare_data.py --source HuggingFaceFW/fineweb-edu --format hub --name sample-10BT ...
    # Chat data ([data] chat = true): the tokenizer folder's chat template, the assistant's tokens marked
    python scripts/prepare_data.py --source assets/corpus/chat.jsonl --chat --tokenizer assets/tokenizer \
        --output data/chat --workers 2
    # Preference pairs (dpo.py): TRL's prompt / chosen / rejected columns, each pair two documents
    python scripts/prepare_data.py --source assets/corpus/preferences.jsonl --chat --pairs \
        --tokenizer assets/tokenizer --output data/preferences --workers 2
    # Across nodes: task K of N (a Slurm array: scripts/slurm/prepare_data.sbatch) reads and writes chunks K, K + N, ...
    python scripts/prepare_data.py ... --task $SLURM_ARRAY_TASK_ID --tasks $SLURM_ARRAY_TASK_COUNT

SOURCE: a local .jsonl/.json(.gz)/.parquet/.arrow/.txt file or a folder of them, a `save_to_disk`
folder (Dataset or DatasetDict), a folder `hf download --repo-type dataset --local-dir` wrote, or a
dataset name found in the local Hugging Face cache; with --format hub a dataset name not cached is
streamed from the hub (needs a network). --name and --split pick the configuration and split as
`datasets` does. Each worker process tokenizes chunks of 16 MB of input with one core; the token
files do not depend on the number of workers, and a rerun after an interruption skips the chunks
already done. With --task/--tasks the chunks are planned from the files' sizes and metadata, and
each task reads and tokenizes only its share (a hub stream is read by every task); the last task to
finish writes the manifest, and the result is byte for byte what one machine writes (`--finish`
writes the manifest from the tasks' records alone, should a shared filesystem have hidden one from
the last task). The output folder's layout is described in data/prepare.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

# Runnable without installing the repo: its root holds data/ and errors.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.prepare import CHUNK_BYTES, finish, prepare, task_record  # noqa: E402
from data.sources import find_source  # noqa: E402
from data.tokenizers import build_tokenizer  # noqa: E402
from errors import ConfigError, report  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--source", help="file, folder, or dataset name (cached, or with --format hub); required but with --finish"
    )
    p.add_argument("--format", default="auto", choices=["auto", "json", "parquet", "text", "hub"])
    p.add_argument("--name", default=None, help="dataset configuration, e.g. sample-10BT")
    p.add_argument(
        "--split", default="train", help="dataset split (a DatasetDict's, a hub-layout folder's or a hub dataset's)"
    )
    p.add_argument("--text-column", default="text")
    p.add_argument(
        "--chat",
        action="store_true",
        help="rows are conversations (--messages-column), rendered with the tokenizer folder's chat template; only the "
        "assistant's tokens count in the loss (train with [data] chat = true)",
    )
    p.add_argument("--messages-column", default="messages", help="with --chat: the column of message lists")
    p.add_argument(
        "--pairs",
        action="store_true",
        help="with --chat: rows are preference pairs (prompt, chosen, rejected: TRL's formats), each two documents "
        "(train with [dpo] enable = true)",
    )
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
            text_column=args.messages_column if args.chat else args.text_column,
            name=args.name,
            split=args.split,
            key="--source",
            tokenizer=args.tokenizer,
        )
        source = dataclasses.replace(source, chat=args.chat or args.pairs, pairs=args.pairs)
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
    if args.tasks > 1:
        done = task_record(args.output, (args.task, args.tasks))
        print(
            f"task {args.task} of {args.tasks}: its shards are written ({seconds:.1f} s), {done['read_bytes']:,} bytes "
            f"read for its {done['share_bytes']:,} of the input's {source.input_bytes:,}",
            flush=True,
        )
    if manifest is None:
        print(
            f"the last task to finish writes the manifest (or: python {Path(__file__).resolve()} --output "
            f"{args.output} --tasks {args.tasks} --finish)",
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
    if "loss_tokens" in manifest:
        print(f"{manifest['loss_tokens']:,} of the tokens are the assistant's (counted in the loss)", flush=True)
    if manifest["null_documents"]:
        print(f"skipped {manifest['null_documents']:,} documents without text (null)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
