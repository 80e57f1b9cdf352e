"""Qwen3 MoE beside torchtitan 0.2.2's qwen3 MoE: its checkpoints in and out under its names, and its own Trainer
giving this recipe's losses step for step from the same weights and token batches, without balancing and with the
expert bias on both sides.

torchtitan's MoE (torchtitan/models/moe) routes as this recipe does: softmax over the experts in float32, top-k,
the top-k renormalized (route_norm), scaled by 1, combined after the experts, no shared expert; its router's matmul
runs in the parameters' dtype (this recipe's in float32 always), the same in the float32 runs here. Its checkpoints
differ in two names: its router is an nn.Linear, `moe.router.gate.weight`, and its blocks hold a float32
`moe.expert_bias` (auxiliary-loss-free balancing, added to the scores the top-k picks from; here
`moe.balance.expert_bias`, models/moe.py, when model.moe.load_balance_coeff is set). Its trainer runs on CPU with the
loop over experts (`use_grouped_mm` off: its grouped matmuls cast to bfloat16 and pad the groups with a Triton
kernel), which is what tests/torchtitan_trainer.py's `qwen3_moe_flavor` registers, and moves the bias only under
that module's BALANCED_QWEN3 TrainSpec (its qwen3 TrainSpec never does).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from checkpoint import verify
from checkpoint.torchtitan import FLAT, load_torchtitan, torchtitan_name, torchtitan_state_dict
from errors import ConfigError
from models import family
from models.moe import MoEBalance
from tests.launch import REPO, torchrun, two_at_a_time
from tests.torchtitan_trainer import (
    BALANCED_QWEN3,
    FLAVORS_ENV,
    MOE_FLAVOR,
    qwen3_model_args,
    qwen3_moe_flavor,
    user_folder,
)

FAM = family("qwen3_moe")
ARGS = FAM.flavors["debugmodel"]
RTOL = 1e-5  # tests/test_torchtitan_checkpoints.py's, for Llama 3
COEFF = 1e-2  # the expert bias's step: in 2 steps it moves the routing, and the loss by far more than RTOL
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+)")


def torchtitans() -> nn.Module:
    """torchtitan's Qwen3 MoE of this recipe's debugmodel shape, initialized by its own init_weights; with torchtitan's
    default load_balance_coeff (every qwen3 MoE flavor of 0.2.2 leaves it so), its blocks hold an expert_bias."""
    from torchtitan.models.qwen3 import Qwen3Model

    model = Qwen3Model(qwen3_model_args(qwen3_moe_flavor(ARGS, load_balance_coeff=1e-3)))
    with torch.no_grad():
        model.init_weights()
    return model


def test_torchtitans_qwen3_moe_checkpoint_is_this_recipes_under_its_names(tmp_path: Path) -> None:
    """The weights of torchtitan's Qwen3 MoE are this recipe's, tensor for tensor, under its names: in from its
    checkpoint, out into its model (strict) and into its AdamW, whose moments find their parameters; a nonzero
    expert_bias, which this recipe's routing would ignore, is refused in one line."""
    torch.manual_seed(0)
    theirs = torchtitans()
    ours = FAM.model_cls(ARGS)
    state = theirs.state_dict()
    # Its names and shapes: ours renamed, plus an expert_bias per block; its token counts are not saved.
    assert {n: t.shape for n, t in state.items()} == {torchtitan_name(FAM, n): t.shape for n, t in ours.state_dict().items()} | {
        f"layers.{i}.moe.expert_bias": (ARGS.num_experts,) for i in range(ARGS.n_layers)
    }  # fmt: skip
    assert "layers.0.moe.router.gate.weight" in state and "layers.0.moe.tokens_per_expert" not in state
    assert "layers.0.moe.tokens_per_expert" in dict(theirs.named_buffers())

    # In: torchtitan's checkpoint of its model (what its CheckpointManager writes: the state dict at the top level).
    dcp.save(state, checkpoint_id=str(tmp_path / "theirs"), no_dist=True)
    load_torchtitan(tmp_path / "theirs", verify(tmp_path / "theirs"), ours, None, family=FAM, args=ARGS,
                    key="checkpoint.initial_load_path")  # fmt: skip
    for name, t in ours.state_dict().items():
        assert torch.equal(t, state[torchtitan_name(FAM, name)]), name

    # Out: this recipe's model and AdamW after a step, as torchtitan's checkpoint; its model loads it strictly, its
    # optimizer (torchtitan's OptimizersContainer) finds every moment under its parameters' names.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config.job_config import Optimizer as TorchtitanOptimizer

    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    ours(torch.randint(0, ARGS.vocab_size, (2, 16))).square().mean().backward()
    opt.step()
    flat = get_optimizer_state_dict(ours, opt, options=FLAT)
    group = {k.rsplit(".", 1)[1]: v for k, v in flat.items() if k.startswith("param_groups.tok_embeddings.weight.")}
    optimizer = {k: v for k, v in flat.items() if k.startswith("state.")} | {
        f"param_groups.{k}": v for k, v in group.items()
    }
    out = torchtitan_state_dict(dict(ours.state_dict()), optimizer, family=FAM, args=ARGS, step=1, lr=1e-3,
                                next_lr=1e-3, tokens_per_rank=32, loader=None)  # fmt: skip
    fresh = torchtitans()
    fresh.load_state_dict({k: v for k, v in out.items() if isinstance(v, torch.Tensor)}, strict=True)
    assert all(not fresh.layers[str(i)].moe.expert_bias.any() for i in range(ARGS.n_layers))
    container = build_optimizers([fresh], TorchtitanOptimizer(lr=1e-3, implementation="for-loop"), None)
    container.load_state_dict(out["optimizer"])
    gate = fresh.layers["2"].moe.router.gate.weight
    (their_state,) = [container.optimizers[0].state[gate]]
    assert torch.equal(their_state["exp_avg_sq"], opt.state[ours.layers["2"].moe.router.weight]["exp_avg_sq"])
    assert their_state["exp_avg_sq"].any()

    # A checkpoint whose bias moves the routing: refused, nothing loaded.
    with torch.no_grad():
        theirs.layers["1"].moe.expert_bias[3] = 0.25
    dcp.save(theirs.state_dict(), checkpoint_id=str(tmp_path / "biased"), no_dist=True)
    before = {n: t.clone() for n, t in ours.state_dict().items()}
    with pytest.raises(ConfigError) as info:
        load_torchtitan(tmp_path / "biased", verify(tmp_path / "biased"), ours, None, family=FAM, args=ARGS,
                        key="checkpoint.initial_load_path")  # fmt: skip
    assert str(info.value) == (
        f"checkpoint.initial_load_path: {tmp_path / 'biased'} holds torchtitan's load-balancing moe.expert_bias "
        "nonzero (1 blocks, e.g. layers.1.moe.expert_bias), which moves its routing, and this run's model has no "
        "expert bias; set model.moe.load_balance_coeff > 0 (torchtitan's default is 0.001) to load and train it"
    )
    assert all(torch.equal(t, before[n]) for n, t in ours.state_dict().items())
    # With the bias on here too (models/moe.py), torchtitan's loads into it, and goes out under its name again.
    biased = FAM.model_cls(dataclasses.replace(ARGS, balance=MoEBalance(load_balance_coeff=1e-3)))
    load_torchtitan(tmp_path / "biased", verify(tmp_path / "biased"), biased, None, family=FAM, args=ARGS,
                    key="checkpoint.initial_load_path")  # fmt: skip
    assert torch.equal(biased.layers["1"].moe.balance.expert_bias, theirs.layers["1"].moe.expert_bias)
    out = torchtitan_state_dict(dict(biased.state_dict()), None, family=FAM, args=ARGS, step=0, lr=0.0, next_lr=0.0,
                                tokens_per_rank=0, loader=None)  # fmt: skip
    assert torch.equal(out["layers.1.moe.expert_bias"], theirs.layers["1"].moe.expert_bias)
    assert sorted(out) == sorted(theirs.state_dict())


