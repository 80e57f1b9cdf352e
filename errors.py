"""The user-facing errors and the one warning channel. Imports nothing from this repo.

`RecipeError` is a run that cannot go on, told in one line per problem, each naming the key or file and
the fix; the commands print it once (rank 0, `report`) and exit with status 2. Its kinds are named for
what failed: `ConfigError`, every mistake in the user's input (config, data, tokenizer, checkpoint,
launch), all problems of one round together; `TrainingStopped`, a run that stopped itself (more
non-finite steps than it tolerates); `DiskFull`, no space left where the run writes. What a run may have written before
it (its dump folder and lock, a tokenization cache of raw data) is whole: nothing half-written
that a rerun would trust (checkpoints publish only when complete, caches only with a manifest).

`writable_folder` is the one rule for folders the recipe writes to (dump, checkpoint, cache).

`warn` is the one way this repo tells a user that a setting is ignored or risky: one line on
stderr, from global rank 0 only, once per message.
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from pathlib import Path


class RecipeError(Exception):
    """A run that cannot go on; `problems` holds one line per problem."""

    def __init__(self, *problems: str):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class ConfigError(RecipeError, ValueError):
    """A problem with the user's input."""


class TrainingStopped(RecipeError):
    """Training stopped itself: its loss or gradients went non-finite more often than it tolerates."""


class DiskFull(RecipeError):
    """No space left on the device where the run writes (checkpoints, metrics, caches)."""


_warned: set[str] = set()


def is_rank0() -> bool:
    """Global rank 0, or a process that torchrun did not start."""
    return os.environ.get("RANK", "0") == "0"


def report(error: RecipeError) -> int:
    """Print a RecipeError's lines once (`error: ...` on stderr, from global rank 0) and return the exit status, 2."""
    if is_rank0():
        for problem in error.problems:
            print(f"error: {problem}", file=sys.stderr, flush=True)
    return 2


def warn(message: str) -> None:
    """Print `warning: <message>` to stderr on rank 0, once per distinct message."""
    if is_rank0() and message not in _warned:
        _warned.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)


def writable_folder(folder: Path, *, key: str) -> Path:
    """Create `folder` and prove a file can be written in it, or raise one line naming `key` that says why not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(
            f"{key}: {folder} exists and is not a folder (or a parent is a file); choose another"
        ) from None
    except OSError as e:
        why = {errno.ENAMETOOLONG: "its name is too long", errno.EROFS: "the file system is read-only"}.get(
            e.errno, e.strerror or type(e).__name__
        )
        raise ConfigError(f"{key}: cannot write to {folder} ({why}); choose a writable folder") from None
    return folder
