"""Bytes per step of FULL_SHARD, HSDP and pure replication (PROBLEMS.md #3), and the network preflight.

One torchrun launch (4 CPU ranks = 2 pretend nodes x 2) measures all three layouts with
benchmarks/comm_volume.py; every expected number below is derived here from
`models.llama3.num_params`, independently of the counter, so the counter is proven right.
A second launch runs scripts/net_preflight.py through scripts/run_multinode.sh (c10d rendezvous).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models.llama3 import FLAVORS, num_params
from tests.launch import REPO, free_port, torchrun

N_LAYERS = 2  # the debug model, shortened: the byte counts scale per block, the launch stays short
ARGS = dataclasses.replace(FLAVORS["debugmodel"], n_layers=N_LAYERS)
FP32 = 4  # bytes; params and gradient reductions in float32 (the benchmark's default)
WORLD, RANKS_PER_NODE = 4, 2


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("comm") / "comm_volume.json"
    proc = torchrun(
        REPO / "benchmarks" / "comm_volume.py", "--out", str(out), "--n-layers", str(N_LAYERS),
        "--ranks-per-node", str(RANKS_PER_NODE), nproc=WORLD, timeout=120,
    )  # fmt: skip
    assert "cross-node" in proc.stdout  # the table
    return json.loads(out.read_text())["results"]


def analytic() -> dict[str, dict[str, int]]:
    """Payloads per step (bytes) from the parameter count, for reshard_after_forward="default".

    apply_fsdp makes units: embedding, each block, norm + output (the root holds no parameter).
    Forward all-gathers every unit; backward re-gathers the units resharded after forward (all
    but norm + output); each unit's gradient is reduce-scattered once. HSDP then all-reduces the
    gradient shard (1/dp_shard of the gradients) across the replicas.
    """
    total = num_params(ARGS)
    embedding = ARGS.vocab_size * ARGS.dim
    norm_output = ARGS.dim + ARGS.vocab_size * ARGS.dim
    resharded = total - norm_output
    return {
        "params": {"total": total, "embedding": embedding, "norm_output": norm_output},
        "all_gather": {"payload": (total + resharded) * FP32, "calls": 2 * (N_LAYERS + 2) - 1},
        "reduce_scatter": {"payload": total * FP32, "calls": N_LAYERS + 2},
        "grad_all_reduce": {"payload": total * FP32, "calls": N_LAYERS + 2},  # / dp_shard under HSDP
    }


def _op(result: dict, op: str) -> dict[str, int]:
    return result["rank0"]["by_op"].get(op, {"calls": 0, "payload_bytes": 0, "sent_bytes": 0})


def _groups(result: dict, op: str, dim: str) -> list[dict]:
    return [g for g in result["groups"] if g["op"] == op and g["dim"] == dim]


def _scalar_bytes(result: dict) -> int:
    """The gradient norm's all-reduce over dp_shard (DTensor): a few hundred bytes, not gradients."""
    return sum(g["cross_node_bytes"] for g in _groups(result, "all_reduce", "dp_shard"))


def test_units_match_the_parameter_formula(results: dict[str, dict]) -> None:
    expected = analytic()["params"]
    for result in results.values():
        units = result["unit_params"]
        assert sum(units.values()) == expected["total"]
        assert units["tok_embeddings"] == expected["embedding"]
        assert units["norm_output"] == expected["norm_output"]


def test_only_known_collectives_and_symmetric_ranks(results: dict[str, dict]) -> None:
    for name, result in results.items():
        assert all(not g["op"].startswith("other") and g["dim"] != "other" for g in result["groups"]), name
        assert len(set(result["sent_bytes_per_rank"])) == 1, (name, result["sent_bytes_per_rank"])


def test_full_shard_bytes_match_the_formula(results: dict[str, dict]) -> None:
    """FSDP over 4 ranks: every ring has (n-1)/n = 3/4 on each link, 2 of its 4 links cross nodes."""
    a, r = analytic(), results["full_shard"]
    for op in ("all_gather", "reduce_scatter"):
        assert _op(r, op)["payload_bytes"] == a[op]["payload"], op
        assert _op(r, op)["calls"] == a[op]["calls"], op
        assert _op(r, op)["sent_bytes"] == a[op]["payload"] * 3 // 4, op
        (group,) = _groups(r, op, "dp_shard")
        assert group["ranks"] == [0, 1, 2, 3] and group["spans_nodes"]
    assert 0 < _op(r, "all_reduce")["payload_bytes"] < 1024  # the gradient norm only
    expected_cross = 2 * (a["all_gather"]["payload"] + a["reduce_scatter"]["payload"]) * 3 // 4
    assert r["cross_node_bytes"] - _scalar_bytes(r) == expected_cross