def _torchtitan(folder: Path, *args: str, coeff: float | None = None) -> dict[int, float]:
    """torchtitan 0.2.2's own Trainer on one CPU rank in `folder`, this recipe's debugmodel registered as its flavor,
    its expert_bias moved by `coeff` after each step (BALANCED_QWEN3) or none (None): its losses by step."""
    env = {FLAVORS_ENV: json.dumps({"qwen3": {MOE_FLAVOR: qwen3_moe_flavor(ARGS, load_balance_coeff=coeff)}})}
    argv = [*args, f"--model.name={'qwen3' if coeff is None else BALANCED_QWEN3}", f"--model.flavor={MOE_FLAVOR}"]
    proc = torchrun(REPO / "tests" / "torchtitan_trainer.py", *argv, nproc=1, cwd=folder, env=env)
    return {int(m[1]): float(m[2]) for m in _STEP.finditer(_ANSI.sub("", proc.stdout + proc.stderr))}


def _recipe(folder: Path, dump: Path, *args: str, coeff: float = 0.0, nproc: int = 1) -> dict[int, float]:
    """train.py in `folder`, the debugmodel without a load-balancing loss, with an expert bias moved by `coeff` after
    each step (0: none): its losses by step."""
    argv = [*args, "--model.name=qwen3_moe", "--model.flavor=debugmodel", "--model.moe.router_aux_loss_coef=0",
            f"--model.moe.load_balance_coeff={coeff}", f"--job.dump_folder={dump}",
            f"--data.cache_folder={folder / 'cache'}"]  # fmt: skip
    torchrun(REPO / "train.py", *argv, nproc=nproc, cwd=folder)
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "tps" in r}


