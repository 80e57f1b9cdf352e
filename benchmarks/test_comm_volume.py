"""Bytes per step of FULL_SHARD, HSDP and pure replication (docs/failures.md #3).

One torchrun launch (4 CPU ranks = 2 pretend nodes x 2) measures all three layouts with
benchmarks/comm_volume.py; every expected number below is derived here from
`models.llama3.num_params`, independently of the counter, so the counter is proven right.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from benchmarks import comm_volume
from benchmarks.harness import MiB, read_results, run_python
from models.llama3 import FLAVORS, num_params

N_LAYERS = 2  # the debug model, shortened: the byte counts scale per block, the launch stays short
ARGS = dataclasses.replace(FLAVORS["debugmodel"], n_layers=N_LAYERS)
FP32 = 4  # bytes; params and gradient reductions in float32 (the benchmark's default)
WORLD, RANKS_PER_NODE = 4, 2


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("comm") / "comm_volume.json"
    proc = run_python(
        "-m",
        "benchmarks.comm_volume",
        "--out",
        str(out),
        "--n-layers",
        str(N_LAYERS),
        "--ranks-per-node",
        str(RANKS_PER_NODE),
        nproc=WORLD,
        capture=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "cross-node" in proc.stdout  # the table
    return read_results(out)


def analytic() -> dict[str, dict[str, int]]:
    """Payloads per step (bytes) from the parameter count, for reshard_after_forward="default".

    apply_fsdp makes units: embedding, each block, norm + output (the root holds no parameter).
    Forward all-gathers every unit; backward re-gathers the blocks (norm + output stay gathered, the
    embedding's backward does not read it); each unit's gradient is reduce-scattered once. HSDP then all-reduces the
    gradient shard (1/dp_shard of the gradients) across the replicas.
    """
    total = num_params(ARGS)
    embedding = ARGS.vocab_size * ARGS.dim
    norm_output = ARGS.dim + ARGS.vocab_size * ARGS.dim
    regathered = total - norm_output - embedding
    return {
        "params": {"total": total, "embedding": embedding, "norm_output": norm_output},
        "all_gather": {"payload": (total + regathered) * FP32, "calls": 2 * N_LAYERS + 2},
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


def test_units_match_the_parameter_formula(results: dict[str, dict[str, Any]]) -> None:
    expected = analytic()["params"]
    for result in results.values():
        units = result["unit_params"]
        assert sum(units.values()) == expected["total"]
        assert units["tok_embeddings"] == expected["embedding"]
        assert units["norm_output"] == expected["norm_output"]


def test_only_known_collectives_and_symmetric_ranks(results: dict[str, dict[str, Any]]) -> None:
    for name, result in results.items():
        assert all(not g["op"].startswith("other") and g["dim"] != "other" for g in result["groups"]), name
        assert len(set(result["sent_bytes_per_rank"])) == 1, (name, result["sent_bytes_per_rank"])


def test_full_shard_bytes_match_the_formula(results: dict[str, dict[str, Any]]) -> None:
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


def test_hsdp_bytes_match_the_formula(results: dict[str, dict[str, Any]]) -> None:
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


def test_replicate_bytes_match_the_formula(results: dict[str, dict[str, Any]]) -> None:
    """Pure replication: no gathers, the whole gradient all-reduced over all 4 ranks."""
    a, r = analytic(), results["replicate"]
    assert _op(r, "all_gather")["payload_bytes"] == _op(r, "reduce_scatter")["payload_bytes"] == 0
    (group,) = _groups(r, "all_reduce", "dp_replicate")
    assert group["ranks"] == [0, 1, 2, 3] and group["payload_bytes"] == a["grad_all_reduce"]["payload"]
    assert group["sent_bytes_per_rank"] == a["grad_all_reduce"]["payload"] * 3 // 2  # 2(n-1)/n = 3/2
    assert r["cross_node_bytes"] == 2 * group["sent_bytes_per_rank"]


def test_cross_node_ordering_and_ratio(results: dict[str, dict[str, Any]]) -> None:
    """HSDP < replication < FULL_SHARD across nodes; HSDP / FULL_SHARD = 2P / (3/2 (AG + RS)), fp32."""
    a = analytic()
    full, hsdp, rep = (results[name]["cross_node_bytes"] for name in ("full_shard", "hsdp", "replicate"))
    assert hsdp < rep < full
    p_bytes = a["params"]["total"] * FP32
    expected = 2 * p_bytes / (1.5 * (a["all_gather"]["payload"] + a["reduce_scatter"]["payload"]))
    assert hsdp / full == pytest.approx(expected, rel=1e-3)
    assert rep / hsdp == pytest.approx(1.5, rel=1e-6)  # 3P vs 2P
    vs_full_shard, vs_replication, _, _ = comm_volume.rows(results)
    assert vs_full_shard.broken_value == full / MiB and vs_replication.broken_value == rep / MiB
    assert vs_full_shard.fixed_value == vs_replication.fixed_value == hsdp / MiB


def test_hsdp_gradients_cross_nodes_once_per_step_whatever_the_micro_batches(
    results: dict[str, dict[str, Any]],
) -> None:
    """4 micro-batches a step: the gathers and reduce-scatters inside a node run per micro-batch, the all-reduce
    across nodes once per step (train.py, parallelisms/fsdp.py sync_gradients_on): the bytes of one micro-batch.
    FSDP2's default, measured with that call taken out, sends them 4 times."""
    one, four, every = (results[k] for k in ("hsdp", "hsdp_accum4", "hsdp_accum4_every"))
    assert (one["grad_accum"], four["grad_accum"], every["grad_accum"]) == (1, comm_volume.ACCUM, comm_volume.ACCUM)
    for op in ("all_gather", "reduce_scatter"):
        assert _op(four, op)["calls"] == _op(every, op)["calls"] == comm_volume.ACCUM * _op(one, op)["calls"], op
    assert four["cross_node_bytes"] == one["cross_node_bytes"] > 0
    assert every["cross_node_bytes"] == comm_volume.ACCUM * one["cross_node_bytes"]
    row = comm_volume.rows(results)[-2]
    assert (row.broken_value, row.fixed_value) == (every["cross_node_bytes"] / MiB, four["cross_node_bytes"] / MiB)


def test_deferred_reduce_scatters_send_one_micro_batchs_bytes(results: dict[str, dict[str, Any]]) -> None:
    """parallelism.fsdp_defer_reduce_scatter at 4 micro-batches: the reduce-scatters and the all-reduce of one
    micro-batch's step, the all-gathers of four."""
    one, four, deferred = (results[k] for k in ("hsdp", "hsdp_accum4", "hsdp_accum4_defer"))
    for op in ("reduce_scatter", "all_reduce"):
        assert _op(deferred, op) == _op(one, op), op
    assert _op(deferred, "all_gather") == _op(four, "all_gather")
    assert deferred["cross_node_bytes"] == one["cross_node_bytes"] > 0
    row = comm_volume.rows(results)[-1]
    assert row.broken_value == _op(four, "reduce_scatter")["sent_bytes"] / MiB == 4 * row.fixed_value
