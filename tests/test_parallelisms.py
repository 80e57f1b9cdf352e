"""Parallelisms: loss parity against one process, recomputation counted, refusals, cache keys.

Multi-process layouts run in two torchrun launches (2 and 4 ranks, tests/parity_worker.py, the
fixture `parity` of tests/conftest.py); every check of one world size shares its launch. All runs train the same tiny model from the
same weights on the same global batch in fp32, so losses and parameters must agree to ~1e-6.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.flop_counter import FlopCounterMode

from config import ActivationCheckpoint, Optimizer
from errors import ConfigError
from models.llama3 import FAMILY as LLAMA3
from models.llama3.model import Attention
from optimizer import build_optimizer
from parallelisms.ac import apply_ac
from parallelisms.compile import inductor_cache_dir
from parallelisms.tp import check_tp
from planning.flags import job as planned_job
from planning.job import CPU
from planning.trace import block_costs
from tests.instruments import count_calls, count_host_reads, count_ops
from tests.launch import REPO
from tests.parity_worker import (
    GLOBAL_BATCH,
    LAYOUTS,
    OP_SAC,
    SEQ_LEN,
    TINY,
    TINY_SHAPES,
    TP_GATHERS,
    TP_STATISTICS,
    Layout,
    build_tiny,
    max_param_diff,
    micro_batches,
    one_process,
    random_batch,
    train,
)
from train import train_step

TOL = 1e-5
# Muon's Newton-Schulz iteration runs in bfloat16 (torch.optim.Muon's): gradients that differ in their last float32 bits
# (summed in another order) can round to neighbouring bfloat16 values, so STEPS Muon steps land up to about 1e-4 apart
# even where no parameter is sharded (muon_pp2: 7e-5). Orthogonalizing each shard alone lands 2.7e-3 apart.
MUON_TOL = 3e-4
SAVED = LLAMA3.sac_saved_linears
aten = torch.ops.aten


# ------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def reference(parity_dir: Path) -> dict:
    return torch.load(parity_dir / "reference.pt")


# ------------------------------------------------------------ multi-process parity


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_and_parameter_parity(name: str, parity: Callable[[int], dict[str, dict]]) -> None:
    """FSDP, HSDP, TP + SP + loss parallel, FSDP x TP (+ AC, + compile), PP (each schedule, x FSDP, x TP)
    == one process, 5 AdamW steps (Muon with AdamW: its muon_ layouts)."""
    layout = LAYOUTS[name]
    result = parity(layout.world_size)[name]
    tol = MUON_TOL if layout.muon else TOL
    if layout.muon == "shard":  # docs/failures.md #6 reproduced: trains, with another optimizer
        assert result["max_param_diff"] > 5 * MUON_TOL, result
    else:
        assert result["max_loss_diff"] <= tol, result
        assert result["max_param_diff"] <= tol, result
        if result["max_grad_norm_diff"] is not None:  # a gradient scaled by a constant moves AdamW alike
            assert result["max_grad_norm_diff"] <= TOL, result
    # Every parameter really is sharded or replicated by a mesh; pipeline stages alone hold plain ones.
    assert result["param_types"] == ["Parameter" if layout.world_size == layout.pp else "DTensor"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_step_reads_nothing_back_and_compiled_steps_neither_recompile_nor_break(
    name: str, parity: Callable[[int], dict[str, dict]]
) -> None:
    """What decides GPU speed, counted on CPU: the host reads of a training step (`.item()`, `bool()`, ...,
    tests.instruments.count_host_reads), each a host sync on a GPU: none on any layout but expert parallel's (the
    split sizes of its all-to-all, parallelisms/ep.py, as torchtitan's); dynamo's graphs: compiled by the
    first step, none recompiled by the next four, no graph break."""
    layout = LAYOUTS[name]
    result = parity(layout.world_size)[name]
    expected: dict[str, int] = {}
    if layout.ep > 1:  # but expert parallel's: the all-to-all's split sizes, once per MoE block and forward
        expected = expert_exchange_reads(layout, result["host_reads"])
    assert result["host_reads"] == expected, result["host_reads"]
    assert (result["graphs_recompiled"], result["graph_breaks"]) == (0, 0), result
    assert (result["graphs_compiled"] > 0) == layout.compile, result


def expert_exchange_reads(layout: Layout, reads: dict[str, int]) -> dict[str, int]:
    """The host reads expert parallel's exchange makes in a step (parallelisms/ep.py dispatch: its split sizes), once
    per MoE block of the rank and forward. (An AC block's recomputation reads them again, in backward, where the
    counter, a torch function mode, does not see: torch.utils.checkpoint recomputes outside it.) A teacher of the
    family reads its own."""
    forwards = layout.grad_accum if layout.pp == 1 else GLOBAL_BATCH // (layout.dp_replicate * layout.dp_shard)
    forwards *= 2 if layout.distill else 1  # a teacher's forward before each of the student's (distill.py)
    site = next((site for site in reads if site.startswith("tolist at ep.py:")), "tolist at ep.py (none found)")
    return {site: TINY_SHAPES[layout.family].n_layers // layout.pp * forwards}


def test_the_host_read_counter_sees_the_reads_a_gpu_would_wait_for() -> None:
    """The counter of the test above can fail: for-each AdamW has no skip-step input, so SkipStepOptimizer
    reads the skip flag (optimizer.py says so); fused AdamW reads nothing."""
    model, batch = build_tiny(), micro_batches(random_batch())
    found = {}
    for implementation in ("fused", "foreach"):
        optimizer = build_optimizer(Optimizer(implementation=implementation), model)
        with count_host_reads(torch.device("cpu")) as reads:
            train_step(1, batch, one_process(model), optimizer, max_norm=1.0, stop_request=None)
        found[implementation] = dict(reads)
    line = next(
        i
        for i, text in enumerate((REPO / "optimizer.py").read_text().splitlines(), 1)
        if "elif not skip.item():" in text
    )
    assert found["fused"] == {} and found["foreach"][f"item at optimizer.py:{line}"] == 1, found


def test_chunked_loss_adds_no_fsdp_collective(parity: Callable[[int], dict[str, dict]]) -> None:
    """The projection runs 4 times in forward and 4 in backward (recomputed), its parameters are still
    gathered once and their gradient reduce-scattered once (loss.py, parallelisms/fsdp.py)."""
    plain, chunked = parity(2)["fsdp2"]["collectives"], parity(2)["fsdp2_chunked_loss"]["collectives"]
    assert (
        plain == chunked == {"all_gather_single": 6, "reduce_scatter_single": 4}
    )  # 4 units: embedding, 2 blocks, root; backward re-gathers the 2 blocks


def test_hsdp_gradients_cross_replicas_once_per_step(parity: Callable[[int], dict[str, dict]]) -> None:
    """HSDP with 2 micro-batches per step all-reduces each unit's gradient shard across the replicas once, the bytes
    of a step of one micro-batch (parallelisms/fsdp.py sync_gradients_on; FSDP2 alone would send twice). Its
    parity with one process is test_loss_and_parameter_parity's."""
    one, two = parity(4)["hsdp2x1_tp2"], parity(4)["hsdp2x1_tp2_accum2"]
    assert one["collective_ops"]["dp_replicate all_reduce"] == two["collective_ops"]["dp_replicate all_reduce"] == 4
    assert one["sent_by_dim"]["dp_replicate"] == two["sent_by_dim"]["dp_replicate"] > 0
    assert two["collective_ops"]["tp all_gather"] == 2 * one["collective_ops"]["tp all_gather"]  # TP's: per micro-batch


