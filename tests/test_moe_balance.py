"""Load balancing of a mixture of experts (models/moe.py, docs/failures.md #7): the load-balancing loss and its
gradients against transformers', its statistics counted once under activation checkpointing and compile, no host
read but a logged step's, the expert bias, the config keys, a resumed run; then one launch of 4 gloo ranks
(tests/moe_balance_worker.py): the logged loss and the gradients of 4 ranks (FSDP with 2 micro-batches each,
pipeline stages, expert parallel, TP) equal one process's over the whole batch, the biases move alike, and the
per-micro-batch form logs and trains on something else.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from config import load_config, run_model_args
from errors import ConfigError
from models.hf import from_hf
from models.moe import Balancer, MoEBalance
from models.qwen3_moe import Transformer
from tests.test_qwen3_moe import hf_as_ours
from tests.tiny_hf import batch, tiny_hf_model

TOL = 1e-4  # tests/test_qwen3_moe.py's, against transformers
COEF = 0.1  # large enough that the loss's gradient is most of the router's (transformers' default 0.001 is not)


def balanced(model: torch.nn.Module, args: object, settings: MoEBalance) -> torch.nn.Module:
    """The same weights in a model of `args` that balances with `settings` (its expert biases at 0)."""
    ours = Transformer(dataclasses.replace(args, balance=settings))
    ours.init_weights()
    missing, unexpected = ours.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(name.endswith(".balance.expert_bias") for name in missing), (missing, unexpected)
    return ours


@pytest.mark.parametrize("layers", [1, 2])
def test_the_loss_and_its_gradients_are_transformers_on_one_micro_batch(layers: int, tmp_path: Path) -> None:
    """transformers' Qwen3MoeForCausalLM with output_router_logits: its loss is the cross-entropy + coef x aux_loss,
    aux_loss its load_balancing_loss_func. One layer: our logged loss and, at a second step on the same batch (f the
    first's counts: this batch's), every gradient equal its own. Two: it pools the layers' tokens (models/moe.py), so
    our value is its function applied to each layer alone, averaged."""
    reference = tiny_hf_model(family="qwen3_moe", seed=layers, num_hidden_layers=layers, router_aux_loss_coef=COEF)
    reference.save_pretrained(tmp_path)
    plain, args = from_hf(tmp_path)
    ours = balanced(plain, args, MoEBalance(router_aux_loss_coef=COEF))
    balancer = Balancer.of(ours, ours.args, pieces_per_step=1)
    tokens, labels = batch(args.vocab_size)

    out = reference(tokens, output_router_logits=True)
    ce = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
    (ce + COEF * out.aux_loss).backward()
    theirs = hf_as_ours({name: p.grad for name, p in reference.named_parameters()}, args)
    per_layer = [load_balancing_loss_func((logits,), args.num_experts, args.top_k) for logits in out.router_logits]

    for step in (1, 2):
        ours.zero_grad()
        logits = ours(tokens)
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        balancer(step, None)
    aux_loss = balancer.summary().aux_loss
    assert aux_loss == pytest.approx(torch.stack(per_layer).mean().item(), rel=1e-6)
    if layers == 1:
        assert aux_loss == pytest.approx(out.aux_loss.item(), rel=1e-6)
    grads = {name: p.grad for name, p in ours.named_parameters()}
    router = [name for name in grads if name.endswith("router.weight")]
    # The loss's gradient is most of the router's: without it, the router's gradients are far from transformers'.
    plain_logits = plain(tokens)
    F.cross_entropy(plain_logits.flatten(0, 1), labels.flatten()).backward()
    without = max((plain.get_parameter(n).grad - theirs[n]).abs().max().item() for n in router)
    diff = max((grads[n] - theirs[n]).abs().max().item() for n in (grads if layers == 1 else router))
    print(f"{layers} layer(s): max |grad diff| {diff:.2e}, without the loss {without:.2e}")
    assert (logits - out.logits).abs().max().item() <= TOL
    if layers == 1:
        assert diff <= TOL and without > 10 * TOL, (diff, without)


def tiny(settings: MoEBalance | None, *, seed: int = 0) -> Transformer:
    """A 2-block mixture of 4 experts, 2 per token (tests/parity_worker.py's shape), balancing with `settings`."""
    from tests.parity_worker import TINY_QWEN3_MOE

    torch.manual_seed(seed)
    model = Transformer(dataclasses.replace(TINY_QWEN3_MOE, balance=settings))
    model.init_weights()
    return model


def second_step(
    model: Transformer, tokens: torch.Tensor, *, microbatches: int
) -> tuple[float, dict[str, torch.Tensor]]:
    """Two steps on `tokens` in `microbatches` micro-batches (loss.py's scaling), no optimizer step between them: the
    logged load-balancing loss and the gradients of the second (its f the first's counts)."""
    balancer = Balancer.of(model, model.args, pieces_per_step=microbatches)
    for step in (1, 2):
        model.zero_grad()
        for rows in tokens.tensor_split(microbatches):
            logits = model(rows[:, :-1])
            (F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()) / microbatches).backward()
        balancer(step, None)
    return balancer.summary().aux_loss, {name: p.grad.clone() for name, p in model.named_parameters()}


