"""Muon (muon.py) in one process: torch.optim.Muon + AdamW step for step, which parameters each family hands it, the
skip-step gate, and its refusals. Its parity under FSDP, TP, FSDP x TP, HSDP and PP: the muon_ layouts of
tests/parity_worker.py; resume on another layout: tests/test_train.py; bytes: benchmarks/test_muon.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import muon
from config import Comm, Optimizer, Training, load_config
from distributed import init_distributed
from errors import ConfigError
from models import NAMES, family
from muon import build_muon
from optimizer import set_hyperparameters, set_lr
from tests.instruments import count_host_reads
from tests.parity_worker import build_tiny, micro_batches, one_process, random_batch
from train import train_step


def test_one_process_steps_as_torch_optim_muon_and_adamw() -> None:
    """The recipe's Muon half is torch.optim.Muon (match_rms_adamw), its other half fused AdamW: the same parameters
    to the last bit after 3 steps, the hidden matrices through Muon and nothing else."""
    fam = family("llama3")
    model = build_tiny()
    reference = copy.deepcopy(model)
    o = Optimizer(name="Muon", lr=0.02)
    optimizer = build_muon(o, model, fam)
    hidden = set(muon.hidden_matrix_names(reference, fam))
    named = dict(reference.named_parameters())
    theirs = [
        torch.optim.Muon([named[n] for n in named if n in hidden], lr=0.02, weight_decay=o.weight_decay,
                         momentum=o.muon_momentum, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW([named[n] for n in named if n not in hidden], lr=0.02, betas=(o.beta1, o.beta2), eps=o.eps,
                          weight_decay=o.weight_decay, fused=True),
    ]  # fmt: skip
    tokens = random_batch()
    for _ in range(3):
        for m in (model, reference):
            m(tokens[:, :-1]).float().logsumexp(-1).mean().backward()
        optimizer._step_unless(torch.zeros(()))
        for o_ in theirs:
            o_.step()
        optimizer.zero_grad()
        for o_ in theirs:
            o_.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    moved = {n for n, p in model.named_parameters() if "momentum_buffer" in optimizer.state[p]}
    assert moved == hidden and len(hidden) == 7 * len(model.layers)


# qwen3_moe's experts are 3-D, which Muon refuses (tests/test_qwen3_moe.py).
@pytest.mark.parametrize("name", [name for name in NAMES if name != "qwen3_moe"])
def test_each_family_names_its_hidden_matrices(name: str) -> None:
    """Every block's attention and MLP projections, 2-D; embedding, output and every norm (QK-norms too) take AdamW."""
    fam = family(name)
    with torch.device("meta"):
        model = fam.model_cls(fam.flavors["debugmodel"])
    hidden = muon.hidden_matrix_names(model, fam)
    assert len(hidden) == len(fam.hidden_matrices) * len(model.layers) == 7 * len(model.layers)
    rest = [n for n, _ in model.named_parameters() if n not in hidden]
    assert all("norm" in n or n in ("tok_embeddings.weight", "output.weight") for n in rest), rest


@pytest.mark.parametrize("bad", ["non-finite", "spike"])
def test_a_skipped_step_leaves_muon_as_it_was_without_reading_the_device(bad: str) -> None:
    """The skip-step gate (optimizer.py) holds for Muon's half: a non-finite step, and a spike (training.skip_spike_sigma
    over a window of 2 steps), change no parameter and no momentum, and deciding it reads nothing back (a `where` on
    the same 0/1 tensor fused AdamW takes)."""
    model = build_tiny()
    training = Training(skip_spike_sigma=6, skip_spike_window=2)
    optimizer = build_muon(Optimizer(name="Muon"), model, family("llama3"), training=training)
    batch = micro_batches(random_batch())
    init_distributed(Comm(), dump_folder="unused")  # the spike rule's all-reduce of the loss
    try:
        for step in (1, 2):  # the spike window fills
            train_step(step, batch, one_process(model), optimizer, max_norm=1.0, stop_request=None)
        before = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()["state"])
        value = float("nan") if bad == "non-finite" else 1.0  # a finite gradient: the loss spikes
        for p in model.parameters():
            p.grad = torch.full_like(p, value)
        loss = torch.tensor(float("nan") if bad == "non-finite" else 1e3)
        with count_host_reads(torch.device("cpu")) as reads:
            optimizer.step_unless_bad(3, loss=loss, grad_norm=torch.tensor(value))
    finally:
        dist.destroy_process_group()
    assert dict(reads) == {}
    after = model.state_dict(), optimizer.state_dict()["state"]
    assert all(torch.equal(before[0][k], after[0][k]) for k in after[0])
    assert all(torch.equal(v, after[1][i][k]) for i, s in before[1].items() for k, v in s.items() if k != "step")
    optimizer.read_reports()
    assert (optimizer.nonfinite, optimizer.spikes) == ((1, 0) if bad == "non-finite" else (0, 1))