def test_deferred_reduce_scatters_run_once_per_step(parity: Callable[[int], dict[str, dict]]) -> None:
    """parallelism.fsdp_defer_reduce_scatter with 2 micro-batches per step: as many reduce-scatters as a step of one
    micro-batch (fsdp2's), the all-gathers still per micro-batch; the losses and weights are one process's
    (test_loss_and_parameter_parity)."""
    deferred, single = parity(2)["fsdp2_accum2_defer_rs"], parity(2)["fsdp2"]
    ops = deferred["collective_ops"]
    assert ops["dp_shard reduce_scatter"] == single["collective_ops"]["dp_shard reduce_scatter"] > 0, ops
    assert ops["dp_shard all_gather"] == 2 * single["collective_ops"]["dp_shard all_gather"], ops


@pytest.mark.parametrize("world_size", [2, 4])
def test_compiled_layouts_use_their_recipe_cache_folder(
    world_size: int, parity: Callable[[int], dict[str, dict]], parity_dir: Path
) -> None:
    """parallelize_model compiled into root/recipe-<hash of this recipe>, and inductor really wrote there.

    The launch set TORCHINDUCTOR_CACHE_DIR to the root; finding FX graphs in the recipe folder
    shows inductor read the variable at compile time (after `import torch`), as apply_compile assumes.
    """
    parity(world_size)
    root = parity_dir / f"inductor-{world_size}"
    # One folder per recipe (the mask, the family and the optimizer are not in it; float8's recipe is: tensorwise).
    expected = {
        inductor_cache_dir(
            {
                "tp_degree": layout.tp,
                "async_tp": False,
                "ac_mode": layout.ac.mode,
                "ac_option": layout.ac.selective_ac_option if layout.ac.mode == "selective" else "",
                "float8": "tensorwise" if layout.float8 else "",
            },
            root=root,
        )
        for layout in LAYOUTS.values()
        if layout.compile and layout.world_size == world_size
    }
    assert sorted(root.glob("recipe-*")) == sorted(expected)
    for folder in expected:
        assert any((folder / "fxgraph").rglob("*")), f"no FX graph cached in {folder}"


