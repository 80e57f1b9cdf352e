"""The memory estimator (planning/estimate_memory.py): torchtitan's published peaks, when gradients exist, the
direction of each technique's effect, pipeline parallel per rank, expert parallel against two gloo ranks, the command
line, and the activation terms spelled out by hand.

benchmarks/test_memory.py checks the same activation formulas against bytes measured per rank.

    torchrun --nproc_per_node=2 tests/test_estimate_memory.py        (the expert-parallel test's ranks: one JSON line
                                                                      each per layout)
    torchrun --nproc_per_node=2 tests/test_estimate_memory.py lora   (the LoRA test's)
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from config import Optimizer, load_config
from errors import ConfigError
from models import family, with_seq_len
from models.llama3 import FLAVORS
from models.moe import MoEBalance
from muon import build_muon
from planning import estimate_memory, flags, trace
from planning.estimate_memory import breakdown
from planning.job import CPU, GPU, Job
from planning.memory import (
    GiB,
    ac_budget_gib,
    activation_bytes,
    choose_ac,
    estimate,
    estimate_rank,
    hidden_matrices,
    mode_costs,
    with_ac,
)
from planning.references import TT_MACHINE
from tests.instruments import LiveBytes
from tests.launch import python, torchrun
from tests.parity_worker import TINY_QWEN3_MOE

ARGS = with_seq_len(FLAVORS["debugmodel"], 256)
BATCH, SEQ = 4, 256


def test_8b_estimate_against_torchtitan() -> None:
    # torchtitan docs/performance.md: Llama 3.1 8B, 8 (and 128) H100, local batch 2, seq 8192,
    # selective op AC, FSDP bf16/fp32: 82.4 (67.0) GiB max reserved; eager RMSNorm, logits freed.
    job = dict(
        flavor="llama3_8b",
        local_batch_size=2,
        seq_len=8192,
        ac="selective-op",
        loss_chunk_tokens=0,
    )
    on8, on128 = (estimate(flags.job(ngpu=n, machine=TT_MACHINE, **job)) for n in (8, 128))
    for e, published in ((on8, 82.4), (on128, 67.0)):
        # Published is reserved: the allocated peak must be lower, by less than a quarter; reserved
        # is calibrated on these two (FRAGMENTATION), so it lands close.
        assert 0.75 * published <= e["allocator_peak"] / GiB < published, e["allocator_peak"] / GiB
        assert abs(e["reserved"] / GiB / published - 1) < 0.02, e["reserved"] / GiB
    # 8 -> 128 GPUs thins the state: the allocated peak (loss backward, no gradient shards yet) by 12
    # bytes/param / 8 - / 128 = 10.5 GiB, reserved also by the 4 bytes of shards cached in the
    # reduce-scatter stream's pool = 14.0 GiB. Published: 15.4.
    assert abs((on8["allocator_peak"] - on128["allocator_peak"]) / GiB - 10.5) < 0.1
    assert abs((on8["reserved"] - on128["reserved"]) / GiB - 15.4) < 1.5


def test_gradient_shards_exist_from_the_reduce_scatter_on() -> None:
    """zero_grad(set_to_none=True) runs before the first micro-batch: its loss backward holds no gradient
    shards; with accumulation the later micro-batches hold all of them."""
    base = dict(flavor="llama3_8b", ngpu=8, local_batch_size=2, seq_len=8192, loss_chunk_tokens=0)
    one, two = estimate(flags.job(**base)), estimate(flags.job(grad_accum=2, **base))
    assert one["peak_phase"] == two["peak_phase"] == "loss backward"
    assert one["grads_at_peak"] == 0 and two["grads_at_peak"] == two["grads"] > 3.5 * GiB
    assert two["allocator_peak"] - one["allocator_peak"] == pytest.approx(one["grads"])
    # Where gradients dominate (2 GPUs, short sequences) the block phase peaks at the last block in
    # backward, holding the shards of all the others; where activations dominate, at the first.
    short = estimate(flags.job(flavor="llama3_8b", ngpu=2, seq_len=256, ac="none"))
    assert short["block_phase_at"] == "block 0" and short["block_phase"] > 31 / 32 * short["grads"]
    assert one["block_phase_at"] == "block 31"
    # The caching allocator keeps the shards' blocks for the next step's reduce-scatters: reserved
    # counts them either way.
    assert one["reserved"] - one["allocator_peak"] > one["grads"]


def test_deferred_reduce_scatters_hold_unsharded_gradients_through_the_step() -> None:
    """parallelism.fsdp_defer_reduce_scatter: from the second micro-batch on, every gradient of the rank unsharded in
    reduce_dtype (FSDP2's accumulators) instead of the shards; with one micro-batch, or without FSDP, nothing
    changes. The breakdown and the doctor print the term."""
    base = dict(flavor="llama3_8b", ngpu=8, local_batch_size=1, seq_len=8192, grad_accum=4)
    shards, deferred = estimate(flags.job(**base)), estimate(flags.job(defer_reduce_scatter=True, **base))
    params = deferred["params"]  # float32 shards: 4 B x parameters / 8
    assert deferred["accumulators"] == pytest.approx(8 * params) and shards["accumulators"] == 0
    assert deferred["grads_at_peak"] == 0 and shards["grads_at_peak"] == shards["grads"]
    grown = deferred["allocator_peak"] - shards["allocator_peak"]
    assert grown == pytest.approx(deferred["accumulators"] - shards["grads"], rel=0.05), grown / GiB
    single = dict(base, grad_accum=1)
    assert estimate(flags.job(defer_reduce_scatter=True, **single))["total"] == estimate(flags.job(**single))["total"]
    assert "gradient accumulators" in breakdown(flags.job(defer_reduce_scatter=True, **base))


@pytest.mark.parametrize(
    "job",
    [
        flags.job(flavor="llama3_8b", ngpu=8, local_batch_size=2),
        flags.job(flavor="llama3_8b", ngpu=8, ac="full", cpu_offload=True),
        flags.job(flavor="llama3_70b", ngpu=64, tp=8, local_batch_size=8, ac="full", grad_accum=4),
        flags.job(flavor="llama3_405b", ngpu=512, tp=8, pp=8, local_batch_size=8, ac="full"),
        flags.job(flavor="llama3_405b", ngpu=512, tp=8, pp=8, local_batch_size=8, pp_schedule="InterleavedZeroBubble"),
    ],
)
def test_reserved_is_at_least_allocated(job: Job) -> None:
    e = estimate(job)
    assert e["reserved"] >= e["allocator_peak"] > 0 and e["total"] == e["reserved"] + e["overhead"]
    cpu = estimate(dataclasses.replace(job, machine=dataclasses.replace(job.machine, caching_allocator=False)))
    assert cpu["reserved"] == cpu["allocator_peak"] == e["allocator_peak"]


def test_estimator_effects() -> None:
    base = dict(flavor="llama3_8b", ngpu=8, local_batch_size=1, seq_len=8192)
    peak = {
        ac: estimate(flags.job(ac=ac, **base))["allocator_peak"]
        for ac in ("none", "selective-2", "selective-op", "full")
    }
    assert peak["full"] < peak["selective-op"] < peak["selective-2"] < peak["none"], peak
    offload = estimate(flags.job(ac="full", cpu_offload=True, **base))
    assert offload["state_on_gpu"] == 0 and offload["state_on_host"] > 14 * GiB
    bf16, fp32 = (estimate(flags.job(ac="full", param_dtype=d, **base)) for d in ("bfloat16", "float32"))
    assert fp32["block_unit"] == 2 * bf16["block_unit"] and fp32["params"] == bf16["params"]


# ---------------------------------------------------------------------------- pipeline parallel

PP_405B = dict(flavor="llama3_405b", ngpu=512, tp=8, pp=8, seq_len=8192, ac="full")


def test_pipeline_ranks_hold_their_stages_only() -> None:
    # 405B on 512 GPUs, TP 8 x PP 8 x FSDP 8, against the same TP 8 x FSDP 8 without PP (64 GPUs).
    job = flags.job(local_batch_size=8, **PP_405B)
    whole = estimate(flags.job(**{**PP_405B, "ngpu": 64, "pp": 1, "local_batch_size": 1}))
    ranks = [estimate_rank(job, r) for r in range(8)]
    # Each rank's sharded state is ~1/8 (its stage: 15 or 16 of 126 blocks, + embedding or output),
    # and the ranks together hold the whole model.
    assert all(0.11 < e["params"] / whole["params"] < 0.14 for e in ranks), [
        e["params"] / whole["params"] for e in ranks
    ]
    assert sum(e["params"] for e in ranks) == pytest.approx(whole["params"])
    assert [e["rank_blocks"] for e in ranks] == [15, 16, 16, 16, 16, 16, 16, 15]
    # 1F1B: stage s of 8 holds min(8 micro-batches, 8 - s); the loss only on the last stage.
    assert [e["microbatches_held"] for e in ranks] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert [e["loss_phase"] > 0 for e in ranks] == [False] * 7 + [True]
    assert [e["embedding_phase"] > 0 for e in ranks] == [True] + [False] * 7
    # FSDP under PP keeps the stage gathered and its gradients unsharded (fp32) for the whole step.
    assert ranks[1]["gathered_block_phase"] == pytest.approx(ranks[1]["params"] / 4 * 2 * 8)
    assert ranks[1]["accumulators"] == pytest.approx(ranks[1]["params"] * 8)
    worst = estimate(job)
    assert worst["total"] == max(e["total"] for e in ranks) and 40 * GiB < worst["allocator_peak"] < 80 * GiB


def test_pipeline_schedules_hold_what_they_should() -> None:
    # 16 micro-batches of 1 sequence over 8 stages.
    first, last = (
        {s: estimate_rank(flags.job(local_batch_size=16, pp_schedule=s, **PP_405B), rank) for s in ("1F1B", "GPipe")}
        for rank in (0, 7)
    )
    assert first["GPipe"]["microbatches_held"] == 16 and first["1F1B"]["microbatches_held"] == 8
    assert first["GPipe"]["act_blocks"] == first["1F1B"]["act_blocks"]  # per micro-batch
    assert first["GPipe"]["allocator_peak"] - first["1F1B"]["allocator_peak"] > 7 * first["1F1B"]["act_blocks"]
    assert last["GPipe"]["allocator_peak"] > last["1F1B"]["allocator_peak"]
    # Interleaved 1F1B: 2 stages per rank of ~8 blocks; torch's plan for rank 0 of 8 with 16
    # micro-batches runs (2 - 1) x 8 + 2 x 7 = 22 forwards before its first backward.
    inter = estimate_rank(flags.job(local_batch_size=16, pp_schedule="Interleaved1F1B", **PP_405B), 0)
    assert inter["pp_stages"] == "0, 8" and inter["rank_blocks"] == 15
    assert inter["microbatches_held"] == 23
    assert estimate_rank(flags.job(local_batch_size=16, pp_microbatch_size=2, **PP_405B), 0)["microbatches_held"] == 8


def test_pipeline_rules_are_the_runs() -> None:
    with pytest.raises(ConfigError) as e:
        flags.job(local_batch_size=6, pp_microbatch_size=4, pp_layers_per_stage=5, **PP_405B)
    # Both problems at once: the micro-batch size and the split (parallelisms/pp.py's own messages).
    assert len(e.value.problems) == 2
    assert e.value.problems[0].startswith("parallelism.pipeline_parallel_layers_per_stage: 5 makes 26 stages")
    assert e.value.problems[1].startswith("parallelism.pipeline_parallel_microbatch_size: 4 does not divide")


# ------------------------------------------------------------------------- fake-tensor step


def test_fake_step_against_the_formula() -> None:
    """torch's own count (FSDPMemTracker) of a fake-tensor step of the debug model on 2 fake ranks (FSDP, op
    SAC, CPU eager) agrees with the formula's allocated peak, with [lora] too, and it too finds no gradient shards
    at the loss backward unless gradients accumulate. In a subprocess: it starts a (fake) process group."""
    code = (
        "import json\nfrom planning import estimate_memory as em\n"
        "from planning import flags\nfrom planning.job import CPU\n"
        "kw = dict(flavor='debugmodel', ngpu=2, seq_len=256, local_batch_size=4, machine=CPU)\n"
        "jobs = [flags.job(grad_accum=g, **kw) for g in (1, 2)]\n"
        "jobs.append(flags.job(param_dtype='float32', extra=['--lora.enable=true'], **kw))\n"
        "print(json.dumps([[em.fake_job_memory(j), em.estimate(j)] for j in jobs]))"
    )
    proc = python("-c", code, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (fake1, formula1), (fake2, formula2), lora = json.loads(proc.stdout.splitlines()[-1])
    # [lora] (float32: the frozen base in the dtype the model is built in): the adapters' state only
    for fake, formula in ((fake1, formula1), (fake2, formula2), lora):
        assert abs(fake["total"] / formula["allocator_peak"] - 1) < 0.03, (fake, formula["allocator_peak"])
        assert fake["sharded_params"] == pytest.approx(formula["params"], rel=0.01)
        assert fake["optimizer_state"] == pytest.approx(formula["adam"], rel=0.01)
    assert formula1["peak_phase"] == "loss backward" and fake1.get("sharded_grads", 0) == 0
    assert fake2["sharded_grads"] == pytest.approx(formula2["grads"], rel=0.01)


# ------------------------------------------------------------------------------- command line


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    proc = python("-m", "planning.estimate_memory", "--references", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "82.4" in proc.stdout and "77.0" in proc.stdout and "70B, 64 GPUs" in proc.stdout
    assert "82.5" in proc.stdout and "72.7" in proc.stdout  # 405B under PP, two schedules
    main = estimate_memory.main
    assert main(["--flavor", "llama3_70b", "--ngpu", "64", "--tp", "8", "--ac", "full"]) == 0
    out = capsys.readouterr().out
    assert "total per GPU" in out and "peak, allocated" in out and "peak, reserved" in out
    args = ["--flavor", "llama3_405b", "--ngpu", "512", "--tp", "8", "--pp", "8", "--local-batch-size", "16"]
    assert main([*args, "--pp-schedule", "Interleaved1F1B", "--pp-layers-per-stage", "8"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: Interleaved1F1B, 16 micro-batches of 1 x 8192 tokens, 16 stages | pp rank" in out
    assert main([*args, "--pp-microbatch-size", "2", "--pp-rank", "0", "--grad-accum", "2"]) == 0
    out = capsys.readouterr().out
    assert "8 micro-batches of 2" in out and "pp rank 0 (asked for): stage(s) 0, 15 blocks" in out
    assert "grad accumulation 2" in out
    assert main([*args, "--pp-microbatch-size", "3"]) == 2
    # The recipe's rules, in this script's words: its flags, not the config keys.
    assert "error: --pp-microbatch-size: 3 does not divide --local-batch-size 16" in capsys.readouterr().err
    assert main(["--ngpu", "7", "--tp", "2"]) == 2
    assert (
        "--pp (1) x --replicate (1) x --cp (1) x --tp (2) does not divide the world size 7" in capsys.readouterr().err
    )
    # torchtitan's flavor names, as train.py takes them; a flavor of another family says which.
    assert main(["--flavor", "8B", "--ngpu", "8"]) == 0 and "llama3 llama3_8b: 8.03B params" in capsys.readouterr().out
    assert main(["--flavor", "qwen3_8b"]) == 2
    assert capsys.readouterr().err.strip().endswith("or pass --model qwen3")


def test_cli_reads_the_runs_config(capsys: pytest.CaptureFixture[str]) -> None:
    """One vocabulary: a run's TOML, any key as train.py takes it, and the short flags, all through the run's own
    loader (planning.flags.FLAGS is the one table of the flags' keys)."""
    main = estimate_memory.main
    assert main(["--config", "configs/llama3_8b.toml", "--ngpu", "64"]) == 0
    from_toml = capsys.readouterr().out
    assert main(["--flavor", "llama3_8b", "--ngpu", "64", "--training.local_batch_size", "1"]) == 0
    assert capsys.readouterr().out == from_toml  # the TOML's shape is the estimator's defaults
    assert main(["--config", "configs/llama3_8b.toml", "--ngpu", "64", "--seq-len", "4096", "--grad-accum", "2"]) == 0
    assert "local batch 1 x 4096 tokens, grad accumulation 2" in capsys.readouterr().out
    assert main(["--training.seq_len", "x"]) == 2
    assert capsys.readouterr().err == "error: --seq-len: expected int, got 'x' in the command line\n"
    assert main(["--trainng.seq_len", "1"]) == 2 and "trainng" in capsys.readouterr().err
    # flags.job speaks the same keys: the Job of a loaded config equals the one of its flags.
    cfg = load_config(["--config", "configs/llama3_8b.toml", "--parallelism.tensor_parallel_degree", "8"])
    assert Job.of(cfg, GPU, world_size=64) == flags.job(64, config="configs/llama3_8b.toml", tp=8)
    with pytest.raises(TypeError, match="no config key for tpp"):
        flags.job(8, tpp=2)


def test_traced_block_terms_by_hand() -> None:
    """The debug model's per-block bytes, as the trace of one block finds them, spelled out (CPU eager,
    composite RMSNorm): the same tensors the old SwiGLU formulas named."""
    T, D, F, H = BATCH * SEQ, ARGS.dim, ARGS.hidden_dim, ARGS.n_heads
    composite = dataclasses.replace(GPU, rmsnorm="composite")
    debug = dict(flavor="debugmodel", ngpu=2, local_batch_size=BATCH, seq_len=SEQ, machine=composite)
    fp32 = activation_bytes(flags.job(param_dtype="float32", ac="none", **debug))
    norms = 2 * (4 * T * D + 4 * T * D + 4 * T + 4 * T * D)  # fp32 input, x*rstd, rstd, output
    attention = 4 * 4 * T * D + 4 * T * H  # q, k, v, out; logsumexp
    assert fp32["per_block_no_ac"] == norms + attention + 4 * 4 * T * F
    full = activation_bytes(flags.job(ac="full", **debug))
    assert full["blocks"] == ARGS.n_layers * 2 * T * D  # each block's bf16 input
    # Op SAC keeps the input, the named linears' outputs (wq, wv, w1, w2) and attention's out + logsumexp.
    op = activation_bytes(flags.job(ac="selective-op", **debug))
    kv = ARGS.kv_heads * ARGS.head_dim
    assert op["per_block_checkpointed"] == 2 * T * (D + D + kv + F + D + D) + 4 * T * H
    # The fused CUDA kernel keeps its input and a scale per row where the composite one keeps fp32 copies.
    fused = activation_bytes(flags.job(param_dtype="float32", ac="none", **{**debug, "machine": GPU}))
    assert fp32["per_block_no_ac"] - fused["per_block_no_ac"] == 2 * (
        4 * T * D + 4 * T * D + 4 * T - (4 * T * D + 4 * T)
    )
    # Under TP 2 (a fake process group) sequence parallel halves the norms and the heads, not the gathered inputs.
    tp2 = activation_bytes(flags.job(**{**debug, "ngpu": 2, "tp": 2, "ac": "none", "param_dtype": "float32"}))
    gathered = 2 * 4 * T * D  # the attention and MLP inputs, gathered over the sequence
    assert tp2["per_block_no_ac"] == (fp32["per_block_no_ac"] - gathered) // 2 + gathered


def test_a_familys_own_norm_class_is_named_once_not_corrected_silently(capsys: pytest.CaptureFixture[str]) -> None:
    """The fused-RMSNorm correction knows nn.RMSNorm: a block whose norm is a class of the family's own is said to
    be counted as traced, once per family and class; nn.RMSNorm blocks say nothing."""
    import dataclasses

    import torch
    from torch import nn

    from models import family

    class OwnNorm(nn.Module):
        def __init__(self, dim: int):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

    llama = family("llama3")

    def own_norms(args: object) -> nn.Module:
        model = llama.model_cls(args)
        for block in model.layers.values():
            block.attention_norm = OwnNorm(block.attention_norm.weight.shape[0])
        return model

    tiny = with_seq_len(dataclasses.replace(ARGS, n_layers=1), SEQ)
    mine = dataclasses.replace(llama, name="ownnorm", model_cls=own_norms)
    # What the trace calls for each family and shape it traces (a family no model.name names cannot be traced).
    for fam, args in ((llama, tiny), (mine, tiny), (mine, dataclasses.replace(tiny, dim=2 * tiny.dim))):
        with torch.device("meta"):
            trace._warn_unfused_norms(fam, fam.model_cls(args).layers["0"])
        if fam is llama:
            assert "OwnNorm" not in capsys.readouterr().err
    assert capsys.readouterr().err.count("ownnorm's attention_norm is a OwnNorm, not nn.RMSNorm") == 1


def test_muons_state_and_step_as_the_optimizer_holds_them() -> None:
    """optimizer.name = "Muon": one float32 momentum per hidden-matrix parameter instead of AdamW's two moments, and a
    step whose transients (each matrix's float32 update and bfloat16 result, the largest matrix's iteration) the
    formula counts: against the bytes muon.py's step really allocates on the debug model (one process)."""
    fam = family("llama3")
    args = with_seq_len(fam.flavors["debugmodel"], 64)
    hidden = args.n_layers * sum(hidden_matrices("llama3", args))
    adamw, muon = (flags.job(1, flavor="debugmodel", seq_len=64, optimizer=o, machine=CPU) for o in ("AdamW", "Muon"))
    assert estimate(adamw)["adam"] - estimate(muon)["adam"] == 4 * hidden
    predicted = estimate(muon)["muon_step_phase"] - estimate(muon)["grads"]

    torch.manual_seed(0)
    model = fam.model_cls(args)
    model.init_weights()
    optimizer = build_muon(Optimizer(name="Muon"), model, fam)
    muon = optimizer.optimizers[1]  # the gate's AdamW, then Muon
    for _ in range(2):  # the second step: the momentum exists, as in every step after the first
        model.zero_grad()
        model(torch.randint(0, args.vocab_size, (2, 64))).float().mean().backward()
        existing = [*model.parameters(), *(p.grad for p in model.parameters())]
        existing += [v for s in optimizer.state.values() for v in s.values()]
        with torch.no_grad(), LiveBytes(existing).track() as live:
            muon._muon_step(muon.param_groups[0], muon.exchanges[0], torch.zeros(()))
    assert abs(live.peak / predicted - 1) < 0.1, (live.peak, predicted)
    e = estimate(flags.job(8, flavor="llama3_8b", seq_len=512, ac="full", optimizer="Muon"))
    assert e["peak_phase"] == "optimizer step (Muon)" and "Muon's step" in breakdown(
        flags.job(8, flavor="llama3_8b", seq_len=512, ac="full", optimizer="Muon")
    )


TEACHER_70B = ("--distill.enable=true", "--distill.teacher_path=step-0", "--distill.teacher_flavor=llama3_70b")


def test_a_teacher_adds_its_weights_hidden_states_and_divergence_and_nothing_else() -> None:
    """[distill] (distill.py): Llama 3 8B learning from Llama 3 70B on 64 ranks, op SAC, one 8192-token window a rank.
    The teacher's fp32 shards (4 B per parameter / 64: no gradient, no optimizer state), its root unit gathered in
    bf16 for the whole run, its hidden states of the micro-batch in every phase of backward, its logits and the
    divergence at the loss phase: the estimate is larger by exactly these, and no student term changes."""
    plan = dict(flavor="llama3_8b", seq_len=8192, local_batch_size=1, ac="selective-op")
    plain, kd = estimate(flags.job(64, **plan)), estimate(flags.job(64, **plan, extra=TEACHER_70B))
    teacher = FLAVORS["llama3_70b"]
    assert kd["teacher_params"] == pytest.approx(4 * family("llama3").num_params(teacher) / 64, rel=1e-12)
    assert kd["teacher_root"] == 2 * (teacher.dim * teacher.vocab_size + teacher.dim)
    assert kd["teacher_hidden"] == 2 * 8192 * teacher.dim
    chunk = flags.job(64, **plan).chunk_tokens  # the loss's chunk: both models' logits are made chunk by chunk
    assert chunk == 2048 and kd["teacher_loss"] == (2 + 16) * chunk * teacher.vocab_size
    teacher_keys = {key for key in kd if key.startswith("teacher_")}
    assert {plain[key] for key in teacher_keys} == {0.0}
    phases = {"loss_phase", "block_phase", "embedding_phase", "allocator_peak", "compute_peak", "reserved", "total"}
    assert {key for key in plain if kd[key] != plain[key]} == teacher_keys | phases | {"ag_pool"}
    hidden, loss = kd["teacher_hidden"], kd["teacher_loss"]
    assert kd["loss_phase"] - plain["loss_phase"] == pytest.approx(hidden + loss)
    for phase in ("block_phase", "embedding_phase"):
        assert kd[phase] - plain[phase] == pytest.approx(hidden), phase
    assert plain["peak_phase"] == kd["peak_phase"] == "loss backward"
    added = kd["teacher_params"] + kd["teacher_root"] + hidden + loss
    assert kd["allocator_peak"] - plain["allocator_peak"] == pytest.approx(added)
    # Its no_grad forward keeps no activations: two of its blocks gathered and one block's transients, less than
    # the student's backward needs.
    assert kd["teacher_forward_phase"] < kd["block_phase"] < kd["loss_phase"]
    # Under TP 8 the same ranks hold the same share of its weights (TP leaves only the norms whole).
    tp8 = estimate(flags.job(64, **plan, tp=8, extra=TEACHER_70B))
    assert tp8["teacher_params"] == pytest.approx(kd["teacher_params"], rel=1e-3)
    assert "teacher's params (fp32 shards)" in breakdown(flags.job(64, **plan, extra=TEACHER_70B))


def test_the_fake_step_refuses_muon_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """--fake-step steps AdamW: with Muon it would check another optimizer's state against Muon's estimate."""
    argv = ["--flavor", "debugmodel", "--ngpu", "2", "--seq-len", "64", "--allocator", "cpu", "--optimizer", "Muon"]
    assert estimate_memory.main([*argv, "--fake-step"]) == 2
    assert capsys.readouterr().err == (
        "error: --fake-step: optimizer Muon is estimated by the formulas only (the breakdown above); "
        "the fake step is AdamW's\n"
    )


# ------------------------------------------------------------------ mode "auto"


@pytest.mark.parametrize(
    "ranks, overrides",
    [(2, ()), (4, ("--parallelism.pipeline_parallel_degree=2", "--eval.enable=false"))],
    ids=["fsdp2", "pp2"],
)
def test_auto_chooses_the_least_recompute_that_fits(ranks: int, overrides: tuple[str, ...]) -> None:
    """Every assignment of the family mode "auto" searches (the first f blocks full, the next o op SAC, the rest
    none), estimated one by one: for budgets from above no AC's peak to just above full AC's, the choice fits and no
    assignment that fits recomputes fewer FLOPs. A per_block of one mode is estimated as that mode."""
    job = flags.job(ranks, config="configs/debug.toml", machine=CPU, extra=overrides)
    n = job.args.n_layers
    uniform = {mode: estimate(with_ac(job, **ac))["total"]
               for mode, ac in (("none", {"mode": "none"}), ("op", {"mode": "selective", "selective_ac_option": "op"}),
                                ("full", {"mode": "full"}))}  # fmt: skip
    for mode, total in uniform.items():
        assert estimate(with_ac(job, mode="per_block", per_block=[mode] * n))["total"] == total
    assert uniform["none"] > uniform["op"] > uniform["full"]
    flops = {mode: c.recompute_flops for mode, c in mode_costs(job).items()}
    assert flops["none"] == 0 < flops["op"] < flops["full"]
    trials = {
        (f, o): estimate(with_ac(job, mode="per_block", per_block=["full"] * f + ["op"] * o + ["none"] * (n - f - o)))[
            "total"
        ]
        for f in range(n + 1)
        for o in range(n + 1 - f)
    }
    cost = lambda f, o: f * flops["full"] + o * flops["op"]  # noqa: E731
    chosen = []
    gap = uniform["none"] - uniform["full"]
    for budget in [uniform["none"] + 1, *(uniform["full"] + k / 7 * gap for k in range(6, -1, -1))]:
        choice = choose_ac(job, budget_gib=budget / GiB)
        f, o = choice.modes.count("full"), choice.modes.count("op")
        assert choice.modes == ("full",) * f + ("op",) * o + ("none",) * (n - f - o)
        assert choice.estimate["total"] == trials[f, o] <= budget
        assert cost(f, o) == choice.recompute_flops == min(cost(*k) for k, total in trials.items() if total <= budget)
        chosen.append(choice.modes)
    assert chosen[0] == ("none",) * n and chosen[-1].count("full") >= n - 1 and len(set(chosen[-2])) > 1
    assert len(set(chosen)) >= 4
    tight = choose_ac(job, budget_gib=(uniform["full"] + gap / 7) / GiB)
    line = tight.describe()
    assert line.startswith("blocks full AC 0") and f"of the {tight.budget / GiB:.3g} GiB budget" in line
    assert line.endswith("per_block = [" + ", ".join(f'"{m}"' for m in tight.modes) + "])")

    with pytest.raises(ConfigError) as refused:
        choose_ac(job, budget_gib=0.99 * uniform["full"] / GiB)
    assert refused.value.problems == [
        f"activation_checkpoint.memory_budget_gib: the job needs about {uniform['full'] / GiB:.3g} GiB per rank even "
        f"with full AC on every block, over the budget of {0.99 * uniform['full'] / GiB:.3g} GiB; use more GPUs "
        "(FSDP, TP, PP), a smaller local_batch_size or seq_len, or a larger budget"
    ]


def test_the_budget_of_auto_is_set_or_90_percent_of_the_gpu_and_refused_without_either() -> None:
    from config import ActivationCheckpoint

    auto = ActivationCheckpoint(mode="auto")
    assert ac_budget_gib(auto, cuda_memory_gib=80.0) == 72.0
    assert ac_budget_gib(dataclasses.replace(auto, memory_budget_gib=50.0), cuda_memory_gib=80.0) == 50.0
    assert ac_budget_gib(dataclasses.replace(auto, memory_budget_gib=50.0), cuda_memory_gib=None) == 50.0
    with pytest.raises(ConfigError, match=r"^activation_checkpoint.memory_budget_gib: mode = \"auto\" fits"):
        ac_budget_gib(auto, cuda_memory_gib=None)
    # The command estimates a written-out choice; "auto" itself is refused in one line that says where it is chosen.
    proc = python("-m", "planning.estimate_memory", "--ac", "auto")
    assert proc.returncode == 2 and proc.stderr.startswith('error: --ac: "auto" is chosen block by block where the job')
    assert len(proc.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------ expert parallel


QWEN3_MOE_30B = dict(config="configs/qwen3_moe_30b_a3b.toml", extra=["--compile.enable=false"])


def test_expert_parallel_splits_the_experts_and_shards_the_rest_of_them() -> None:
    """Qwen3-30B-A3B on 64 GPUs: with expert parallel 8 each rank holds 16 of every block's 128 experts and FSDP shards
    them over the 8 efsdp ranks; TP 2 splits the attention, not the experts, which are spread over the 64 ranks all the
    same. Either way the ranks' fp32 shards add up to the model (TP's replicated norms and router twice), and FSDP
    gathers a block's dense part and this rank's 16 experts, not its 128."""
    fam = family("qwen3_moe")
    args = fam.flavors["qwen3_moe_30b_a3b"]
    experts = 3 * args.num_experts * args.moe_hidden_dim * args.dim  # of one block
    plain, ep8, tp2 = (estimate(flags.job(64, ep=ep, tp=tp, **QWEN3_MOE_30B)) for ep, tp in ((1, 1), (8, 1), (8, 2)))
    for e in (plain, ep8, tp2):
        assert 64 * e["params"] == pytest.approx(4 * fam.num_params(args), rel=1e-3)
    assert ep8["experts_unit"] == 2 * experts / 8  # bfloat16
    assert plain["block_unit"] - ep8["block_unit"] == 2 * experts * 7 / 8
    assert ep8["rs_buffers"] == (2 + 4) * ep8["block_unit"] / 2  # the block's gradient, bf16 and its fp32 copy
    assert "(ep 8 x efsdp 8)" in breakdown(flags.job(64, ep=8, **QWEN3_MOE_30B))


def test_expert_parallel_buffers_follow_the_routing(capsys: pytest.CaptureFixture[str]) -> None:
    """The exchange's bytes (planning.exchanges.ep_bytes) of 30B-A3B's 4,096 tokens x 8 choices per rank and block: balanced routing
    saves what the block saves without expert parallel; op SAC keeps both all-to-alls' rows (bf16, 2,048 wide); a rank
    that routing sends more rows holds its experts' buffers that many times, up to its whole ep group's, and the peak
    grows with them. The fake-tensor step cannot route (its split sizes are data): refused in one line."""
    jobs = {ep: flags.job(64, ep=ep, **QWEN3_MOE_30B) for ep in (1, 8)}
    none = {ep: mode_costs(job, ("none",))["none"] for ep, job in jobs.items()}
    op = {ep: mode_costs(job, ("op",))["op"] for ep, job in jobs.items()}
    rows = 4096 * 8
    assert none[8].saved == none[1].saved and none[8].experts_saved > 0.3 * none[8].saved
    assert op[8].kept - op[1].kept == 2 * rows * 2048 * 2 + 128 * 8  # + the counts per expert, int64
    loads = [1.0, 2.0, 4.0, 8.0]
    skewed = [estimate(dataclasses.replace(jobs[8], ep_load=load)) for load in loads]
    assert [e["ep_rows"] for e in skewed] == [load * rows for load in loads]
    assert all(a["total"] < b["total"] for a, b in zip(skewed, skewed[1:], strict=False))
    grown = dataclasses.replace(with_ac(jobs[8], mode="none"), ep_load=8.0)
    assert activation_bytes(grown)["per_block_no_ac"] == none[8].saved + 7 * none[8].experts_saved
    argv = ["--config", "configs/qwen3_moe_30b_a3b.toml", "--ngpu", "64", "--ep", "8", "--compile.enable", "false"]
    assert estimate_memory.main(argv) == 0
    assert "expert-parallel exchange" in capsys.readouterr().out
    assert estimate_memory.main([*argv, "--fake-step"]) == 2
    assert capsys.readouterr().err.startswith("error: --fake-step: expert parallel reads its all-to-all's split sizes")


@dataclasses.dataclass(frozen=True)
class EPLayout:
    """A layout of 2 ranks for the tiny Qwen3 MoE (4 experts, 2 per token), and the 2 experts every token is routed
    to: one of each rank's under ep 2 (rank 0 holds experts 0 and 1) is balanced routing; both of rank 0's is the
    most an ep group can send one rank (Job.ep_load 2 there, 0 on rank 1)."""

    ep: int = 2
    tp: int = 1
    ac: str = "none"
    experts: tuple[int, int] = (0, 2)

    def keys(self) -> dict[str, object]:
        """The job's keys, by the estimator's flags (planning.flags.FLAGS): float32 on CPU, local batch 16 x 32 tokens."""
        return dict(
            model="qwen3_moe", flavor="debugmodel", seq_len=32, local_batch_size=16, param_dtype="float32",
            loss_chunk_tokens=0, tp=self.tp, ep=self.ep, ac=self.ac,
        )  # fmt: skip

    def ep_load(self, rank: int) -> float:
        if self.ep == 1 or self.experts[0] // 2 != self.experts[1] // 2:
            return 1.0
        return 2.0 if rank == self.experts[0] // 2 else 0.0


EP_LAYOUTS = {
    "fsdp2": EPLayout(ep=1),  # without expert parallel: FSDP gathers every expert
    "ep2": EPLayout(),
    "ep2_routed_to_rank_0": EPLayout(experts=(0, 1)),
    "ep2_tp2": EPLayout(tp=2),  # TP splits the attention, not the experts: 4 ranks' worth of sharding for them
    "ep2_op_sac": EPLayout(ac="selective-op"),  # op SAC keeps both all-to-alls' rows
}
# The routing is fixed by the expert bias (models/moe.py), which adds 1 to the scores of the layout's experts for the
# choice: more than any probability differs. No load-balancing loss.
EP_ARGS = dataclasses.replace(TINY_QWEN3_MOE, balance=MoEBalance(load_balance_coeff=1e-3))


def test_expert_parallel_against_two_ranks() -> None:
    """What a rank holds under expert parallel, measured on 2 gloo ranks (one launch, every layout of EP_LAYOUTS):
    its parameters and AdamW's moments, bytes for bytes (each rank's experts / (dp_shard x tp), the rest / dp_shard),
    and the peak of the bytes a micro-batch's forward and backward hold beyond them (tests.instruments.LiveBytes),
    within 3% of the estimate's allocated peak less that state, as the fake step's test has it: the experts FSDP
    gathers (this rank's), the rows of each block's all-to-all in flight and, under op SAC, kept, and the experts'
    buffers of a rank that routing sends every row. Without expert parallel, the dense estimate of before."""
    proc = torchrun(__file__, nproc=2, timeout=300)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted((r["layout"], r["rank"]) for r in rows) == sorted((n, k) for n in EP_LAYOUTS for k in (0, 1))
    for r in rows:
        layout = EP_LAYOUTS[r["layout"]]
        job = flags.job(2, machine=CPU, args=EP_ARGS, **layout.keys())
        e = estimate(dataclasses.replace(job, ep_load=layout.ep_load(r["rank"])))
        assert (r["params"], r["adam"]) == (e["params"], e["adam"]), (r, e["params"], e["adam"])
        predicted = e["allocator_peak"] - e["params"] - e["adam"]
        assert abs(r["peak"] / predicted - 1) < 0.03, (r, predicted)
    # What the rank that receives every row holds beyond balanced routing: the experts' buffers of one more rank's rows
    # in each block (its peak, the second block's backward, holds both blocks' saved rows).
    peak = {(r["layout"], r["rank"]): r["peak"] for r in rows}
    assert peak["ep2_routed_to_rank_0", 0] > 1.15 * peak["ep2", 0]
    assert peak["ep2_routed_to_rank_0", 1] < peak["ep2", 1] / 1.15


def _ep_worker() -> None:
    """One rank of test_expert_parallel_against_two_ranks: per layout, the model built as train.py builds it, one step
    (AdamW's state exists from then on), then one micro-batch's forward and backward measured."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from data.loader import Batch
    from forward import ForwardBackward
    from loss import build_loss_fn
    from optimizer import build_optimizer
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.parallelize import build_model, init_model

    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    for name, layout in EP_LAYOUTS.items():
        cfg = load_config(flags.overrides(layout.keys()))
        dims = ParallelDims.from_config(cfg.parallelism, world_size=dist.get_world_size())
        mesh = dims.build_mesh("cpu")
        loss_fn = build_loss_fn(cfg.compile, chunk_tokens=cfg.training.loss_chunk_tokens)
        model, _ = build_model(cfg, EP_ARGS, dims=dims, mesh=mesh, loss_fn=loss_fn, device=cpu)
        init_model(model, None, device=cpu)
        bias = torch.zeros(EP_ARGS.num_experts)
        bias[list(layout.experts)] = 1.0
        for block in model.layers.values():
            block.moe.balance.expert_bias.copy_(bias)
        forward_backward = ForwardBackward.for_run(cfg, model, None, loss_fn, dims=dims, mesh=mesh, device=cpu)
        optimizer = build_optimizer(cfg.optimizer, model)
        generator = torch.Generator().manual_seed(dims.dp_rank(mesh))
        tokens = torch.randint(0, EP_ARGS.vocab_size, (cfg.training.local_batch_size, 33), generator=generator)
        batch = Batch(tokens[:, :-1], tokens[:, 1:], None, 1)
        forward_backward(batch, last=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        params = [local(p) for p in model.parameters()]
        moments = [local(state[k]) for state in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        with LiveBytes([*params, *moments, *model.buffers()]).track() as live:
            forward_backward(batch, last=True)
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        row = {"layout": name, "rank": dist.get_rank(), "params": nbytes(params), "adam": nbytes(moments)}
        print(json.dumps({**row, "peak": live.peak}), flush=True)
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------- LoRA


@dataclasses.dataclass(frozen=True)
class LoRALayout:
    """A layout of 2 ranks for the Llama debug model with [lora] (float32 on CPU: the frozen base is stored in
    param_dtype, which float32 makes the dtype the model is built in)."""

    tp: int = 1
    targets: str = "all-linear"

    def keys(self) -> dict[str, object]:
        """The job's keys by the estimator's flags (planning.flags.FLAGS): local batch 8 x 64 tokens, no AC, the loss in
        chunks of 128 tokens (with the whole loss at once the loss phase would peak, where FSDP has already gathered
        the last block, which the estimate counts in the block phase only, LoRA or not)."""
        return dict(
            flavor="debugmodel", seq_len=64, local_batch_size=8, param_dtype="float32", loss_chunk_tokens=128,
            tp=self.tp, ac="none",
        )  # fmt: skip

    def lora(self) -> list[str]:
        return ["--lora.enable=true", "--lora.r=16", f"--lora.target_modules={self.targets}"]


LORA_LAYOUTS = {
    "fsdp2": LoRALayout(),
    "fsdp2_q_v": LoRALayout(targets="q_proj,v_proj"),  # a frozen linear without an adapter saves no input
    "tp2": LoRALayout(tp=2),  # PEFT's rule: a column-parallel linear's B split, a row-parallel one's A
}
# The debug model with 12 blocks: the estimate counts every block as one after the first, whose input needs a
# gradient, and the first one's first norm saves nothing under LoRA (docs/planning.md, "LoRA"): a twelfth of a
# block's norm, where the debug model's 6 blocks would make it a sixth.
LORA_ARGS = dataclasses.replace(with_seq_len(FLAVORS["debugmodel"], 64), n_layers=12)


# Meta's published shapes (config.json of meta-llama/Llama-3.1-8B and -70B): hidden, intermediate, layers, heads, kv.
LLAMA3_HF = {"llama3_8b": (4096, 14336, 32, 32, 8), "llama3_70b": (8192, 28672, 80, 64, 8)}


def _peft_adapters(hidden: int, intermediate: int, layers: int, heads: int, kv: int) -> int:
    """PEFT's count of a LoRA of r 8 on every linear of transformers' Llama of this shape (on the meta device)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers)
    c = LlamaConfig(**shape, num_attention_heads=heads, num_key_value_heads=kv, vocab_size=128256)
    with torch.device("meta"):
        model = get_peft_model(LlamaForCausalLM(c), LoraConfig(r=8, target_modules="all-linear"))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_lora_adapters_by_hand_for_8b_and_70b() -> None:
    """[lora] (lora.py) on Llama 3 8B (8 GPUs) and 70B (64 GPUs, TP 8), bf16 param_dtype, r 8 on every linear: the
    adapters' parameters are the sum over the targets of r x (in + out) (and PEFT's count), their fp32 weights,
    gradients and AdamW's two moments 4 + 4 + 8 B each / the ranks; the frozen base is 2 B per parameter / the ranks,
    and has neither; nothing is left of the root unit's gradient and little of a block's."""
    for flavor, ngpu, tp in (("llama3_8b", 8, 1), ("llama3_70b", 64, 8)):
        hidden, intermediate, layers, heads, kv = LLAMA3_HF[flavor]
        kv_width = kv * hidden // heads
        # q, k, v, o, gate, up, down as (in, out)
        shapes = [(hidden, hidden), (hidden, kv_width), (hidden, kv_width), (hidden, hidden)]
        shapes += [(hidden, intermediate), (hidden, intermediate), (intermediate, hidden)]
        adapters = layers * sum(8 * (i + o) for i, o in shapes)
        assert adapters == _peft_adapters(*LLAMA3_HF[flavor])
        plan = dict(flavor=flavor, tp=tp, seq_len=8192, local_batch_size=1, ac="full")
        plain, lora = estimate(flags.job(ngpu, **plan)), estimate(flags.job(ngpu, **plan, extra=["--lora.enable=true"]))
        # PEFT's rule under TP 8: column-parallel q, k, v, gate, up: A whole, B / 8; row-parallel o, down: A / 8, B whole.
        column, row = shapes[:3] + shapes[4:6], shapes[3:4] + shapes[6:]
        on_rank = sum(8 * (i + o / tp) for i, o in column) + sum(8 * (i / tp + o) for i, o in row)
        assert lora["adapter_params"] == layers * on_rank
        shard = ngpu // tp  # FSDP shards the rank's adapters over the rest
        trained = layers * on_rank / shard
        assert lora["params"] - lora["frozen_params"] == pytest.approx(4 * trained, rel=1e-12)
        assert (lora["grads"], lora["adam"]) == pytest.approx((4 * trained, 8 * trained), rel=1e-12)
        base = plain["params"] / 4  # the model's parameters on the rank: 4 B each without LoRA
        assert lora["frozen_params"] == pytest.approx(2 * base, rel=1e-12)
        assert lora["root_grad"] == 0 < plain["root_grad"] and lora["rs_buffers"] < plain["rs_buffers"] / 100
        # FSDP gathers the adapters with their block, in param_dtype
        assert lora["block_unit"] - plain["block_unit"] == pytest.approx(2 * on_rank)
    assert "frozen base (bfloat16 shards)" in breakdown(flags.job(8, flavor="llama3_8b", extra=["--lora.enable=true"]))


def test_lora_against_two_ranks() -> None:
    """What a rank holds under [lora], measured on 2 gloo ranks (one launch, every layout of LORA_LAYOUTS): its
    parameters (the frozen base and the adapters) and AdamW's moments (the adapters' only), bytes for bytes, and the
    peak of the bytes a micro-batch's forward and backward hold beyond them (tests.instruments.LiveBytes), within 3%
    of the estimate's allocated peak less that state, as the expert-parallel test has it."""
    proc = torchrun(__file__, "lora", nproc=2, timeout=300)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted((r["layout"], r["rank"]) for r in rows) == sorted((n, k) for n in LORA_LAYOUTS for k in (0, 1))
    for r in rows:
        layout = LORA_LAYOUTS[r["layout"]]
        e = estimate(flags.job(2, machine=CPU, args=LORA_ARGS, extra=layout.lora(), **layout.keys()))
        assert r["dtype"] == "torch.float32" and r["trained"] == r["adapters"] > 0
        assert (r["params"], r["adam"]) == (e["params"], e["adam"]), (r, e["params"], e["adam"])
        assert r["adapter_bytes"] == e["params"] - e["frozen_params"]
        predicted = e["allocator_peak"] - e["params"] - e["adam"]
        assert abs(r["peak"] / predicted - 1) < 0.03, (r, predicted)


def _lora_worker() -> None:
    """One rank of test_lora_against_two_ranks: per layout, the model built as train.py builds it, one step (AdamW's
    state exists from then on), then one micro-batch's forward and backward measured."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from data.loader import Batch
    from forward import ForwardBackward
    from lora import is_adapter
    from loss import build_loss_fn
    from optimizer import build_optimizer
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.parallelize import build_model, init_model

    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    for name, layout in LORA_LAYOUTS.items():
        cfg = load_config([*flags.overrides(layout.keys()), *layout.lora()])
        dims = ParallelDims.from_config(cfg.parallelism, world_size=dist.get_world_size())
        mesh = dims.build_mesh("cpu")
        loss_fn = build_loss_fn(cfg.compile, chunk_tokens=cfg.training.loss_chunk_tokens)
        args = LORA_ARGS
        model, _ = build_model(cfg, args, dims=dims, mesh=mesh, loss_fn=loss_fn, device=cpu)
        init_model(model, None, device=cpu)
        forward_backward = ForwardBackward.for_run(cfg, model, None, loss_fn, dims=dims, mesh=mesh, device=cpu)
        optimizer = build_optimizer(cfg.optimizer, model)
        generator = torch.Generator().manual_seed(dims.dp_rank(mesh))
        tokens = torch.randint(0, args.vocab_size, (cfg.training.local_batch_size, 65), generator=generator)
        batch = Batch(tokens[:, :-1], tokens[:, 1:], None, 1)
        forward_backward(batch, last=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        named = [(n, local(p)) for n, p in model.named_parameters()]
        params = [p for _, p in named]
        moments = [local(state[k]) for state in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        trained = sum(1 for p in model.parameters() if p.requires_grad)
        with LiveBytes([*params, *moments, *model.buffers()]).track() as live:
            forward_backward(batch, last=True)
        row = {
            "layout": name,
            "rank": dist.get_rank(),
            "dtype": str(next(p for n, p in named if not is_adapter(n)).dtype),
            "params": nbytes(params),
            "adapter_bytes": nbytes([p for n, p in named if is_adapter(n)]),
            "adam": nbytes(moments),
            "trained": trained,
            "adapters": sum(1 for n, _ in named if is_adapter(n)),
        }
        print(json.dumps({**row, "peak": live.peak}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    _lora_worker() if sys.argv[1:] == ["lora"] else _ep_worker()