def test_checkpointed_and_compiled_blocks_count_each_micro_batch_once() -> None:
    """Full AC reruns each block's forward in backward, op SAC too, compiled (dynamo and AOTAutograd trace the block,
    its autograd function and the statistics' leaf): the logged loss and every gradient are those of plain blocks,
    of one micro-batch or two. The "microbatch" scope's gradients are others."""
    from config import ActivationCheckpoint
    from parallelisms.ac import apply_ac
    from parallelisms.compile import apply_compile
    from tests.parity_worker import random_batch

    settings = MoEBalance(router_aux_loss_coef=COEF)
    tokens = random_batch()
    value, grads = second_step(tiny(settings), tokens, microbatches=1)
    for mode, compiled in (("full", False), ("selective", True)):
        model = tiny(settings)
        apply_ac(model, ActivationCheckpoint(mode=mode, selective_ac_option="op"), saved_linears=("attention.wq",))
        if compiled:
            apply_compile(model, backend="aot_eager")
        got, got_grads = second_step(model, tokens, microbatches=2)
        assert got == pytest.approx(value, rel=1e-6), (mode, got, value)
        assert max((got_grads[n] - grads[n]).abs().max().item() for n in grads) <= 1e-6, mode
    microbatch = tiny(MoEBalance(router_aux_loss_coef=COEF, aux_loss_scope="microbatch"))
    _, alone = second_step(microbatch, tokens, microbatches=2)
    assert (alone["layers.0.moe.router.weight"] - grads["layers.0.moe.router.weight"]).abs().max() > 1e-5


def test_both_off_is_the_plain_model_to_the_bit_and_still_counts_the_routing() -> None:
    """router_aux_loss_coef 0 and no expert bias: the loss and every gradient are those of a model without any
    balancing (a flavor's, transformers' function), and the routing is still counted for the metrics."""
    from tests.parity_worker import random_batch

    tokens = random_batch()
    plain, off = tiny(None), tiny(MoEBalance(router_aux_loss_coef=0.0))
    assert plain.layers["0"].moe.balance is None and set(plain.state_dict()) == set(off.state_dict())
    value, grads = second_step(off, tokens, microbatches=2)
    for _ in (1, 2):
        plain.zero_grad()
        for rows in tokens.tensor_split(2):
            logits = plain(rows[:, :-1])
            (F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()) / 2).backward()
    assert all(torch.equal(p.grad, grads[name]) for name, p in plain.named_parameters())
    assert value > 0  # load: counted