def test_one_rank_trains_under_autocast_not_fsdp() -> None:
    """parallelisms/fsdp.py applies_fsdp: bf16 parameters on one rank are float32 parameters trained under autocast
    (torchtitan's one-GPU mixed precision), not FSDP over one rank; every other bf16 layout is FSDP's, and
    autocast_dtype says which dtype a forward autocasts to (none where FSDP or float32 applies). The loss is the one
    autocast gives, and parameters and gradients stay float32."""
    from config import JobConfig, Parallelism, Training
    from loss import Loss
    from parallelisms.fsdp import applies_fsdp, autocast, autocast_dtype
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.parallelize import parallelize_model

    def dims(world: int, **degrees: int) -> ParallelDims:
        return ParallelDims.from_config(Parallelism(**degrees), world_size=world)

    assert not applies_fsdp(dims(1), param_dtype="bfloat16", cpu_offload=False)
    assert not applies_fsdp(dims(1), param_dtype="float32", cpu_offload=False)
    assert applies_fsdp(dims(1), param_dtype="bfloat16", cpu_offload=True)  # offload is an FSDP policy
    assert applies_fsdp(dims(2, tensor_parallel_degree=2), param_dtype="bfloat16", cpu_offload=False)
    assert not applies_fsdp(dims(2, tensor_parallel_degree=2), param_dtype="float32", cpu_offload=False)
    assert applies_fsdp(dims(2), param_dtype="float32", cpu_offload=False)
    bf16, fp32 = Training(mixed_precision_param="bfloat16"), Training(mixed_precision_param="float32")
    assert autocast_dtype(dims(1), bf16) is torch.bfloat16
    assert autocast_dtype(dims(1), fp32) is None
    assert autocast_dtype(dims(1), Training(enable_cpu_offload=True)) is None  # FSDP's mixed precision
    assert autocast_dtype(dims(2), bf16) is autocast_dtype(dims(2, tensor_parallel_degree=2), bf16) is None

    reference, model = build_tiny(), build_tiny()
    parallelize_model(model, JobConfig(training=bf16), dims=dims(1), mesh=None, device=torch.device("cpu"))
    tokens, loss_fn = random_batch(), Loss()
    projections = []
    model.layers["0"].attention.wq.register_forward_hook(lambda m, i, out: projections.append(out.dtype))
    with autocast(autocast_dtype(dims(1), bf16), "cpu"):
        loss = model(tokens[:, :-1], head=lambda h: loss_fn(model, h, tokens[:, 1:])).total
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(tokens[:, :-1], head=lambda h: loss_fn(reference, h, tokens[:, 1:])).total
    assert projections == [torch.bfloat16] and loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    loss.backward()
    assert not hasattr(model, "unshard")  # no FSDP
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}


