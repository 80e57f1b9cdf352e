"""`make bench` (benchmarks/run.py): its table and chart, its progress lines, each part's output in a log and a failing
part's error shown, from rows and parts made up here: no benchmark runs."""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import harness, run
from benchmarks.harness import Row
from config import REPO

STAIRCASE = ["no sharding", "FSDP(2)", "+ bf16", "+ full AC"]
ROWS = [
    Row("#3 HSDP", "bytes crossing nodes", "MiB", "FULL_SHARD", 96.0, "HSDP", 44.0),
    Row("#3 HSDP", "bytes crossing nodes", "MiB", "replication", 66.0, "HSDP", 44.0),
    Row("#3 HSDP", "step time", "ms", "FULL_SHARD", 9.0, "HSDP", 5.0),  # not the headline: not charted
    Row("#4 cache", "graphs served", "graphs", "shared", 2, "keyed", 0, note="CPU: keyed.\nGPU: keyed too."),
    *(Row("#5 memory", "device memory", "MiB", before, 2.0**-i, after, 2.0 ** -(i + 1))
      for i, (before, after) in enumerate(itertools.pairwise(STAIRCASE))),
]  # fmt: skip


def test_one_panel_per_problem_with_its_headline_setups_broken_first() -> None:
    hsdp, cache, memory = run.panels(ROWS)
    assert (hsdp.problem, hsdp.metric, hsdp.unit) == ("#3 HSDP", "bytes crossing nodes", "MiB")
    assert [(b.label, b.value, b.broken) for b in hsdp.bars] == [
        ("FULL_SHARD", 96.0, True), ("replication", 66.0, True), ("HSDP", 44.0, False),
    ]  # fmt: skip
    assert [(b.value, b.broken) for b in cache.bars] == [(2, True), (0, False)]
    assert [b.label for b in memory.bars] == STAIRCASE
    assert [b.broken for b in memory.bars] == [True, False, False, False]
    # A row's note (what the bars alone would mislead about) goes under its panel and after the table.
    assert (hsdp.note, cache.note) == ("", "CPU: keyed.\nGPU: keyed too.")
    assert run.format_table(ROWS).splitlines()[-1] == "note, #4 cache: CPU: keyed. GPU: keyed too."