def test_the_step_hooks_run_once_after_both_halves() -> None:
    """optimizer.register_step_post_hook (the float8 scales' precompute, parallelisms/float8.py) runs once a step, after
    Muon's update too, even when an AdamW made earlier in the process had torch.optim wrap AdamW's own step in the
    hooks (it ran twice, first between the halves, in a process that built AdamW before Muon)."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # wraps AdamW.step in its hooks, as a first AdamW does
    model = build_tiny()
    optimizer = build_muon(Optimizer(name="Muon"), model, family("llama3"))
    hidden = dict(model.named_parameters())["layers.0.attention.wq.weight"]
    seen: list[torch.Tensor] = []
    optimizer.register_step_post_hook(lambda *_: seen.append(hidden.detach().clone()))
    train_step(1, micro_batches(random_batch()), one_process(model), optimizer, max_norm=1.0, stop_request=None)
    assert len(seen) == 1 and torch.equal(seen[0], hidden)


def test_a_loaded_optimizer_steps_both_halves_with_the_groups_it_loaded() -> None:
    """load_state_dict replaces an optimizer's group dicts: the gate's param_groups, which set_lr and
    set_hyperparameters change, must be the ones each half then steps with (lr 0 after a load moves nothing)."""
    model = build_tiny()
    optimizer = build_muon(Optimizer(name="Muon"), model, family("llama3"))
    set_optimizer_state_dict(model, optimizer, get_optimizer_state_dict(model, optimizer))  # as a resume does
    set_lr(optimizer, 0.0)
    before = copy.deepcopy(model.state_dict())
    model(random_batch()[:, :-1]).float().logsumexp(-1).mean().backward()
    optimizer.step_unless_bad(1, loss=torch.zeros(()), grad_norm=torch.ones(()))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [id(g) for g in optimizer.param_groups] == [id(g) for o in optimizer.optimizers for g in o.param_groups]
    assert [g["muon"] for g in optimizer.param_groups] == [False, True]


def test_config_keys_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(["--config", "configs/debug_muon.toml"])
    assert cfg.optimizer.name == "Muon" and cfg.optimizer.muon_orthogonalize == "matrix"
    with pytest.raises(ConfigError) as e:
        load_config(["--optimizer.name=Muon", "--optimizer.muon_ns_steps=0", "--optimizer.muon_momentum=1"])
    assert e.value.problems == [
        "optimizer.muon_momentum: must lie in [0, 1), got 1.0",
        "optimizer.muon_ns_steps: expected 1 to 99 Newton-Schulz iterations, got 0",
    ]
    # The per-shard reproduction says what it is at start-up; a resumed checkpoint's settings give way to the config.
    optimizer = build_muon(Optimizer(name="Muon", muon_orthogonalize="shard"), build_tiny(), family("llama3"))
    assert "docs/failures.md #6" in capsys.readouterr().err
    optimizer.param_groups[1]["momentum"] = 0.5
    set_hyperparameters(optimizer, Optimizer(name="Muon"))
    assert optimizer.param_groups[1]["momentum"] == 0.95 and "momentum" not in optimizer.param_groups[0]
