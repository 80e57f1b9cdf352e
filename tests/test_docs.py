"""The docs hold: their links resolve, the outputs they quote are what their commands print (the cheap ones; all of
them: `python scripts/record_transcripts.py --check`), the commands README.md shows for planning are among them, and
every number this repo measured is stated on docs/benchmarks.md (README.md and the other pages link to it), each
quoted there from the results row it cites (docs/results/*.jsonl, where every record is kept).

(The removal table is performed by tests/test_removal.py; the torchtitan keys by tests/test_torchtitan.py.)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO

RESULTS = REPO / "docs" / "results"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(RESULTS.glob("*.md"))]
# A measured quantity: a number with decimals or thousands (settings are round: 8 GPUs, 300 s, 16 MB chunks) and
# the unit of a time, a size, a speed or a share; or a ratio such as 1.85x.
MEASURED = re.compile(
    r"(?<![\w.])(\d{1,3}(,\d{3})+(\.\d+)?|\d+\.\d+)\s?(ms|s|seconds?|minutes?|min|h|GiB|MiB|KiB|GB|MB|KB|B/s"
    r"|MB/s|tok/s|tokens/s|%)(?![\w/])|(?<![\w.])\d+(\.\d+)?x(?!\w)"
)
# Pages that may state measured numbers: the record, the failures' public reports (each with its source), and the
# results pages (transcripts, the floor table), which are records themselves.
RECORDS = {REPO / "docs" / "benchmarks.md", REPO / "docs" / "failures.md", *RESULTS.glob("*.md")}
# A number docs/benchmarks.md quotes and its results row must hold: decimals (not a version such as 2.11.0, not a
# tolerance such as 1.9e-5), thousands, a time as 20:45. Integers are mostly settings (8 steps, seq 4096) and are
# not compared.
NUMBER = re.compile(r"(?<![\w.:])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d+:\d{2})(?![.,:]?\d|e[-+]?\d)")
# A citation of a results row: [id](results/FILE.jsonl).
CITE = re.compile(r"\[([\w-]+)\]\(results/(\w+)\.jsonl\)")
ROW_KEYS = {"id", "date", "commit", "machine", "command", "section", "figures", "text"}


def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(text: str) -> str:
    """The text outside code fences and inline code."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`]*`", "", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target} does not exist"
        assert str(file).startswith(str(REPO)), f"{page.name}: {target} points outside the repo"
        if anchor and file.suffix == ".md":
            anchors = {_anchor(h) for h in re.findall(r"^#+\s+(.*)$", file.read_text(), flags=re.M)}
            assert anchor in anchors, f"{page.name}: #{anchor} is no heading of {file.name}"


@pytest.mark.parametrize("page", [p for p in PAGES if p not in RECORDS], ids=lambda p: p.name)
def test_measured_numbers_live_in_benchmarks_md(page: Path) -> None:
    found = [m.group(0) for m in MEASURED.finditer(_prose(page.read_text()))]
    assert not found, f"{page.name} states {found}: record them in docs/benchmarks.md and link there"


def _results() -> dict[str, dict[str, dict]]:
    """{file stem: {row id: row}} of docs/results/*.jsonl."""
    return {
        f.stem: {row["id"]: row for row in map(json.loads, f.read_text().splitlines())}
        for f in sorted(RESULTS.glob("*.jsonl"))
    }


def test_the_results_rows_say_when_where_and_how() -> None:
    """Each line of docs/results/*.jsonl is one record: its id (unique over the files), the date, the commit that
    recorded it (7 hex digits, or null where unknown), the machine, the command (or null), its figures and the text
    it was recorded with."""
    ids: list[str] = []
    for f in sorted(RESULTS.glob("*.jsonl")):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            row = json.loads(line)
            where = f"{f.name}:{n}"
            assert set(row) == ROW_KEYS, f"{where}: keys {sorted(row)}, expected {sorted(ROW_KEYS)}"
            assert re.fullmatch(r"[\w-]+", row["id"]), f"{where}: id {row['id']!r}"
            assert re.fullmatch(r"20\d\d-\d\d-\d\d", row["date"]), f"{where}: date {row['date']!r}"
            assert row["commit"] is None or re.fullmatch(r"[0-9a-f]{7}", row["commit"]), f"{where}: commit"
            assert row["machine"] and row["text"] and isinstance(row["figures"], list | dict), f"{where}: machine, text"
            ids.append(row["id"])
    assert len(ids) > 100 and len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]


