"""Watching a run: `eval.py --tasks ... --watch RUN_FOLDER` scores each step folder of a run as it lands, in the
layout of its own launch, beside the run (eval.py `watch`: the model built once, each new step's weights loaded into
it, the tasks scored by downstream.py's evaluator, as train.py's in-loop `[eval]` scores them). Here: its command-line
options and their checks, and the file of its scores (RUN_FOLDER/eval/watch-<tasks>.jsonl, one line per step), which
says what is scored already, so a restarted watch goes on where it stopped."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from errors import ConfigError


def scored_steps(path: Path) -> set[int]:
    """The steps `eval.py --watch` has scored into `path`."""
    if not path.is_file():
        return set()
    return {json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()}


def write_watch_row(path: Path, row: dict[str, Any]) -> None:
    """One step's scores appended to `path`, as one write of a whole line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def add_watch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--watch", type=Path, metavar="RUN_FOLDER", help="with --tasks: score each step of a run as it lands"
    )
    parser.add_argument("--poll-seconds", type=float, default=30.0, help="--watch: how often to look for a new step")


def check_watch(opts: argparse.Namespace) -> None:
    if not opts.tasks:
        raise ConfigError("--watch: name the lm-eval tasks to score with --tasks (the held-out loss is train.py's)")
    if opts.checkpoint is not None:
        raise ConfigError("--watch: scores every step of a run; give it alone, without --checkpoint")
    if not opts.watch.is_dir():
        raise ConfigError(f"--watch: {opts.watch} is not a folder; point it at a run's job.dump_folder")
