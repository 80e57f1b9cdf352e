"""The user-facing error type and the one warning channel. Imports nothing from this repo.

`ConfigError` is every mistake in the user's input (config, data, tokenizer, checkpoint,
launch): one line per problem, naming the key or file and the fix, all problems together.
`train.py` prints it once (rank 0) and exits with status 2; nothing is written before.

`warn` is the one way this repo tells a user that a setting is ignored or risky: one line on
stderr, from global rank 0 only, once per message.
"""

from __future__ import annotations

import os
import sys


class ConfigError(ValueError):
    """A problem with the user's input; `problems` holds one line per mistake."""

    def __init__(self, *problems: str):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


_warned: set[str] = set()


def is_rank0() -> bool:
    """Global rank 0, or a process that torchrun did not start."""
    return os.environ.get("RANK", "0") == "0"


def warn(message: str) -> None:
    """Print `warning: <message>` to stderr on rank 0, once per distinct message."""
    if is_rank0() and message not in _warned:
        _warned.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)