def _strings(value: object) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [str(value)] if value is not None else []


def _blocks(text: str) -> list[tuple[str, str]]:
    """docs/benchmarks.md's prose as (block, citing context): each table row with its header row as context, each
    list item, each other paragraph; headings, code fences and inline code left out."""
    blocks, header, paragraph = [], "", []
    for line in [*_prose(text).splitlines(), ""]:
        if paragraph and (not line.strip() or line.startswith(("|", "- ", "#"))):
            blocks.append((" ".join(paragraph), ""))
            paragraph = []
        if line.startswith("|"):
            if re.fullmatch(r"\|[-:| ]+\|", line.strip()):
                continue
            if not header:
                header = line
            blocks.append((line, header))
        elif line.strip() and not line.startswith("#"):
            header = ""
            paragraph.append(line.strip())
        else:
            header = ""
    return blocks


def test_the_record_page_stays_a_short_read() -> None:
    """docs/benchmarks.md is the claims, one row each, under 20 KB: a record that is no longer a headline goes to
    docs/results/ (its rows) and git, not onto the page."""
    size = len((REPO / "docs" / "benchmarks.md").read_bytes())
    assert size < 20 * 1024, f"docs/benchmarks.md is {size} bytes: move what it no longer shows to docs/results/"


def test_every_number_on_the_record_page_is_its_cited_rows() -> None:
    """docs/benchmarks.md: a paragraph, list item or table row that quotes a measured number names the results row
    it comes from as [id](results/FILE.jsonl) (a table's header row names it for every row), the row exists, and
    every number quoted (decimals, thousands, a time as 20:45) is one of the cited rows' figures or text."""
    results = _results()
    page = (REPO / "docs" / "benchmarks.md").read_text()
    for rid, stem in CITE.findall(_prose(page)):
        assert rid in results.get(stem, {}), f"docs/benchmarks.md cites {rid}, no row of docs/results/{stem}.jsonl"
    checked = 0
    for block, header in _blocks(page):
        numbers = NUMBER.findall(CITE.sub("", block))
        if not numbers and not MEASURED.search(block):
            continue
        cites = CITE.findall(block) + CITE.findall(header)
        assert cites, (
            f"docs/benchmarks.md quotes {numbers or MEASURED.findall(block)} and cites no results row: {block}"
        )
        held: set[str] = set()
        for rid, stem in cites:
            held |= {n for s in _strings(results[stem][rid]) for n in NUMBER.findall(s)}
        missing = [n for n in numbers if n not in held]
        assert not missing, f"docs/benchmarks.md quotes {missing}, which {cites} do not hold: {block}"
        checked += 1
    assert checked > 50, checked