def _equal(ours: dict[int, float], theirs: dict[int, float], steps: list[int]) -> bool:
    return sorted(ours) == sorted(theirs) == steps and all(
        math.isclose(ours[s], theirs[s], rel_tol=RTOL) for s in steps
    )


def test_torchtitans_trainer_and_this_recipe_train_qwen3_moe_alike(tmp_path: Path) -> None:
    """From one seed checkpoint of torchtitan's model (its expert_bias zero) and one token stream (torchtitan on one
    rank reads this recipe's batches): without balancing, torchtitan's Trainer and train.py on one process give the
    same losses at steps 1-4. With the expert bias on both sides (torchtitan's rule, models/moe.py's), train.py on 2
    ranks, expert parallel 2 under FSDP 2, resumes torchtitan's step-2 checkpoint (its bias and AdamW's moments under
    its names) and gives torchtitan's losses at steps 3-4, which the bias moved away from those without it.
    torchtitan's expert parallel needs a GPU (its token permutation is a Triton kernel): its one rank is the
    reference. Two launches side by side, twice."""
    folder = user_folder(tmp_path)
    seed = tmp_path / "seed"
    torch.manual_seed(0)
    dcp.save(torchtitans().state_dict(), checkpoint_id=str(seed), no_dist=True)
    shape = ["--job.config_file", "debug_model.toml", "--training.seq_len=256", "--training.mixed_precision_param=float32",
             "--activation_checkpoint.mode=none", "--training.steps=4"]  # fmt: skip
    start = [f"--checkpoint.initial_load_path={seed}", "--checkpoint.enable", "--checkpoint.interval=2"]
    balanced = tmp_path / "balanced"
    titans_balanced, ours = two_at_a_time(
        lambda: _torchtitan(folder, *shape, *start, f"--job.dump_folder={balanced}", coeff=COEFF),
        lambda: _recipe(folder, tmp_path / "ours", *shape, f"--checkpoint.initial_load_path={seed}"),
    )
    ep = tmp_path / "ep"
    shutil.copytree(balanced / "checkpoint" / "step-2", ep / "checkpoint" / "step-2")
    titans, resumed = two_at_a_time(
        lambda: _torchtitan(folder, *shape, *start, f"--job.dump_folder={tmp_path / 'theirs'}"),
        lambda: _recipe(folder, ep, *shape, "--checkpoint.enable", "--training.global_batch_size=8",
                        "--training.local_batch_size=4", "--parallelism.expert_parallel_degree=2", coeff=COEFF,
                        nproc=2),
    )  # fmt: skip
    assert _equal(ours, titans, [1, 2, 3, 4]), (ours, titans)
    assert 7.0 < titans[4] < titans[1] < 8.5  # near ln 2048 = 7.6, and learning
    assert _equal(resumed, {s: titans_balanced[s] for s in (3, 4)}, [3, 4]), (resumed, titans_balanced)
    assert titans_balanced[1] == titans[1] and not math.isclose(titans_balanced[4], titans[4], rel_tol=10 * RTOL)