def test_a_step_and_its_balancing_read_nothing_on_the_host_but_a_logged_one() -> None:
    """train.py's train_step, then the Balancer (statistics summed, f and biases set): no read of a device tensor
    into Python (on a GPU each is a host sync, tests/instruments.py); the log's summary reads once."""
    from config import Optimizer
    from data.loader import Batch
    from forward import ForwardBackward
    from loss import Loss
    from optimizer import build_optimizer
    from tests.instruments import count_host_reads
    from tests.parity_worker import random_batch
    from train import train_step

    model = tiny(MoEBalance(router_aux_loss_coef=COEF, load_balance_coeff=1e-3))
    balancer = Balancer.of(model, model.args, pieces_per_step=2)
    forward_backward, optimizer = (
        ForwardBackward(model, Loss(), device=torch.device("cpu")),
        build_optimizer(Optimizer(lr=1e-3), model),
    )
    batches = [Batch(t[:, :-1], t[:, 1:], None, 2) for t in random_batch().tensor_split(2)]
    for step in (1, 2):  # the first step sets the optimizer's state up
        with count_host_reads(torch.device("cpu")) as reads:
            result = train_step(step, batches, forward_backward, optimizer, max_norm=1.0, stop_request=None)
            balancer(step, result)
    assert not reads, reads
    with count_host_reads(torch.device("cpu")) as reads:
        balancer.summary()
    assert sum(reads.values()) == 1, reads


def test_the_expert_bias_moves_the_choice_not_the_weights() -> None:
    """The bias decides the top-k only: the routing weights stay the router's probabilities of the chosen experts;
    it is in the state dict (the checkpoint), and a bias of 0 routes as no bias."""
    model = tiny(MoEBalance(load_balance_coeff=1e-3))
    router, balance = model.layers["0"].moe.router, model.layers["0"].moe.balance
    assert "layers.0.moe.balance.expert_bias" in model.state_dict()
    x = torch.randn(64, model.args.dim)
    plain = router(x)
    assert all(torch.equal(a, b) for a, b in zip(router(x, balance.expert_bias), plain, strict=True))
    bias = torch.tensor([1.0, 1.0, 0.0, 0.0])  # the first two experts win every choice
    routing = router(x, bias)
    assert (routing.expert_ids.sort(dim=-1).values == torch.tensor([0, 1])).all()
    picked = plain.probs.gather(1, routing.expert_ids)
    assert torch.allclose(routing.weights, picked / picked.sum(-1, keepdim=True))


def test_config_sets_the_model_and_refuses_what_does_not_fit(tmp_path: Path) -> None:
    """[model.moe] reaches a mixture of experts' shape (the model a run, generate.py and eval.py build); a dense model
    is refused any setting, a negative weight is refused, and expert biases are not exported to Hugging Face."""
    moe = ["--config", "configs/qwen3_moe_debug.toml", "--parallelism.expert_parallel_degree=1"]
    cfg = load_config([*moe, "--model.moe.load_balance_coeff=1e-3", "--model.moe.aux_loss_scope=microbatch"])
    assert run_model_args(cfg).balance == MoEBalance(0.001, "microbatch", 0.001)
    assert load_config(moe).model.moe.router_aux_loss_coef == 0.001  # transformers' weight, on by default
    with pytest.raises(ConfigError) as e:
        load_config(["--config", "configs/debug.toml", "--model.moe.aux_loss_scope=microbatch"])
    assert e.value.problems == [
        "model.moe.aux_loss_scope: model.name = 'llama3' has no mixture of experts; remove the key"
    ]
    with pytest.raises(ConfigError) as e:
        load_config([*moe, "--model.moe.router_aux_loss_coef=-1", "--model.moe.load_balance_coeff=1e-3",
                     "--checkpoint.last_save_in_hf"])  # fmt: skip
    assert [p.split(":")[0] for p in e.value.problems] == [
        "model.moe.router_aux_loss_coef",
        "model.moe.load_balance_coeff",
    ]


# ----------------------------------------------------------------- 4 ranks against one process


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    from tests.launch import torchrun

    out = tmp_path_factory.mktemp("moe_balance") / "layouts.json"
    torchrun("tests/moe_balance_worker.py", str(out), nproc=4)
    return json.loads(out.read_text())


