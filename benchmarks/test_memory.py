"""Memory (docs/failures.md #5): what FSDP, bf16 params, AC and CPU offload save, measured per rank,
and the estimator's activation formulas (planning/estimate_memory.py) checked against those measurements.

One torchrun launch (2 gloo ranks) runs every setup of benchmarks/memory.py; the tests read its JSON.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import memory
from benchmarks.harness import MiB, read_results, run_python
from benchmarks.memory import SETUPS
from models import with_seq_len
from models.llama3 import FLAVORS, Transformer
from planning.flags import job
from planning.job import Machine
from planning.memory import activation_bytes

# A quarter of make bench's sequence: the bf16 setups run emulated bf16 matmuls on CPUs without bf16 instructions (128
# tokens took 20 s more, the same checks passing). The loss phase at a quarter of its hidden size: its matmuls are most
# of the launch's time; what it holds is logit-sized.
BATCH, SEQ, LOSS_DIM = 4, 64, 64
ARGS = with_seq_len(FLAVORS["debugmodel"], SEQ)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("memory") / "memory.json"
    proc = run_python(
        "-m",
        "benchmarks.memory",
        f"--out={out}",
        f"--seq-len={SEQ}",
        f"--batch-size={BATCH}",
        f"--loss-dim={LOSS_DIM}",
        nproc=2,
        capture=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_results(out)


@pytest.fixture(scope="module")
def rows(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per setup, in SETUPS order: its measured bytes per rank."""
    assert list(results["setups"]) == list(SETUPS)
    return results["setups"]


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


# ------------------------------------------------------------------ sharded state


def test_fsdp2_halves_params_grads_and_optimizer_per_rank(rows: dict[str, dict]) -> None:
    full, fsdp = rows["no_shard_fp32"], rows["fsdp2_fp32"]
    n = sum(p.numel() for p in Transformer(ARGS).parameters())
    assert full["params_bytes"] == 4 * n
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert _close(fsdp[key], full[key] / 2, 0.02), (key, fsdp[key], full[key])


def test_adamw_state_is_two_fp32_copies(rows: dict[str, dict]) -> None:
    for name, r in rows.items():
        assert r["grads_bytes"] == r["params_bytes"], name
        assert _close(r["optimizer_bytes"], 2 * r["params_bytes"], 0.001), name  # + one 4-byte step per tensor


def test_bf16_changes_gathered_params_and_activations_not_the_sharded_state(rows: dict[str, dict]) -> None:
    fp32, bf16 = rows["fsdp2_fp32"], rows["fsdp2_bf16"]
    # The sharded master copy, its gradient and AdamW's state stay fp32.
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert bf16[key] == fp32[key], key
    assert bf16["param_dtype_of_shards"] == ["torch.float32"]
    # What is gathered at once (one block + the root unit, norm + output, gathered for the whole step) halves.
    model = Transformer(ARGS)
    gathered = sum(
        p.numel() for p in [*model.layers["0"].parameters(), *model.norm.parameters(), *model.output.parameters()]
    )
    assert fp32["gathered_unit_peak_bytes"] == 4 * gathered
    assert bf16["gathered_unit_peak_bytes"] == 2 * gathered
    assert rows["no_shard_fp32"]["gathered_unit_peak_bytes"] == 0


def test_bf16_halves_every_activation_in_the_compute_dtype(rows: dict[str, dict]) -> None:
    fp32, bf16 = rows["fsdp2_fp32"], rows["fsdp2_bf16"]
    ratio = bf16["activation_bytes"] / fp32["activation_bytes"]
    # Not exactly 0.5: eager RMSNorm upcasts to fp32 and saves fp32 tensors, and the loss's
    # log-softmax is fp32, whatever param_dtype is.
    assert 0.5 < ratio < 0.7, ratio
    by = bf16["activation_bytes_by_dtype"]
    # Everything saved in bf16 would be twice as large in the fp32 run; the fp32 and int64 rest is the same.
    assert _close(fp32["activation_bytes"], 2 * by["bfloat16"] + by["float32"] + by["int64"], 0.01), by
    assert fp32["logits_bytes"] == 2 * bf16["logits_bytes"]


# ---------------------------------------------------------------- checkpointing