def test_hsdp_bytes_match_the_formula(results: dict[str, dict]) -> None:
    """HSDP 2 x 2: gathers and reduce-scatters inside a node, a gradient-shard all-reduce across."""
    a, r = analytic(), results["hsdp"]
    for op in ("all_gather", "reduce_scatter"):
        assert _op(r, op)["payload_bytes"] == a[op]["payload"], op
        assert _op(r, op)["sent_bytes"] == a[op]["payload"] // 2, op
        groups = _groups(r, op, "dp_shard")
        assert sorted(g["ranks"] for g in groups) == [[0, 1], [2, 3]]
        assert not any(g["spans_nodes"] for g in groups) and not any(g["cross_node_bytes"] for g in groups)
    shard_payload = a["grad_all_reduce"]["payload"] // 2  # 1/dp_shard of the gradients
    replicas = _groups(r, "all_reduce", "dp_replicate")
    assert sorted(g["ranks"] for g in replicas) == [[0, 2], [1, 3]]
    for g in replicas:
        assert g["spans_nodes"] and g["calls"] == a["grad_all_reduce"]["calls"]
        assert g["payload_bytes"] == shard_payload
        assert g["sent_bytes_per_rank"] == shard_payload  # 2(n-1)/n = 1 for n = 2
    assert r["rank0"]["sent_bytes_by_dim"]["dp_replicate"] == shard_payload
    # Two replica groups, each a 2-rank ring whose both links cross: 2 x 2 x shard_payload.
    assert r["cross_node_bytes"] == 4 * shard_payload
    assert _scalar_bytes(r) == 0  # the norm's all-reduce runs over dp_shard, inside a node


def test_replicate_bytes_match_the_formula(results: dict[str, dict]) -> None:
    """Pure replication: no gathers, the whole gradient all-reduced over all 4 ranks."""
    a, r = analytic(), results["replicate"]
    assert _op(r, "all_gather")["payload_bytes"] == _op(r, "reduce_scatter")["payload_bytes"] == 0
    (group,) = _groups(r, "all_reduce", "dp_replicate")
    assert group["ranks"] == [0, 1, 2, 3] and group["payload_bytes"] == a["grad_all_reduce"]["payload"]
    assert group["sent_bytes_per_rank"] == a["grad_all_reduce"]["payload"] * 3 // 2  # 2(n-1)/n = 3/2
    assert r["cross_node_bytes"] == 2 * group["sent_bytes_per_rank"]


def test_cross_node_ordering_and_ratio(results: dict[str, dict]) -> None:
    """HSDP < replication < FULL_SHARD across nodes; HSDP / FULL_SHARD = 2P / (3/2 (AG + RS)), fp32."""
    a = analytic()
    full, hsdp, rep = (results[name]["cross_node_bytes"] for name in ("full_shard", "hsdp", "replicate"))
    assert hsdp < rep < full
    p_bytes = a["params"]["total"] * FP32
    expected = 2 * p_bytes / (1.5 * (a["all_gather"]["payload"] + a["reduce_scatter"]["payload"]))
    assert hsdp / full == pytest.approx(expected, rel=1e-3)
    assert rep / hsdp == pytest.approx(1.5, rel=1e-6)  # 3P vs 2P


# ---------------------------------------------------------------- preflight and launcher


def _multinode(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "run_multinode.sh"), *args],
        cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_net_preflight_through_the_multinode_launcher(tmp_path: Path) -> None:
    """A real c10d rendezvous (one "node" of 4 ranks, read as 2 x 2): a row per group, exit 0."""
    out = tmp_path / "preflight.json"
    env = {"NNODES": "1", "NPROC_PER_NODE": "4", "HEAD_ADDR": "127.0.0.1", "RDZV_PORT": str(free_port())}
    # --warn-ratio 1000: no link is 1000x faster than shared memory, so the warning path runs too.
    proc = _multinode(
        "scripts/net_preflight.py", "--ranks-per-node", "2", "--sizes", "4K,64K", "--iters", "2",
        "--warn-ratio", "1000", "--out", str(out), env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split("  ")[0].strip(): line for line in proc.stdout.splitlines()}
    for group, ranks in [("intra node 0", "0-1"), ("intra node 1", "2-3"), ("inter 1/node", "0,2"),
                         ("inter lr 0", "0,2"), ("inter lr 1", "1,3"), ("world", "0-3")]:  # fmt: skip
        assert group in rows and ranks in rows[group].split(), (group, proc.stdout)
        assert len(rows[group].split()) == len(group.split()) + 1 + 2  # name, ranks, two sizes
    assert "WARNING: all-rank busbw" in proc.stdout
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 6 and all(v > 0 for row in result["rows"] for v in row["busbw"].values())


def test_multinode_launcher_command() -> None:
    env = {"DRY_RUN": "1", "NNODES": "2", "NPROC_PER_NODE": "8", "HEAD_ADDR": "node0", "RDZV_ID": "job7"}
    proc = _multinode("train.py", "--config", "configs/debug.toml", env=env)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d", "--rdzv_endpoint=node0:29500",
                 "--rdzv_id=job7", "train.py --config configs/debug.toml"):  # fmt: skip
        assert flag in proc.stdout, proc.stdout
