"""Rerun the commands whose output the docs quote, and rewrite the quoted blocks.

    python scripts/record_transcripts.py              # rerun every block, rewrite those that changed
    python scripts/record_transcripts.py --check      # rewrite nothing; exit 1 naming the blocks that differ
    python scripts/record_transcripts.py --cheap      # only the blocks marked cheap (what tests/test_docs.py runs)
    python scripts/record_transcripts.py --only 405b  # only the blocks whose command contains this text

A quoted block in README.md, docs/*.md or docs/results/*.md sits between two HTML comments, which
Markdown does not show:

    <!-- transcript cheap echo: WORLD_SIZE=512 python train.py --config configs/llama3_405b.toml --comm.mode=fake_backend -->
    ```
    $ WORLD_SIZE=512 python train.py --config configs/llama3_405b.toml --comm.mode=fake_backend
    llama3 llama3_405b: 405.85B parameters on 512 ranks = ...
    ```
    <!-- /transcript -->

The command runs through bash from the repo root, with this Python's folder first on PATH (so
`python`, `torchrun` and `.venv/bin/python` are the venv's) and its stdout and stderr together;
a pipe (`| grep ...`) picks lines. Words before the colon:

    cheap   it runs in seconds without training (a dry run, --print-config, planning/doctor.py,
            planning/estimate_memory.py, a refused start); tests/test_docs.py reruns every cheap block
    echo    the block starts with `$ command`

What differs from run to run is compared as `#`, never written so: times (`2.1 s`, `1298 ms`,
`eta 2m27s`), tokens/s and memory of a training log. A block whose output changed only there is
left as it is; a changed block is rewritten whole, with this run's times. This checkout's path
is written as `.` and the home folder as `~`. A command that prints a Python traceback fails,
and its block is left as it is.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# docs/results/ last: its make train block runs before the generate and eval blocks that read its checkpoint.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "results").glob("*.md"))]

BLOCK = re.compile(
    r"^<!-- transcript(?P<opts>(?: [a-z]+)*): (?P<command>.+?) -->\n(?P<fence>```\w*)\n(?P<body>.*?)^```\n<!-- /transcript -->$",
    flags=re.M | re.S,
)
OPTIONS = {"cheap", "echo"}
# What varies between two runs of the same command; compared as "#".
VARYING = [
    re.compile(r"\b\d+m\d+s\b"),  # eta 2m27s
    re.compile(r"(?<=tps/rank )[\d,]+"),
    re.compile(r"(?<=mem )[\d.]+(?= GiB)"),
    re.compile(r"\b\d[\d,]*(\.\d+)?(?= ?(s|ms)\b)"),  # 2.1 s, 1298 ms
]
# Launcher and environment variables that would change what a command does.
UNSET = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@dataclass
class Transcript:
    page: Path
    line: int
    command: str
    options: set[str]
    fence: str
    body: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}: {self.command}"


def find(pages: list[Path] = PAGES) -> list[Transcript]:
    found = []
    for page in pages:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            options = set(m["opts"].split())
            if unknown := options - OPTIONS:
                raise SystemExit(f"{page}: unknown transcript option(s) {sorted(unknown)}; known: {sorted(OPTIONS)}")
            line = text.count("\n", 0, m.start()) + 1
            found.append(Transcript(page, line, m["command"], options, m["fence"], m["body"]))
    return found


def run(t: Transcript, *, timeout: float) -> tuple[str, str | None]:
    """(the block's new body, or a reason it could not be made)."""
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr interleaved as printed
    env.setdefault("OMP_NUM_THREADS", "1")  # as `make train` and torchrun set it
    try:
        proc = subprocess.run(
            ["bash", "-c", t.command],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return "", f"ran past {timeout:.0f} s"
    out = proc.stdout
    if "Traceback (most recent call last)" in out:
        return "", f"exited {proc.returncode} with a traceback:\n{out[-3000:]}"
    out = out.replace(f"{REPO}/", "").replace(str(REPO), ".").replace(str(Path.home()), "~")
    lines = [line.rstrip() for line in out.strip("\n").splitlines()]
    if not lines:
        return "", f"exited {proc.returncode} and printed nothing"
    if "echo" in t.options:
        lines.insert(0, f"$ {t.command}")
    return "\n".join(lines) + "\n", None


def comparable(body: str) -> str:
    for pattern in VARYING:
        body = pattern.sub("#", body)
    return body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if a block differs")
    parser.add_argument("--cheap", action="store_true", help="only the blocks marked cheap")
    parser.add_argument("--only", default="", help="only the blocks whose command contains this text")
    parser.add_argument("--jobs", type=int, default=2, help="cheap commands run at once (the others one by one)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a command may run")
    args = parser.parse_args()

    todo = [t for t in find() if (not args.cheap or "cheap" in t.options) and args.only in t.command]
    cheap, expensive = [t for t in todo if "cheap" in t.options], [t for t in todo if "cheap" not in t.options]
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        results = list(pool.map(lambda t: run(t, timeout=args.timeout), cheap))
    results += [run(t, timeout=args.timeout) for t in expensive]

    failed, differ, new = [], [], {}
    for t, (body, problem) in zip(cheap + expensive, results, strict=True):
        if problem:
            failed.append(f"{t.name}\n  {problem}")
        elif comparable(body) != comparable(t.body):
            differ.append(t)
            new[(t.page, t.command, t.body)] = body
    for line in failed:
        print(f"failed: {line}")
    if args.check:
        for t in differ:
            print(f"differs: {t.name}")
            print(_diff(t.body, new[(t.page, t.command, t.body)]))
    else:
        for page in {t.page for t in differ}:
            # Blocks are known by their command and recorded body, not by line: the page may have been edited
            # while the commands ran.
            def replace(m: re.Match[str], page: Path = page) -> str:
                body = new.get((page, m["command"], m["body"]))
                if body is None:
                    return m[0]
                return m[0][: m.start("body") - m.start()] + body + m[0][m.end("body") - m.start() :]

            page.write_text(BLOCK.sub(replace, page.read_text()))
        for t in differ:
            print(f"rewrote: {t.name}")
    print(
        f"{len(todo)} transcript(s): {len(todo) - len(differ) - len(failed)} unchanged, {len(differ)} "
        f"{'differ' if args.check else 'rewritten'}, {len(failed)} failed"
    )
    return 1 if failed or (args.check and differ) else 0


def _diff(old: str, new: str) -> str:
    import difflib

    lines = difflib.unified_diff(old.splitlines(), new.splitlines(), "recorded", "now", lineterm="", n=1)
    return "\n".join(f"    {line}" for line in lines)


if __name__ == "__main__":
    sys.exit(main())