def test_the_recorded_transcripts_are_what_their_commands_print() -> None:
    """Every block marked cheap (dry runs, --print-config, planning/doctor.py, planning/estimate_memory.py, a refused start), rerun by
    scripts/record_transcripts.py in one process; its output names each block that differs and shows the diff.
    `python scripts/record_transcripts.py` rewrites them."""
    proc = subprocess.run(
        [sys.executable, "scripts/record_transcripts.py", "--check", "--cheap"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}{proc.stderr[-2000:]}"


def test_the_readme_planning_commands_are_recorded_transcripts() -> None:
    """The block under "Plan a job without its GPUs or its data": each line is the command of a cheap transcript (run
    by the test above), as written but for `python` in place of `.venv/bin/python`."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Plan a job without its GPUs or its data") :]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)[1]
    commands = [line.replace(".venv/bin/python", "python") for line in block.splitlines() if line.strip()]
    assert len(commands) == 4, commands
    pages = "\n".join(page.read_text() for page in PAGES)
    recorded = re.findall(r"^<!-- transcript [a-z ]*cheap[a-z ]*: (.+?) -->$", pages, flags=re.M)
    for command in commands:
        assert any(r == command or r.startswith(f"{command} ") for r in recorded), f"{command} is no cheap transcript"


def test_the_data_pages_mixture_commands_run_as_written(tmp_path: Path) -> None:
    """docs/data.md's block under "Your corpora, prepared and mixed": two corpora prepared, a mixture of them trained
    on 2 ranks (its output folders moved to tmp_path)."""
    text = (REPO / "docs" / "data.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index("## Your corpora, prepared and mixed") :], flags=re.S)[1]
    commands = [line.replace("outputs/data", str(tmp_path / "data")) for line in block.splitlines() if line.strip()]
    assert len(commands) == 3, commands
    for command in commands:
        proc = subprocess.run(
            ["bash", "-c", f"{command} --job.dump_folder={tmp_path / 'run'}" if "train.py" in command else command],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, f"{command}\n{proc.stderr[-2000:]}"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [row for row in rows if "loss" in row][-1]
    assert last["step"] == 10 and last["tokens_stories"] > 2 * last["tokens_more"] > 0, last


def test_the_readmes_commands_run_the_venv_make_creates() -> None:
    """A fresh clone has no `python` or `torchrun` of its own: every command of README.md's ```bash blocks is `make`
    (which creates .venv) or a program of .venv/bin/, after any VAR=value settings."""
    text = (REPO / "README.md").read_text()
    programs = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            words = line.split()
            while words and re.match(r"^[A-Z_]+=", words[0]):
                words = words[1:]
            if words and not words[0].startswith("#"):
                programs.append(words[0])
    assert len(programs) > 10 and "make" in programs, programs
    bare = [p for p in programs if p != "make" and not f"/{p}".startswith(("/.venv/bin/", "/path/to/.venv/bin/"))]
    assert not bare, f"README.md runs {bare}: name .venv/bin/'s (make creates it)"


def test_the_lines_the_readme_says_make_train_ends_with_are_the_recorded_logs() -> None:
    """README.md's quick start shows how `make train` ends (its losses at step 100): each line is a line of the log
    docs/results/transcripts.md records for the command (`scripts/record_transcripts.py` reruns it), but for the
    parts the README leaves out as `...` (times, rates, memory)."""
    readme = (REPO / "README.md").read_text()
    shown = re.search(r"ends with these lines[^`]*```\n(.*?)```", readme, flags=re.S)[1].strip().splitlines()
    command = "rm -rf outputs/debug && torchrun --nproc_per_node=2 train.py --config configs/debug.toml"
    recorded = (RESULTS / "transcripts.md").read_text()
    log = re.search(rf"<!-- transcript: {re.escape(command)} -->\n```\n(.*?)```", recorded, flags=re.S)[1].splitlines()
    assert len(shown) == 4 and "loss  1.6591" in shown[0] and "loss  1.6472" in shown[1], shown
    assert "eval at step 100: stories_facts acc 0.6349" in shown[2], shown  # eval.py's 0.635 on step 100, below
    for line in shown:
        pattern = ".*".join(map(re.escape, line.split("...")))
        assert any(re.fullmatch(pattern, recorded) for recorded in log), line


def test_the_readme_stays_a_short_read_and_its_eval_scores_are_the_recorded_ones() -> None:
    """README.md is the page a newcomer reads first: under 10 KB (the rest lives in docs/). The stories_facts scores it
    states, after `make train` and untrained, are the step-100 and step-0 cells of docs/benchmarks.md's table."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) < 10 * 1024, len(readme.encode())
    trained, untrained = re.search(
        r"it scores acc ([\d.]+ \(stderr [\d.]+\)), the untrained model ([\d.]+ \(stderr [\d.]+\))",
        " ".join(readme.split()),
    ).groups()
    table = (REPO / "docs" / "benchmarks.md").read_text().split("### Evaluation: stories_facts", 1)[1]
    steps = re.search(r"^\| step [^|]*\|(.*)\|$", table, flags=re.M)[1].split("|")
    accs = re.search(r"^\| acc \(stderr\) \|(.*)\|$", table, flags=re.M)[1].split("|")
    cell = {step.strip(): acc.strip() for step, acc in zip(steps, accs, strict=True)}
    assert (cell["100"], cell["0"]) == (trained.replace("stderr ", ""), untrained.replace("stderr ", ""))
