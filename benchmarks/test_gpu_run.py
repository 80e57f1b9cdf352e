"""`make bench-gpu` (benchmarks/gpu_run.py): its rehearsal on CPU, the files it rewrites after every part, its
progress lines, --minutes, a failing part, its refusal without CUDA, and the commands the docs show.

The rehearsal here runs the parts this file's runner owns the flags of and that are cheapest (train_rows, float8;
~1 minute on 2 idle cores): vs_torchtitan's and cuda_paths' --rehearse are their own tests', decode's shape is
test_generation.py's."""

from __future__ import annotations

import importlib
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import gpu_run, harness
from benchmarks.harness import Row, read_results
from config import REPO

# float8 is a part a fork may remove (docs/development.md's table): then the rehearsal runs train_rows alone.
FLOAT8 = (REPO / "benchmarks" / "float8.py").is_file()

PROGRESS = re.compile(r"^part (\d)/(\d) (\w+): starting \| elapsed \d+m\d\ds \| estimated rest \d+m\d\ds$", re.M)


def test_a_rehearsal_writes_each_parts_rows_as_soon_as_it_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[list[str]] = []  # the parts gpu_run.json held when each part started
    launch = harness.run_python

    def snapshot(*args: str, **kwargs: Any) -> Any:
        seen.append(list(json.loads((tmp_path / "gpu_run.json").read_text())["parts"]))
        return launch(*args, **kwargs)

    monkeypatch.setattr(harness, "run_python", snapshot)
    names = ["train_rows", *(["float8"] if FLOAT8 else [])]
    code = gpu_run.main(["--rehearse", "--only", *names, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out[-4000:]
    # Kill-safety: when float8 started, train_rows' rows were on disk already.
    assert seen == [[], ["train_rows"]][: len(names)]
    n = str(len(names))
    assert [m.groups() for m in PROGRESS.finditer(out)] == [(str(i), n, name) for i, name in enumerate(names, 1)]
    assert re.search(rf"^part 1/{n} train_rows: done in \d+s, \d+ rows \(estimate \d+s\)$", out, re.M)
    assert "rehearsal: train rows run without --compile.enable" in out
    # First the machine and the versions; last one table of every row.
    assert (
        out.startswith("make bench-gpu --rehearse: cpu (")
        and f"torch {torch.__version__}, CUDA {torch.version.cuda}" in out.splitlines()[0]
    )
    assert re.search(r"^problem +metric +unit +broken +value +fixed +value +ratio$", out, re.M)

    record = json.loads((tmp_path / "gpu_run.json").read_text())
    env = record["environment"]
    assert env["rehearse"] and env["torch"] == torch.__version__ and env["cuda"] == torch.version.cuda
    parts = record["parts"]
    for name in names:
        assert parts[name]["status"] == "ok" and parts[name]["seconds"] > 0
        rows = [Row.from_json(r) for r in parts[name]["rows"]]
        assert rows and rows == importlib.import_module(f"benchmarks.{name}").rows(
            read_results(tmp_path / f"{name}.json")
        )
    train = read_results(tmp_path / "train_rows.json")
    assert train["device"] == "cpu" and set(train["train"]["variants"]) == {"fsdp", "fsdp_compile", "fsdp_compile_sac"}
    estimates = [Row.from_json(r) for r in parts["train_rows"]["rows"] if r["problem"] == "memory estimate"]
    assert len(estimates) == 3 and all(r.broken_value > 0 and r.fixed_value > 0 for r in estimates)
    assert {r.fixed for r in estimates} == {"peak RSS"}  # on CPU the measured peak is the process's RSS
    md = (tmp_path / "gpu_run.md").read_text()
    assert f"torch {torch.__version__}" in md and md.count("\n| train_rows | throughput |") == 3
    if FLOAT8:
        f8 = read_results(tmp_path / "float8.json")["setups"]
        assert f8["float8_rowwise"]["emulate"] and f8["float8_rowwise"]["tokens_per_s"] > 0  # rowwise runs, emulated
        assert [r["unit"] for r in parts["float8"]["rows"]] == ["MiB"]  # emulated: no speed rows
        assert "\n| float8 | float8 |" in md


def _fake_parts(monkeypatch: pytest.MonkeyPatch, results: dict[str, tuple[int, list[Row], str]]) -> list[str]:
    """PARTS replaced by three of 5 s, 5 s and 40 s (rehearsal estimates) whose run_part returns `results`, and a
    fourth whose module a fork removed; the parts each call found already in gpu_run.json."""
    parts = [gpu_run.Part(n, "harness", 1, s, lambda r: [], "") for n, s in (("a", 5), ("b", 5), ("c", 40))]
    parts.append(gpu_run.Part("d", "removed_by_a_fork", 1, 1, lambda r: [], ""))
    monkeypatch.setattr(gpu_run, "PARTS", tuple(parts))
    monkeypatch.setattr(gpu_run, "BY_NAME", {p.name: p for p in parts})
    calls: list[str] = []

    def run_part(part: gpu_run.Part, out: Path, *, rehearse: bool) -> tuple[int, list[Row], str]:
        calls.append(",".join(json.loads((out / "gpu_run.json").read_text())["parts"]))
        return results[part.name]

    monkeypatch.setattr(gpu_run, "run_part", run_part)
    return calls


def test_a_failing_part_is_reported_and_the_run_goes_on_and_minutes_skip_what_will_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    row = Row("p", "m", "u", "x", 1.0, "y", 2.0)
    calls = _fake_parts(monkeypatch, {"a": (3, [], "exited with status 3"), "b": (0, [row], ""), "c": (0, [], "")})
    assert gpu_run.main(["--rehearse", "--minutes", "0.5", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert calls == ["", "a"]  # c and d never ran
    assert "part 1/4 a: FAILED after 0s: exited with status 3 (estimate 5s)" in out
    assert "part 3/4 c: skipped: its estimate 0m40s does not fit in the 0m30s left of --minutes 0.5" in out
    assert "part 4/4 d: skipped: benchmarks/removed_by_a_fork.py is not here (removed)" in out
    parts = json.loads((tmp_path / "gpu_run.json").read_text())["parts"]
    assert {n: (p["status"], p.get("returncode")) for n, p in parts.items()} == {
        "a": ("failed", 3), "b": ("ok", 0), "c": ("skipped", None), "d": ("skipped", None),
    }  # fmt: skip
    assert [Row.from_json(r) for r in parts["b"]["rows"]] == [row]
    assert "| b | p | m | u | x | 1 | y | 2 | 2.000x |" in (tmp_path / "gpu_run.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal is for machines without")
def test_without_cuda_and_without_rehearse_it_refuses_in_one_line_naming_rehearse(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        gpu_run.main(["--out", str(tmp_path)])
    assert "--rehearse" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "gpu_run.json").exists()


def test_a_bad_minutes_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gpu_run.main(["--rehearse", "--minutes", "0"])
    assert "--minutes: expected a positive number of minutes, got '0'" in capsys.readouterr().err


def test_the_commands_the_docs_show_are_ones_the_runner_accepts() -> None:
    assert re.search(r"^bench-gpu: setup\n\t\$\(PY\) -m benchmarks\.gpu_run \$\(ARGS\)$",
                     (REPO / "Makefile").read_text(), re.M)  # fmt: skip
    commands = []  # the runner's argv of every command line the docs show (code lines, comments cut)
    for doc in ("README.md", "docs/benchmarks.md", "docs/development.md"):
        text = (REPO / doc).read_text()
        assert "make bench-gpu" in text, doc
        for line in re.findall(r"^(?:make bench-gpu|python -m benchmarks\.gpu_run)\b.*$", text, re.M):
            words = shlex.split(line.split("#", 1)[0])
            if words[0] == "make":
                args = [w.removeprefix("ARGS=") for w in words[2:]]
                words = shlex.split(args[0]) if args else []
            else:
                words = words[3:]
            commands.append(words)
    assert [] in commands and ["--rehearse"] in commands and ["--minutes", "8"] in commands
    for argv in commands:
        gpu_run.parser().parse_args(argv)  # SystemExit on a flag the runner does not take


def test_the_docs_list_the_parts_in_priority_order_and_help_gives_their_estimates() -> None:
    table = (REPO / "docs/benchmarks.md").read_text().split("### How to run it", 1)[1].split("\n\n###", 1)[0]
    assert re.findall(r"^\| `(\w+)` \|", table, re.M) == [p.name for p in gpu_run.PARTS]
    help_text = gpu_run.parser().format_help()
    for part in gpu_run.PARTS:
        assert re.search(rf"^  {part.name} +~ *{part.gpu_s}s on a GPU", help_text, re.M), part.name
    # The progress line docs/benchmarks.md shows is the runner's.
    readme = " ".join((REPO / "docs/benchmarks.md").read_text().split())
    (shown,) = re.findall(r"`(part \d/\d \w+: starting \| elapsed \S+ \| estimated rest \S+)`", readme)
    assert PROGRESS.fullmatch(shown)