def test_tp_refuses_shapes_it_cannot_split() -> None:
    """What TP needs of a shape, every problem in one ConfigError (load_config runs the same rule at start-up)."""
    tied = dataclasses.replace(TINY, tie_word_embeddings=True, n_heads=6, n_kv_heads=3)
    with pytest.raises(ConfigError) as info:
        check_tp(tied, tp_degree=4, seq_len=30)
    assert [p.split(":")[0] for p in info.value.problems] == [
        "parallelism.tensor_parallel_degree", "parallelism.tensor_parallel_degree", "training.seq_len",
        "parallelism.tensor_parallel_degree",
    ]  # fmt: skip
    assert info.value.problems[-1].startswith("parallelism.tensor_parallel_degree: 4 with a flavor that ties")


# ---------------------------------------------------- single process: AC, compile


@pytest.mark.parametrize(
    "ac",
    [
        ActivationCheckpoint(mode="full"),
        ActivationCheckpoint(mode="selective", selective_ac_option="op"),
        ActivationCheckpoint(mode="selective", selective_ac_option="2"),
        ActivationCheckpoint(mode="per_block", per_block=["op", "full"]),
    ],
    ids=["full", "op", "every-2nd", "per-block"],
)
def test_activation_checkpointing_keeps_losses_and_names(ac: ActivationCheckpoint, reference: dict) -> None:
    model = build_tiny()
    names = [name for name, _ in model.named_parameters()]
    apply_ac(model, ac, saved_linears=SAVED)
    assert [name for name, _ in model.named_parameters()] == names  # no wrapper prefix anywhere
    assert model.state_dict().keys() == reference["final"].keys()
    losses, _ = train(model, reference["tokens"])
    # Recomputation replays the same kernels on the same inputs: the result is bit-identical.
    assert losses == reference["losses"]
    assert max_param_diff(model.state_dict(), reference["final"]) == 0.0