def test_activation_checkpointing_order_and_what_is_kept(rows: dict[str, dict]) -> None:
    acts = {name: rows[name]["activation_bytes"] for name in rows}
    none, sel2, op, full = (acts[f"fsdp2_bf16{s}"] for s in ("", "_ac_sel2", "_ac_op", "_ac_full"))
    assert full < op < sel2 < none, acts
    assert sel2 < 0.65 * none and op < 0.45 * none and full < 0.2 * none, acts

    sources = {name: rows[name]["activation_bytes_by_source"] for name in rows}
    # Inside a checkpointed block autograd's saved tensors are dropped: the checkpoint keeps the
    # block inputs, selective op AC keeps its chosen op outputs; nothing else survives forward.
    assert sources["fsdp2_bf16"]["checkpoint_input"] == 0
    block_input = 2 * BATCH * SEQ * ARGS.dim
    rope_copy = 2 * 2 * SEQ * ARGS.head_dim  # FSDP casts the fp32 RoPE table input to bf16 per block
    assert sources["fsdp2_bf16_ac_full"]["checkpoint_input"] == ARGS.n_layers * (block_input + rope_copy)
    assert sources["fsdp2_bf16_ac_sel2"]["checkpoint_input"] == ARGS.n_layers // 2 * (block_input + rope_copy)
    assert sources["fsdp2_bf16_ac_full"]["sac_cache"] == 0
    assert sources["fsdp2_bf16_ac_op"]["sac_cache"] > 0
    # Outside the blocks (tokens, final norm, log-softmax) nothing changes with AC.
    assert sources["fsdp2_bf16_ac_full"]["autograd"] == sources["fsdp2_bf16_ac_op"]["autograd"]


def test_cpu_offload_puts_state_on_host(rows: dict[str, dict]) -> None:
    off, on = rows["fsdp2_bf16_ac_full_offload"], rows["fsdp2_bf16_ac_full"]
    # On a CPU-only machine both live on "cpu": the device of the shards cannot tell them apart,
    # so the offloaded state is accounted as host memory and left out of the device total.
    assert off["param_shard_devices"] == ["cpu"] and off["grad_and_optimizer_devices"] == ["cpu"]
    assert off["host_state_bytes"] == off["params_bytes"] + off["grads_bytes"] + off["optimizer_bytes"]
    assert off["device_total_bytes"] == off["activation_bytes"] + off["gathered_unit_peak_bytes"]
    assert on["host_state_bytes"] == 0
    assert off["activation_bytes"] == on["activation_bytes"]


def test_each_technique_lowers_device_memory(rows: dict[str, dict]) -> None:
    # SETUPS adds one technique (or a stronger AC) per row.
    totals = [r["device_total_bytes"] for r in rows.values()]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == len(totals), totals
    assert rows["fsdp2_bf16_ac_full_offload"]["device_total_bytes"] < 0.1 * rows["no_shard_fp32"]["device_total_bytes"]


def test_bench_rows_are_the_staircase(results: dict[str, Any], rows: dict[str, dict]) -> None:
    """`make bench` charts no sharding -> FSDP(2) -> + bf16 -> + op SAC -> + full AC -> + offload."""
    *steps, loss = memory.rows(results)
    assert (loss.broken, loss.fixed) == ("whole logits", "chunks of 512") and loss.ratio < 0.35
    staircase = ["no sharding", "FSDP(2)", "+ bf16 params", "+ op SAC", "+ full AC", "+ CPU offload"]
    assert [r.broken for r in steps] == staircase[:-1] and [r.fixed for r in steps] == staircase[1:]
    assert steps[0].broken_value == rows["no_shard_fp32"]["device_total_bytes"] / MiB
    assert steps[-1].fixed_value == rows["fsdp2_bf16_ac_full_offload"]["device_total_bytes"] / MiB


# ------------------------------------------------------------------ the estimator


@pytest.mark.parametrize("name", list(SETUPS))
def test_activation_formula_matches_measurement(rows: dict[str, dict], name: str) -> None:
    measured_setup = SETUPS[name]
    # The estimator traces one block of the model on fake tensors (planning.trace.block_costs); CPU eager:
    # nn.RMSNorm is not the fused CUDA kernel.
    predicted = activation_bytes(
        job(
            flavor="debugmodel", args=ARGS, ngpu=2, local_batch_size=BATCH, seq_len=SEQ,
            param_dtype=measured_setup.param_dtype, ac=measured_setup.ac, machine=Machine(cuda=True, rmsnorm="composite"),
        )
    )["total"]  # fmt: skip
    measured = rows[name]["activation_bytes"]
    # Measured adds only FSDP's bf16 copies of the RoPE table (16 KiB per block) and scalars.
    assert _close(measured, predicted, 0.02), (measured, predicted)


# ------------------------------------------------------------------ the loss phase


def test_chunked_loss_holds_a_fraction_of_the_whole_logits(results: dict[str, Any]) -> None:
    """loss.py at Llama 3's vocabulary: the whole loss holds ~3 fp32 logits' worth (logits, log-softmax,
    their gradients in turn), chunks of 1/4 of the tokens about 1/4 of that plus weight- and h-sized gradients."""
    loss = results["loss_phase"]
    whole, chunked, logits = loss["peak_bytes"]["whole"], loss["peak_bytes"]["chunked"], loss["logits_bytes"]
    assert 2.9 * logits <= whole <= 3.2 * logits
    share = loss["chunk_tokens"] / loss["tokens"]
    # + the projection's weight gradient, accumulated over chunks (2 alive: the sum and one chunk's).
    assert chunked <= 3.2 * logits * share + 2 * 4 * loss["vocab"] * loss["dim"] + 4 * 4 * loss["tokens"] * loss["dim"]
    assert whole / chunked > 3
