"""The multi-node tools: the network preflight through the multi-node launcher (a real c10d
rendezvous of 4 CPU ranks read as 2 nodes x 2), and the launcher's torchrun command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.launch import REPO, free_port


def _multinode(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "run_multinode.sh"), *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_net_preflight_through_the_multinode_launcher(tmp_path: Path) -> None:
    """A real c10d rendezvous (one "node" of 4 ranks, read as 2 x 2): a row per group, exit 0."""
    out = tmp_path / "preflight.json"
    env = {"NNODES": "1", "NPROC_PER_NODE": "4", "HEAD_ADDR": "127.0.0.1", "RDZV_PORT": str(free_port())}
    # --warn-ratio 1000: no link is 1000x faster than shared memory, so the warning path runs too.
    proc = _multinode(
        "scripts/net_preflight.py",
        "--ranks-per-node",
        "2",
        "--sizes",
        "4K,64K",
        "--iters",
        "2",
        "--warn-ratio",
        "1000",
        "--out",
        str(out),
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split("  ")[0].strip(): line for line in proc.stdout.splitlines()}
    for group, ranks in [
        ("intra node 0", "0-1"),
        ("intra node 1", "2-3"),
        ("inter 1/node", "0,2"),
        ("inter lr 0", "0,2"),
        ("inter lr 1", "1,3"),
        ("world", "0-3"),
    ]:
        assert group in rows and ranks in rows[group].split(), (group, proc.stdout)
        assert len(rows[group].split()) == len(group.split()) + 1 + 2  # name, ranks, two sizes
    assert "WARNING: all-rank busbw" in proc.stdout
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 6 and all(v > 0 for row in result["rows"] for v in row["busbw"].values())


def test_multinode_launcher_command() -> None:
    env = {"DRY_RUN": "1", "NNODES": "2", "NPROC_PER_NODE": "8", "HEAD_ADDR": "node0", "RDZV_ID": "job7"}
    proc = _multinode("train.py", "--config", "configs/debug.toml", env=env)
    assert proc.returncode == 0, proc.stderr
    for flag in (
        "--nnodes=2",
        "--nproc_per_node=8",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=node0:29500",
        "--rdzv_id=job7",
        "train.py --config configs/debug.toml",
    ):
        assert flag in proc.stdout, proc.stdout