@pytest.fixture
def restore_inductor_env() -> Iterator[None]:
    # apply_compile points the process at a cache folder through the environment (its job);
    # put the variables back so the rest of the session is unaffected.
    saved = {key: os.environ.get(key) for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# ------------------------------------------------------------ recomputation counted


@dataclass
class StepCounts:
    """What one training step ran: forward calls of each Attention, aten ops by phase, backward FLOPs."""

    attention_calls: Counter[str]
    forward_ops: Counter
    backward_ops: Counter
    backward_flops: int


def _one_step_counts(ac: ActivationCheckpoint) -> StepCounts:
    model = build_tiny()
    apply_ac(model, ac, saved_linears=SAVED)
    tokens = random_batch()
    with count_calls(model, Attention) as calls:
        with count_ops() as forward_ops:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        with count_ops() as backward_ops, FlopCounterMode(display=False) as flops:
            loss.backward()
    return StepCounts(calls, forward_ops, backward_ops, flops.get_total_flops())


def test_recomputation_is_counted_not_assumed() -> None:
    layers, tokens = TINY.n_layers, random_batch()[:, :-1].numel()
    dim, hidden, kv_dim = TINY.dim, TINY.hidden_dim, TINY.kv_heads * TINY.head_dim
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default  # the attention kernel on CPU, fp32
    mm = aten.mm.default

    none = _one_step_counts(ActivationCheckpoint(mode="none"))
    full = _one_step_counts(ActivationCheckpoint(mode="full"))
    op = _one_step_counts(ActivationCheckpoint(mode="selective", selective_ac_option="op"))
    every2 = _one_step_counts(ActivationCheckpoint(mode="selective", selective_ac_option="2"))
    mixed = _one_step_counts(ActivationCheckpoint(mode="per_block", per_block=["op", "full"]))

    # Forward: identical work whatever the AC mode; 7 matmuls per block + the output projection.
    for counts in (full, op, every2, mixed):
        assert counts.forward_ops[mm] == none.forward_ops[mm] == 7 * layers + 1
        assert counts.forward_ops[sdpa] == none.forward_ops[sdpa] == layers
    # Attention forward calls per step: 1 per block without AC, exactly one more per checkpointed block.
    assert none.attention_calls.total() == layers
    assert full.attention_calls.total() == op.attention_calls.total() == 2 * layers
    assert every2.attention_calls.total() == layers + 1  # only block 1 of blocks 0, 1
    assert set(full.attention_calls.values()) == {2}  # each block once more, none twice more (no nesting)

    # Backward: full AC reruns the attention kernel and the matmuls of every block, all but the
    # last one (w2): its output is saved by nothing, and non-reentrant checkpointing stops the
    # recomputation once it has what backward needs (torch.utils.checkpoint early stop) ...
    assert full.backward_ops[mm] - none.backward_ops[mm] == 6 * layers
    assert full.backward_ops[sdpa] - none.backward_ops[sdpa] == layers
    # ... op SAC reruns only the 3 unsaved matmuls per block (wk, wo, w3: every 2nd) and no attention.
    assert op.backward_ops[mm] - none.backward_ops[mm] == 3 * layers
    assert op.backward_ops[sdpa] == none.backward_ops[sdpa] == 0
    assert every2.backward_ops[mm] - none.backward_ops[mm] == 6

    # FLOPs say which matmuls: exactly wk (dim -> kv_dim), wo (dim -> dim) and w3 (dim -> hidden);
    # under full AC wq, wk, wv, wo, w1, w3.
    recomputed_op = 2 * tokens * layers * (dim * kv_dim + dim * dim + dim * hidden)
    recomputed_full = 2 * tokens * layers * (2 * dim * dim + 2 * dim * kv_dim + 2 * dim * hidden)
    assert op.backward_flops - none.backward_flops == recomputed_op
    assert full.backward_flops - none.backward_flops == recomputed_full
    # Per block: block 0 op SAC, block 1 full, each recomputing what its mode does and no more.
    assert mixed.attention_calls.total() == 2 * layers
    assert mixed.backward_ops[mm] - none.backward_ops[mm] == 3 + 6
    assert mixed.backward_flops - none.backward_flops == (recomputed_op + recomputed_full) // layers
    # What the memory estimate's trace counts as a block's recomputation (mode "auto" weighs its choices by it) is
    # what a step recomputes, with full AC's attention forward too: FlopCounterMode has no formula for the CPU's
    # attention kernel, the trace counts it as CUDA's (2 matmuls of batch x heads x seq x seq x head_dim).
    batch = tokens // SEQ_LEN
    attention = 2 * 2 * batch * TINY.n_heads * SEQ_LEN * SEQ_LEN * TINY.head_dim
    for mode, recomputed in (
        ("op", recomputed_op // layers),
        ("full", recomputed_full // layers + attention),
    ):
        shape = dict(flavor="debugmodel", seq_len=SEQ_LEN, local_batch_size=batch, param_dtype="float32")
        costs = block_costs(planned_job(1, machine=CPU, args=TINY, **shape), mode)
        assert costs.recompute_flops == recomputed, mode

    # activation_checkpoint.early_stop = false (torchtitan's default): the recomputation runs the whole
    # block, w2 included, though nothing needs its output.
    late = _one_step_counts(ActivationCheckpoint(mode="full", early_stop=False))
    assert late.backward_ops[mm] - none.backward_ops[mm] == 7 * layers


def test_checkpoint_options_reach_torch_utils_checkpoint() -> None:
    model = build_tiny()
    apply_ac(model, ActivationCheckpoint(mode="full", preserve_rng_state=False, determinism_check="none", debug=True))
    options = model.layers["0"]._ac_options
    assert options == {"use_reentrant": False, "preserve_rng_state": False, "determinism_check": "none", "debug": True}
    model(random_batch()[:, :-1]).sum().backward()  # torch.utils.checkpoint takes them


# ---------------------------------------------------------------- nesting refused


def test_nested_checkpointing_refused_wrapped_block() -> None:
    model = build_tiny()
    apply_ac(model, ActivationCheckpoint(mode="full"))
    with pytest.raises(ConfigError, match=r"layers\.0 \(CheckpointedTransformerBlock\) is already"):
        apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"), saved_linears=SAVED)

    model = build_tiny()
    model.layers["1"] = checkpoint_wrapper(model.layers["1"])  # FSDP1-era wrapping, done by hand
    with pytest.raises(ConfigError, match=r"layers\.1 \(CheckpointWrapper\) is already"):
        apply_ac(model, ActivationCheckpoint(mode="full"))


def test_reentrant_warns_and_op_sac_needs_non_reentrant(capsys: pytest.CaptureFixture[str]) -> None:
    apply_ac(build_tiny(), ActivationCheckpoint(mode="full", use_reentrant=True))
    assert (
        "warning: activation_checkpoint.use_reentrant = true: reentrant checkpointing skips" in capsys.readouterr().err
    )
    with pytest.raises(ConfigError, match="non-reentrant"):
        apply_ac(build_tiny(), ActivationCheckpoint(mode="selective", selective_ac_option="op", use_reentrant=True))


# --------------------------------------------------------------- inductor cache key


def test_inductor_cache_dir_is_keyed_on_the_recipe(tmp_path: Path) -> None:
    base = {"tp_degree": 2, "async_tp": False, "ac_mode": "selective", "ac_option": "op"}
    same = inductor_cache_dir(base, root=tmp_path)
    assert same == inductor_cache_dir(dict(reversed(base.items())), root=tmp_path)  # order does not matter
    assert same.parent == tmp_path and same.name.startswith("recipe-")
    # docs/failures.md #4: plain TP must never be served async TP's graphs.
    assert inductor_cache_dir({**base, "async_tp": True}, root=tmp_path) != same
    for change in (
        {"tp_degree": 4},
        {"ac_mode": "full"},
        {"ac_option": "2"},
        {"float8": "tensorwise"},
        {"float8": "rowwise"},
    ):
        assert inductor_cache_dir({**base, **change}, root=tmp_path) != same, change
    assert inductor_cache_dir(base, torch_version="2.7", root=tmp_path) != same


def test_inductor_cache_root_defaults_to_the_users_folder(restore_inductor_env: None, tmp_path: Path) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path)
    first = inductor_cache_dir({"ac_mode": "none"})
    assert first.parent == tmp_path
    # Once pointed at a recipe folder, the next recipe goes next to it, not inside it.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(first)
    second = inductor_cache_dir({"ac_mode": "full"})
    assert second.parent == tmp_path and second != first


def test_compiled_op_sac_recomputes_the_unnamed_matmuls() -> None:
    """Under compile, selective op AC finds the named linears through dynamo's module stack: the backward graph
    holds the 14 matmuls of a block's gradients plus the 3 recomputed ones (wk, wo, w3), as in eager. A fully
    checkpointed block (no TP) is compiled whole too: its recomputation (every matmul but w2's) is in the backward
    graph, not a second run of a compiled forward; early_stop = false (torchtitan's default) compiles the same
    graphs (dynamo cannot trace the switch, and a graph recomputes only what backward needs anyway)."""
    from torch._dynamo.backends.common import aot_autograd

    mm = aten.mm.default

    def backward_matmuls(saved_linears: tuple[str, ...] | None, ac: ActivationCheckpoint = OP_SAC) -> set[int]:
        counts: dict[str, list[int]] = {"fw": [], "bw": []}

        def keep(kind: str):  # an AOT compiler that records the graph's matmuls and runs it as it is
            def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> object:
                counts[kind].append(sum(node.target == mm for node in gm.graph.nodes))
                return gm.forward

            return compiler

        torch._dynamo.reset()
        model = build_tiny()
        if saved_linears is not None:
            apply_ac(model, ac, saved_linears=saved_linears)
        for block in model.layers.values():
            block.compile(fullgraph=True, backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")))
        tokens = random_batch()
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        assert set(counts["fw"]) == {7}  # per block graph (the blocks may share one)
        return set(counts["bw"])

    assert backward_matmuls(None) == {14}
    assert backward_matmuls(SAVED) == {14 + 3}
    assert backward_matmuls(()) == {14 + 6}  # nothing named: every matmul but w2's (not needed) recomputed
    assert backward_matmuls(SAVED, ActivationCheckpoint(mode="full")) == {14 + 6}
    assert backward_matmuls(SAVED, dataclasses.replace(OP_SAC, early_stop=False)) == {14 + 3}
    assert backward_matmuls(SAVED, ActivationCheckpoint(mode="full", early_stop=False)) == {14 + 6}
    torch._dynamo.reset()


def tp_block_collectives(family: str, ac: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """One block of `family` under its TP plan (torch's fake backend, one process: nothing is computed across
    ranks, every collective is recorded), forward and backward: the (kind, bytes) of its collectives, and those
    its plan should issue: sequence parallel's all-gather before attention and before the MLP (TP_GATHERS) and
    reduce-scatter after each, of a (bs, seqlen, dim) activation, mirrored in backward, plus the family's
    TP_STATISTICS."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import models
    from parallelisms.tp import apply_tp
    from tests.instruments import CollectiveLog, observe_ops

    fam = models.family(family)
    args = dataclasses.replace(TINY_SHAPES[family], n_layers=1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with torch.device("meta"):
            model = fam.model_cls(args)
        model.to_empty(device="cpu")
        model.init_weights()
        apply_tp(model, init_device_mesh("cpu", (2,)), block_plan=fam.tp_plan, loss_parallel=False, seq_len=SEQ_LEN)
        if ac == "op":
            apply_ac(model, OP_SAC, saved_linears=fam.sac_saved_linears)
        bs, log = 2, CollectiveLog({(0, 1): "tp"})
        x = torch.randn(bs, SEQ_LEN // 2, args.dim, requires_grad=True)  # this rank's sequence shard
        with observe_ops(log):
            model.layers["0"](x, model.rope_cos_sin, None).sum().backward()
    finally:
        dist.destroy_process_group()
    activation, statistic = bs * SEQ_LEN * args.dim * 4, bs * SEQ_LEN * 4
    expected = [("all_gather", activation), ("reduce_scatter", activation)] * 2 * TP_GATHERS.get(family, 2)
    expected += [("all_reduce", statistic)] * 2 * TP_STATISTICS[family]  # forward and backward
    return sorted((c.op, c.payload_bytes) for c in log.records), sorted(expected)


@pytest.mark.parametrize("ac", ["none", "op"])
@pytest.mark.parametrize("family", list(TINY_SHAPES))
def test_each_familys_tp_block_moves_what_its_plan_should_and_no_more(family: str, ac: str) -> None:
    """A plan that trains correctly but moves more fails here where the losses would not. Op SAC keeps the
    collectives' outputs (parallelisms/ac.py): its recomputation sends nothing again, OLMo 2's statistics
    included (they were sent three times before they were kept)."""
    found, expected = tp_block_collectives(family, ac)
    assert found == expected


def test_the_tp_count_fails_a_norm_that_reduce_scatters_its_full_width_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OLMo 2's QK-norm left to DTensor's own redistribute (the obvious port) trains the same but sends each
    norm's gradient at the projection's full width in backward: the count above catches it."""
    from torch.distributed.tensor import Replicate

    from models.olmo2 import model as olmo2_model

    slow = staticmethod(lambda partial: partial.redistribute(placements=[Replicate()]))
    monkeypatch.setattr(olmo2_model._SumOfShards, "apply", slow)
    found, expected = tp_block_collectives("olmo2", "none")
    assert found != expected and sum(kind == "reduce_scatter" for kind, _ in found) == 6, found


@pytest.mark.parametrize("family", list(TINY_SHAPES))
def test_each_familys_tp_block_computes_what_one_process_computes(family: str) -> None:
    """The values of the count above, in one process in seconds: the two TP ranks run as threads over torch's
    threaded process group, each with its sequence shard of the residual, one block under the family's plan, forward
    and backward; their outputs, input gradients and (gathered) weight gradients against the unsharded block's."""
    import threading

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    import models
    from parallelisms.ep import apply_ep
    from parallelisms.tp import apply_tp

    fam, args = models.family(family), dataclasses.replace(TINY_SHAPES[family], n_layers=1)
    torch.manual_seed(0)
    model = fam.model_cls(args)
    model.init_weights()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x, grad = torch.randn(2, SEQ_LEN, args.dim), torch.randn(2, SEQ_LEN, args.dim)
    x_ref = x.clone().requires_grad_()
    out_ref = model.layers["0"](x_ref, model.rope_cos_sin, None)
    out_ref.backward(grad)
    grads_ref = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    results: dict[int, tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = {}
    errors: list[BaseException] = []
    store = dist.HashStore()

    def rank(r: int) -> None:  # the global RNG is shared by the threads: nothing random in here
        try:
            dist.init_process_group("threaded", rank=r, world_size=2, store=store)
            tp = fam.model_cls(args)
            tp.load_state_dict(state)
            mesh = init_device_mesh("cpu", (2,))
            apply_tp(tp, mesh, block_plan=fam.tp_plan, loss_parallel=False, seq_len=SEQ_LEN)
            if fam.experts_module:  # a mixture of experts: the TP ranks are its expert parallel ranks (its plans.py)
                apply_ep(tp, mesh, experts=fam.experts_module)
            rows = slice(r * SEQ_LEN // 2, (r + 1) * SEQ_LEN // 2)  # this rank's sequence shard
            x_r = x[:, rows].clone().requires_grad_()
            out = tp.layers["0"](x_r, tp.rope_cos_sin, None)
            out.backward(grad[:, rows])
            full = {
                n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in tp.named_parameters()
            }
            results[r] = (out.detach(), x_r.grad, {n: g for n, g in full.items() if g is not None})
        except BaseException as e:  # kept for the test's thread, which asserts there was none
            errors.append(e)
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # each thread its own group registry
    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
    assert not errors and len(results) == 2, errors
    torch.testing.assert_close(torch.cat([results[r][0] for r in range(2)], dim=1), out_ref.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat([results[r][1] for r in range(2)], dim=1), x_ref.grad, rtol=0, atol=1e-5)
    assert results[0][2].keys() == grads_ref.keys()
    for name, g in grads_ref.items():
        torch.testing.assert_close(results[0][2][name], g, rtol=1e-5, atol=1e-5 * g.abs().max().item(), msg=name)
