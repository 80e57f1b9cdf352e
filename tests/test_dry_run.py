"""The dry run (planning/dry_run.py, `[comm] mode = "fake_backend"`): rank 0's plan of a big job on this machine, on a fake
process group and the meta device, without its GPUs or its input files. (A fork that removes planning/dry_run.py removes
this file.)"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import pytest

from config import REPO, JobConfig, Parallelism
from models.llama3 import FLAVORS
from parallelisms.parallel_dims import ParallelDims
from planning.dry_run import EXCESSES, comm_by_kind, comm_floor
from planning.job import CPU, Job
from tests.launch import python, two_at_a_time
from tests.parity_worker import GLOBAL_BATCH, LAYOUTS, TINY_SHAPES, TRAINING, Z_LOSS_WEIGHT, Layout


def dry_run(config: str, world_size: int | None, *args: str, **env: str) -> tuple[int, str, str]:
    assert "WORLD_SIZE" not in os.environ
    env = env | ({"WORLD_SIZE": str(world_size)} if world_size is not None else {})
    proc = python("train.py", "--config", config, "--comm.mode=fake_backend", *args, env=env, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def test_dry_run_of_405b_on_512_ranks() -> None:
    code, out, err = dry_run("configs/llama3_405b.toml", 512)
    assert code == 0, out + err
    args = FLAVORS["llama3_405b"]
    # Rank 0: stages 0 and 8 (embedding + blocks 0-6 and 63-70), sharded over FSDP 8 x TP 8; the norm
    # weights are not split by TP. Counted on the parallelized meta model, derived here by hand.
    matmuls = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads) + 3 * args.dim * args.hidden_dim
    expected = args.vocab_size * args.dim // 64 + 15 * (matmuls // 64 + 2 * args.dim // 8)
    assert f"parameters on rank 0: {expected:,} " in out, out
    assert "pipeline: Interleaved1F1B, 16 stages (2 per rank), 32 micro-batches" in out
    assert "pp               8 ranks [0, 64, 128, 192, 256, 320, 384, 448]; 64 groups" in out
    assert "tp               8 ranks [0, 1, 2, 3, 4, 5, 6, 7]; 64 groups" in out
    assert "GiB allocated" in out and "dp_shard" in out and "nothing was allocated" in out


def test_dry_run_of_8b_on_64_ranks_and_without_world_size() -> None:
    runs = two_at_a_time(
        lambda: dry_run("configs/llama3_8b.toml", 64),
        lambda: dry_run("configs/llama3_8b.toml", None),
        *(lambda bad=bad: dry_run("configs/llama3_8b.toml", 64, LOCAL_WORLD_SIZE=bad) for bad in ("abc", "0")),
    )
    code, out, err = runs[0]
    assert code == 0, out + err
    assert "parameters on rank 0: 125,472,832 " in out  # 8,030,261,248 / 64
    code, out, err = runs[1]
    assert code == 2 and err.count("error: ") == 1 and "WORLD_SIZE is 'unset'" in err, err
    for bad, (code, _, err) in zip(("abc", "0"), runs[2:], strict=True):
        assert code == 2 and err.strip() == (
            f"error: comm.mode: fake_backend plans nodes of LOCAL_WORLD_SIZE GPUs, but LOCAL_WORLD_SIZE is {bad!r}; "
            "set it to the GPUs per node (e.g. 8) or leave it unset"
        ), err


def test_dry_run_of_the_long_context_recipe_fits_80_gib() -> None:
    """configs/llama3_8b_128k.toml on 64 ranks: CP 8 inside each node, HSDP replicas across nodes; the memory the
    estimator predicts per GPU fits an 80 GiB H100, the K/V all-gathers are in the cp line, the doctor is quiet."""
    code, out, err = dry_run("configs/llama3_8b_128k.toml", 64)
    assert code == 0, out + err
    assert "on 64 ranks = pp 1 x replicate 8 x shard 1 x cp 8 x tp 1 | global batch 16 x 131072 tokens" in out
    assert "cp               8 ranks [0, 1, 2, 3, 4, 5, 6, 7]; 8 groups" in out
    assert "parameters on rank 0: 1,003,782,656 " in out  # 8,030,261,248 / 8: FSDP shards over the CP ranks
    total = float(out.split("reserved by the caching allocator, ")[1].split(" GiB")[0])
    assert total < 80, out
    (line,) = [line for line in out.splitlines() if line.startswith("  cp ") and " GiB " in line]
    assert "keys and values all-gathered per block" in line and "FSDP" in line, line
    assert "no known pitfalls found" in out, out


def test_dry_run_of_the_second_family_with_its_inputs_elsewhere() -> None:
    """Qwen3 8B on 8 ranks: planned like Llama (the family's own shapes, TP plan and traced costs); the Base
    weights and the corpus this machine lacks are notes, not errors."""
    plain, tp = two_at_a_time(
        lambda: dry_run("configs/qwen3_8b.toml", 8),
        lambda: dry_run("configs/qwen3_8b.toml", 16, "--parallelism.tensor_parallel_degree=2"),
    )
    code, out, err = plain
    assert code == 0, out + err
    assert out.startswith("qwen3 qwen3_8b: 8.19B parameters on 8 ranks")
    assert "parameters on rank 0: 1,023,841,920 " in out  # 8,190,735,360 / 8
    notes = out[out.index("inputs the job reads that this machine lacks") :]
    assert "model.hf_assets_path: assets/hf/Qwen3-8B-Base not found" in notes and "data.path: data/" in notes
    # Under TP the communication line comes from the traced block: QK-norm and all.
    code, out, err = tp
    assert code == 0, out + err
    assert "tp  " in out and "traced on one block" in out


# ------------------------------------------------- communication, predicted and measured


def layout_plan(layout: Layout) -> tuple[JobConfig, ParallelDims, Job]:
    """A parity layout (tests/parity_worker.py) as the dry run sees a job: the tiny model, its batch, one step."""
    cfg = JobConfig()
    cfg.parallelism = Parallelism(
        data_parallel_replicate_degree=layout.dp_replicate,
        data_parallel_shard_degree=layout.dp_shard,
        tensor_parallel_degree=layout.tp,
        disable_loss_parallel=not layout.loss_parallel,
        fsdp_reshard_after_forward=layout.reshard_after_forward,  # type: ignore[arg-type]
        fsdp_defer_reduce_scatter=layout.defer_reduce_scatter,
        pipeline_parallel_degree=layout.pp,
        pipeline_parallel_schedule=layout.schedule,
        context_parallel_degree=layout.cp,
        expert_parallel_degree=layout.ep,
    )
    dims = ParallelDims.from_config(cfg.parallelism, world_size=layout.world_size)
    cfg.training = dataclasses.replace(
        TRAINING,
        local_batch_size=GLOBAL_BATCH // dims.dp // layout.grad_accum,
        global_batch_size=GLOBAL_BATCH,
        loss_chunk_tokens=layout.loss_chunk_tokens,
        z_loss_weight=Z_LOSS_WEIGHT if layout.z_loss else 0.0,
    )
    cfg.activation_checkpoint = layout.ac
    cfg.model.name = layout.family
    if layout.muon:
        cfg.optimizer = dataclasses.replace(cfg.optimizer, name="Muon", muon_orthogonalize=layout.muon)
    if layout.float8_linear is not None:
        cfg.model.converters, cfg.quantize.linear.float8 = ["quantize.linear.float8"], layout.float8_linear
    return cfg, dims, Job.of(cfg, CPU, world_size=dims.world_size, args=TINY_SHAPES[layout.family])


EAGER = [name for name, layout in LAYOUTS.items() if not layout.compile]
# (DPO's layouts are left out: the dry run plans the next-token loss, whose loss-parallel all-reduces are a scalar's
# per chunk where DPO's are a log-probability per token; their weights' traffic is the other layouts'. Nor are
# distillation's: the dry run plans the student's step, not its teacher's forward. Nor LoRA's: the dry run plans every
# weight's gradient reduce-scatter, where LoRA's base has none.)
EAGER = [name for name in EAGER if not LAYOUTS[name].dpo]
EAGER = [name for name in EAGER if not LAYOUTS[name].distill]
EAGER = [name for name in EAGER if not LAYOUTS[name].lora]


@pytest.mark.parametrize("name", EAGER)
def test_the_dry_runs_communication_is_what_each_layout_sends(
    name: str, parity: Callable[[int], dict[str, dict]]
) -> None:
    """Bytes rank 0 sent in one training step, by mesh dimension and collective (what the dispatcher ran,
    tests.instruments.CollectiveLog), against the dry run's for the same layout and model (dry_run.comm_by_kind,
    whose sums per dimension are its printed lines): within 1%, the gradient norm's all-reduces included, with
    gradient accumulation too (the replicas' all-reduce once per step, TP's collectives per micro-batch), but
    expert parallel's all-to-all, which the routing decides."""
    layout = LAYOUTS[name]
    measured = {key: nbytes for key, nbytes in parity(layout.world_size)[name]["sent_by_op"].items() if nbytes}
    cfg, dims, job = layout_plan(layout)
    predicted = comm_by_kind(cfg, dims, job, grad_accum=layout.grad_accum)
    for key in [key for key in predicted if key.endswith(" all_to_all")]:
        # Expert parallel's exchange is planned for balanced routing; the tiny model's, on rank 0, within 4% of it.
        sent, planned = measured.pop(key, 0), predicted.pop(key)
        assert abs(sent - planned) <= 0.04 * planned, (key, sent, planned)
    if layout.ep > 1:
        # Expert parallel flattens dp_shard x cp x tp (ParallelDims.expert_meshes), and DTensor reduces the FSDP x TP
        # gradient norms over that group or over each dimension, as it decided earlier in the process: the norms'
        # all-reduces (a float32 per tensor) compared in sum.
        measured["all_reduce"], predicted["all_reduce"] = (
            sum(d.pop(k) for k in [k for k in d if k.endswith(" all_reduce")]) for d in (measured, predicted)
        )
    assert measured.keys() == predicted.keys(), (measured, predicted)
    for key, nbytes in predicted.items():
        assert abs(measured[key] - nbytes) <= 0.01 * nbytes, (key, measured, predicted)