# tests/moe_balance_worker.py LAYOUTS: each the reference's value, gradients and biases (the worker says how).
GLOBAL_BATCH = ["fsdp4_accum2", "fsdp4", "pp2_fsdp2_accum2", "ep2_fsdp4", "tp2_ep2_fsdp2"]


@pytest.mark.parametrize("layout", GLOBAL_BATCH)
def test_four_ranks_log_and_train_what_one_process_does_over_the_whole_batch(
    layout: str, four_ranks: dict[str, dict]
) -> None:
    """The logged loss of 4 ranks (2 micro-batches each; FSDP, pipeline stages, expert parallel, TP) equals one
    process's over the whole batch, and so do the gradients, to the parity tests' tolerance (tests/test_parallelisms.py)."""
    got = four_ranks[layout]
    worst = got["worst"]
    assert got["value"] == pytest.approx(got["reference"], rel=1e-6), got
    assert worst["value_diff"] <= 1e-6 * got["reference"] and worst["grad_diff"] <= 1e-5, got
    if got["bias_moved"] is not None:  # torchtitan's rule on the global batch's counts
        assert worst["bias_diff"] == 0 and got["bias_moved"] > 0, got


def test_per_micro_batch_counts_are_another_loss(four_ranks: dict[str, dict]) -> None:
    """The "microbatch" scope logs the mean of each rank's micro-batch's own loss (the reference counts each
    piece alone) and trains on other gradients than the global batch's."""
    got = four_ranks["fsdp4_microbatch"]
    assert got["value"] == pytest.approx(got["reference"], rel=1e-6), got
    assert got["value"] > four_ranks["fsdp4"]["value"] + 1e-4, got
    assert got["worst"]["router_grad_diff"] > 10 * 1e-5, got


def test_a_resumed_run_goes_on_as_an_uninterrupted_one(tmp_path: Path) -> None:
    """The checkpoint holds the expert biases (the model's) and the last step's counts (`moe_balance`, the Balancer):
    2 steps, then 2 more from the checkpoint, log what 4 steps log, to the bit."""
    from torch.distributed.checkpoint import FileSystemReader

    from tests.launch import python

    run = [
        "train.py", "--config", "configs/qwen3_moe_debug.toml", "--parallelism.expert_parallel_degree=1",
        "--training.seq_len=64", "--training.global_batch_size=8", "--training.local_batch_size=4",
        "--metrics.log_freq=1", "--validation.enable=false", "--debug.deterministic", "--lr_scheduler.warmup_steps=1",
        "--model.moe.load_balance_coeff=1e-3", "--checkpoint.interval=2",
    ]  # fmt: skip
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for args in ([f"--job.dump_folder={whole}", "--training.steps=4"],
                 *[[f"--job.dump_folder={parts}", "--checkpoint.enable", f"--training.steps={n}"] for n in (2, 4)]):  # fmt: skip
        proc = python(*run, *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout

    def logged(dump: Path) -> list[dict]:  # each step's row but its timings (loss, moe_aux_loss, moe_load_*, ...)
        rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if k not in ("tps", "mfu", "memory_gib", "step_time_s")} for row in rows]

    assert logged(whole) == logged(parts) and [row["step"] for row in logged(parts)] == [1, 2, 3, 4]
    assert all({"moe_aux_loss", *(f"moe_load_{i}" for i in range(4))} <= row.keys() for row in logged(parts))
    assert "| moe aux 2." in proc.stdout and all(row[f"moe_load_{i}"] >= 1 for row in logged(parts) for i in range(4))
    saved = FileSystemReader(str(parts / "checkpoint" / "step-2")).read_metadata().state_dict_metadata
    assert {f"moe_balance.layers.{i}.load" for i in range(4)} <= saved.keys()
    assert "model_and_optimizer.model.layers.0.moe.balance.expert_bias" in saved
