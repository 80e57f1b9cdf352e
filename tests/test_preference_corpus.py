"""The shipped preference corpus: what scripts/make_preference_corpus.py writes, in TRL's conversational preference
form, each pair short enough that its two sequences fill at most half of the debug model's window."""

from __future__ import annotations

import ast
import json
import shlex
import subprocess
import sys
from pathlib import Path

import tomllib

from data.chat import chat_renderer
from tests.launch import REPO

SCRIPT = REPO / "scripts" / "make_preference_corpus.py"
CORPUS = REPO / "assets" / "corpus"
SHIPPED = [CORPUS / "preferences.jsonl", CORPUS / "preferences_validation.jsonl"]


def docstring_commands() -> list[list[str]]:
    """The arguments of each `python scripts/make_preference_corpus.py ...` command of the script's docstring."""
    doc = ast.get_docstring(ast.parse(SCRIPT.read_text(encoding="utf-8")))
    assert doc is not None
    commands = [shlex.split(c) for c in doc.replace("\\\n", " ").splitlines() if "make_preference_corpus.py" in c]
    return [c[2:] for c in commands if c[:2] == ["python", "scripts/make_preference_corpus.py"]]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_docstring_s_commands_write_the_shipped_files(tmp_path: Path) -> None:
    commands = docstring_commands()
    assert len(commands) == 2, commands
    for args in commands:
        # The same command with every assets/corpus/ file in tmp_path: the validation split excludes the new training.
        args = [str(tmp_path / Path(a).name) if a.startswith("assets/corpus/") else a for a in args]
        # (A plain interpreter: the script imports nothing heavy, so tests/launch.py's warm server would only cost.)
        done = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    for shipped in SHIPPED:
        assert (tmp_path / shipped.name).read_bytes() == shipped.read_bytes(), shipped.name


def test_every_pair_is_a_conversational_preference_that_fits_half_a_window() -> None:
    seq_len = tomllib.loads((REPO / "configs" / "debug.toml").read_text(encoding="utf-8"))["training"]["seq_len"]
    renderer = chat_renderer(str(REPO / "assets" / "tokenizer"))
    lengths: dict[str, int] = {}  # a sequence's tokens, by its messages (many pairs share a prompt and reply)
    rights: dict[str, set[str]] = {}  # each prompt's chosen replies, in both files
    pairs = {shipped.name: read(shipped) for shipped in SHIPPED}
    assert (len(pairs["preferences.jsonl"]), len(pairs["preferences_validation.jsonl"])) == (2000, 200)
    for name, rows in pairs.items():
        for line, row in enumerate(rows, start=1):
            where = f"{name} line {line}"
            assert list(row) == ["prompt", "chosen", "rejected"], where
            roles = [m["role"] for m in row["prompt"]]
            assert roles in (["user"], ["system", "user"]), where
            for key in ("chosen", "rejected"):
                (message,) = row[key]
                assert message["role"] == "assistant", where
            for message in row["prompt"] + row["chosen"] + row["rejected"]:
                assert list(message) == ["role", "content"] and isinstance(message["content"], str), where
                assert message["content"].strip(), where
            chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
            assert chosen != rejected, where
            rights.setdefault(json.dumps(row["prompt"]), set()).add(chosen)
            total = 0
            for key in ("chosen", "rejected"):
                messages = row["prompt"] + row[key]
                if (seen := json.dumps(messages)) not in lengths:
                    lengths[seen] = len(renderer.render(messages, where=where)[0])
                total += lengths[seen]
            assert total <= (seq_len + 1) / 2, f"{where}: {total} tokens"
    # One right answer per question, so no rejected reply (never its own chosen) is right.
    assert all(len(chosen) == 1 for chosen in rights.values()), [c for c in rights.values() if len(c) > 1]
    held_out = {json.dumps(row["prompt"]) for row in pairs["preferences_validation.jsonl"]}
    assert not held_out & {json.dumps(row["prompt"]) for row in pairs["preferences.jsonl"]}