def test_plot_only_redraws_from_bench_json(tmp_path: Path) -> None:
    (tmp_path / "bench.json").write_text(json.dumps({"rows": [r.to_json() for r in ROWS]}))
    assert run.main(["--plot-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
    assert [Row.from_json(r) for r in json.loads((tmp_path / "bench.json").read_text())["rows"]] == ROWS
    older = {k: v for k, v in ROWS[0].to_json().items() if k != "note"}  # a bench.json from before notes
    assert Row.from_json(older) == ROWS[0]


def test_plot_only_without_a_bench_json_is_one_line(tmp_path: Path, capsys) -> None:
    assert run.main(["--plot-only", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --plot-only: {tmp_path / 'bench.json'} not found; run `make bench` first (or pass --out)\n"


# ------------------------------------------------------------------------ progress


def test_progress_says_part_i_of_n_the_time_elapsed_and_the_rest_scaled_by_the_pace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    now = [100.0]
    monkeypatch.setattr(harness.time, "monotonic", lambda: now[0])
    progress = harness.Progress({"a": 10, "b": 30, "c": 20})
    progress.start("a")
    now[0] += 20  # a takes twice its expected seconds: the rest is estimated at twice theirs
    assert progress.finish("a") == 20
    progress.start("b")
    now[0] += 16  # b takes about half of its: a and b together took 0.9 of theirs
    progress.finish("b")
    progress.start("c")
    assert capsys.readouterr().out.splitlines() == [
        "part 1/3 a: starting | elapsed 0m00s | estimated rest 1m00s",
        "part 2/3 b: starting | elapsed 0m20s | estimated rest 1m40s",
        "part 3/3 c: starting | elapsed 0m36s | estimated rest 0m18s",
    ]


def _fake_benchmarks(monkeypatch: pytest.MonkeyPatch, *, failing: str = "") -> None:
    """make bench's benchmarks replaced by "a" and "b", each one row of its `value`, started by a run_python that
    writes a page of chatter to the part's log (a failing one: a traceback, and no results)."""
    monkeypatch.setattr(run, "BENCHMARKS", {n: SimpleNamespace(rows=lambda r: [ROWS[r["value"]]]) for n in "ab"})
    monkeypatch.setattr(run, "SECONDS", {"a": 30, "b": 90})

    def run_python(*args: str, log: Path, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        name, out = args[1].removeprefix("benchmarks."), Path(args[3])
        with open(log, "a") as f:
            f.write("".join(f"{name}: chatter {i}\n" for i in range(100)))
            if name == failing:
                f.write("Traceback (most recent call last):\nValueError: boom\n")
                return subprocess.CompletedProcess(args, 3)
        out.write_text(json.dumps({"results": {"value": "ab".index(name)}}))
        return subprocess.CompletedProcess(args, 0)

    monkeypatch.setattr(harness, "run_python", run_python)


def test_make_bench_prints_a_line_per_part_and_keeps_each_parts_output_in_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_benchmarks(monkeypatch)
    assert run.main(["--out", str(tmp_path), "--no-train-rows"]) == 0
    out, err = capsys.readouterr()
    lines = out.split("\n\n")[0].splitlines()  # before the table
    assert (
        lines[0]
        == f"make bench: 2 parts, about 2m00s on 2 idle CPU cores; each part's output goes to {tmp_path}/<part>.log"
    )
    assert re.fullmatch(r"part 1/2 a: starting \| elapsed 0m00s \| estimated rest 2m00s", lines[1])
    assert re.fullmatch(r"part 1/2 a: done in \d+s, 1 rows \(estimate 30s\)", lines[2])
    assert re.fullmatch(r"part 2/2 b: starting \| elapsed \d+m\d\ds \| estimated rest \d+m\d\ds", lines[3])
    assert re.fullmatch(r"part 2/2 b: done in \d+s, 1 rows \(estimate 90s\)", lines[4])
    assert len(lines) == 5 and "chatter" not in out + err
    assert (tmp_path / "b.log").read_text().count("b: chatter") == 100
    assert [Row.from_json(r) for r in json.loads((tmp_path / "bench.json").read_text())["rows"]] == ROWS[:2]


def test_a_failing_part_shows_the_end_of_its_log_and_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_benchmarks(monkeypatch, failing="a")
    with pytest.raises(SystemExit, match=r"^benchmarks\.a exited with status 3$"):
        run.main(["--out", str(tmp_path), "--no-train-rows"])
    out, err = capsys.readouterr()
    assert re.search(rf"^part 1/2 a: FAILED after \d+s; the end of {re.escape(str(tmp_path / 'a.log'))}:$", out, re.M)
    assert err.endswith("a: chatter 99\nTraceback (most recent call last):\nValueError: boom\n")
    assert len(err.splitlines()) == 40 and "part 2/2" not in out


@pytest.mark.parametrize("launch", ["forked", "new interpreter"])
def test_run_python_appends_stdout_and_stderr_to_a_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], launch: str
) -> None:
    if launch == "new interpreter":
        monkeypatch.setattr(harness, "LAUNCH", None)  # as make bench starts them
    log = tmp_path / "part.log"
    log.write_text("earlier\n")
    proc = harness.run_python("-c", "import sys; print('out', flush=True); sys.exit('err')", log=log)
    assert proc.returncode == 1
    assert log.read_text().splitlines() == ["earlier", "out", "err"]
    assert capsys.readouterr() == ("", "")


def test_every_part_has_expected_seconds_and_together_they_fit_in_12_minutes() -> None:
    assert list(run.SECONDS) == [*run.BENCHMARKS, "train"]
    assert sum(run.SECONDS[name] for name in run.BENCHMARKS if name not in run.OPT_IN) <= 12 * 60
    assert set(run.OPT_IN) <= set(run.BENCHMARKS)


@pytest.mark.parametrize("name", sorted(run.FLAGS))
def test_make_bench_flags_are_the_benchmarks_own_and_the_docs_give_them(name: str) -> None:
    parser = argparse.ArgumentParser()
    run.BENCHMARKS[name].add_args(parser)
    given, default = vars(parser.parse_args(run.FLAGS[name])), vars(parser.parse_args([]))
    assert {key for key in given if given[key] != default[key]}, "a flag that changes nothing"
    section = (REPO / "docs/benchmarks.md").read_text().split("\n### `make bench`\n", 1)[1].split("\n### ", 1)[0]
    assert f"`{name} {' '.join(run.FLAGS[name])}`" in " ".join(section.split())
