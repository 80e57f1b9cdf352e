"""tests/launch.py forks most launches from a warm interpreter (tests/forkserver.py). What a script sees and how it
exits there must be what a new `python` process gives it, or every test that launches would test something else.
And `make train`'s launcher (fleet/launch.py): a refused config is its one line, a crash torchrun's report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tests.launch
from tests.launch import REPO, free_port, python, torchrun, two_at_a_time

PROBE = """
import atexit, json, os, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined", flush=True))).start()
print(json.dumps({
    "argv": sys.argv, "path": sys.path, "file": __file__, "main": sys.modules["__main__"].__file__,
    "spec": __spec__ and __spec__.name, "name": __name__, "cwd": os.getcwd(), "env": os.environ.get("PROBE"),
    "parent": os.getppid(), "hash": hash("a string"),
}))
what = sys.argv[1]
if what == "exit":
    sys.exit(3)
if what == "message":
    sys.exit("a message")
if what == "raise":
    raise ValueError("boom")
if what == "interrupt":
    raise KeyboardInterrupt
"""


def test_a_forked_launch_is_what_a_new_interpreter_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A script and a module (-m), each ending five ways: the same output, errors and exit status, forked or new.
    Only the parent differs (the server, not pytest), and the hash seed (each process its own)."""
    (tmp_path / "probe.py").write_text(PROBE)
    for command in ([str(tmp_path / "probe.py")], ["-m", "probe"]):
        for what in ("ok", "exit", "message", "raise", "interrupt"):
            # Another PYTHONPATH (a copy of the repository, tests/test_removal.py) on the last two.
            env = {"PROBE": "1"} | ({"PYTHONPATH": f"{tmp_path}:{REPO}"} if what in ("raise", "interrupt") else {})
            forked = python(*command, what, env=env, cwd=tmp_path)
            monkeypatch.setattr(tests.launch, "FRESH", True)
            fresh = python(*command, what, env=env, cwd=tmp_path)
            monkeypatch.setattr(tests.launch, "FRESH", False)
            seen = [json.loads(proc.stdout.splitlines()[0]) for proc in (forked, fresh)]
            assert seen[1].pop("parent") == os.getpid() != seen[0].pop("parent"), "not forked, or not new"
            assert seen[0].pop("hash") != seen[1].pop("hash")
            assert seen[0] == seen[1], (command, what)
            expected = {"ok": 0, "exit": 3, "message": 1, "raise": 1, "interrupt": -2}[what]
            assert forked.returncode == fresh.returncode == expected, (command, what, forked, fresh)
            after = [proc.stdout.splitlines()[1:] for proc in (forked, fresh)]
            assert after[0] == after[1] == ["thread joined", "atexit ran"], (command, what, after)
            assert forked.stderr == fresh.stderr, (command, what)


def test_the_ranks_of_a_launch_hash_strings_differently(tmp_path: Path) -> None:
    """Each rank is forked from a server of its own, so that an iteration over a set of names may differ between the
    ranks, as it may between separately started processes (a test would otherwise hide such a disagreement)."""
    (tmp_path / "probe.py").write_text(PROBE)
    proc = torchrun(tmp_path / "probe.py", "ok", nproc=2)
    hashes = [json.loads(line)["hash"] for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(hashes) == 2 and hashes[0] != hashes[1], proc.stdout


def test_an_environment_the_servers_imports_read_otherwise_runs_in_a_new_interpreter(tmp_path: Path) -> None:
    """A variable the server's imports looked up (one dynamo reads, outside launch.AT_IMPORT's prefixes) set otherwise
    than in the server: it does not fork, and the launch runs in a new interpreter, which reads the new value."""
    (tmp_path / "probe.py").write_text(PROBE)
    assert "UNSAFE_SKIP_FSDP_MODULE_GUARDS" not in os.environ
    proc = python(str(tmp_path / "probe.py"), "ok", env={"UNSAFE_SKIP_FSDP_MODULE_GUARDS": "1"}, cwd=tmp_path)
    assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[0])["parent"] == os.getpid(), proc


def test_make_trains_launcher_says_a_refusal_in_its_one_line_and_a_crash_in_torchruns_report(tmp_path: Path) -> None:
    """`python -m fleet.launch` (make train): a config the recipe refuses ends with its one line and exit status 2,
    no torchrun report, no traceback; a rank that fails otherwise (here an exception: exit 1) still gets the report."""
    (tmp_path / "crash.py").write_text("raise RuntimeError('a crash')\n")

    def launch(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "fleet.launch", "--nproc_per_node=2", f"--master_port={free_port()}", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    refused, crashed = two_at_a_time(
        lambda: launch("train.py", "--config", "configs/debug.toml", "--training.steps=abc"),
        lambda: launch(str(tmp_path / "crash.py")),
    )
    assert refused.returncode == 2, refused
    assert refused.stderr == "error: training.steps: expected int, got 'abc' in the command line\n", refused.stderr
    assert refused.stdout == ""
    assert crashed.returncode == 1, crashed
    assert "RuntimeError: a crash" in crashed.stderr and "ChildFailedError" in crashed.stderr, crashed.stderr
    assert "crash.py FAILED" in crashed.stderr and "Root Cause (first observed failure)" in crashed.stderr