# ------------------------------------------------------------------- the floor table

SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "send": "send", "all_to_all": "A2A"}


def floors() -> dict[str, tuple[dict[str, float], dict[str, dict[str, float]]]]:
    """dry_run.comm_floor of every eager parity layout: (floor, excesses)."""
    out = {}
    for name in EAGER:
        cfg, dims, job = layout_plan(LAYOUTS[name])
        out[name] = comm_floor(cfg, dims, job, grad_accum=LAYOUTS[name].grad_accum)
    return out


def floor_table(results: dict[str, dict], floored: dict[str, tuple[dict, dict]]) -> str:
    """docs/results/comm_floor.md's floor table: per eager parity layout and mesh dimension, the bytes rank 0 sent in a
    step by collective (measured) / the floor (dry_run.comm_floor), and each excess over the floor with its cause."""
    lines = [
        "| layout | dimension | all-gather | reduce-scatter | all-reduce | send | all-to-all | over the floor (EXCESSES) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name in EAGER:
        floor, excesses = floored[name]
        sent = results[name]["sent_by_op"]
        for dim in dict.fromkeys(key.split()[0] for key in [*floor, *sent] if sent.get(key) or floor.get(key)):
            cells = [
                f"{sent.get(f'{dim} {kind}', 0):,} / {round(floor.get(f'{dim} {kind}', 0)):,}"
                if sent.get(f"{dim} {kind}") or floor.get(f"{dim} {kind}")
                else ""
                for kind in SHORT
            ]
            over = "; ".join(
                f"{cause}: "
                + ", ".join(
                    f"{SHORT[key.split()[1]]} {nbytes:+,.0f}"
                    for key, nbytes in added.items()
                    if key.startswith(f"{dim} ")
                )
                for cause, added in excesses.items()
                if any(key.startswith(f"{dim} ") for key in added)
            )
            lines.append(f"| {name} | {dim} | {' | '.join(cells)} | {over} |")
    return "\n".join(lines)


def test_the_floor_table_in_the_docs_is_what_the_layouts_send(parity: Callable[[int], dict[str, dict]]) -> None:
    """Every eager parity layout's bytes by collective beside its floor, and every excess with its cause (one line each
    in dry_run.EXCESSES, listed under the table): the table in docs/results/comm_floor.md is this one, and no layout
    sends less than its floor."""
    results, floored = parity(2) | parity(4), floors()
    for name in EAGER:
        layout = LAYOUTS[name]
        cfg, dims, job = layout_plan(layout)
        floor, excesses = floored[name]
        # (Expert parallel's all-to-all is planned for balanced routing, which a rank may send a little less than.)
        sent = sum(n for key, n in results[name]["sent_by_op"].items() if not key.endswith(" all_to_all"))
        assert sum(n for key, n in floor.items() if not key.endswith(" all_to_all")) <= sent, (name, floor, sent)
        assert sum(floor.values()) + sum(sum(added.values()) for added in excesses.values()) == pytest.approx(
            sum(comm_by_kind(cfg, dims, job, grad_accum=layout.grad_accum).values())
        )
    doc = (REPO / "docs" / "results" / "comm_floor.md").read_text()
    section = doc.split("\n### The communication floor", 1)[1].split("\n### ", 1)[0]
    expected = floor_table(results, floored)
    assert expected in section, f"docs/results/comm_floor.md: the table is now\n{expected}"
    for cause, why in EXCESSES.items():
        assert f"- {cause}: {why}" in " ".join(section.split()), cause
