"""The load-balancing loss per micro-batch vs over the global batch (docs/failures.md #7, models/moe.py): what each
form counts, and what it lets experts do with tokens of different kinds.

    python -m benchmarks.moe_balance --out outputs/bench/moe_balance.json

The debug MoE (Qwen3 MoE's debugmodel: 4 blocks of 8 experts, 2 per token) on two kinds of text that share no
token: kind A cycles through a fixed permutation of the vocabulary's first half, kind B through one of its second
half. Every step is a global batch of two micro-batches, one of each kind, as long documents or a corpus per
data-parallel rank make them. The model starts as experts that have specialized: each kind keeps to its own half of
the experts (`specialize`), which is balanced over the global batch (every expert gets its share of the pairs) and
not within a micro-batch. From that start, one process trains `--steps` steps with train.py's train_step,
ForwardBackward and Balancer, once per form, at the same weight of the loss. Measured:

    logged loss   what each form's load-balancing loss counts at the first step, on the same router (its minimum
                  is top_k = 2: f and P uniform)
    kind share    after training, on a held-out batch of each kind: the fraction of a kind's (token, choice) pairs
                  that its busiest half of the experts takes (1: it keeps to half of them; 0.5: it spreads over all)
    load          max / mean (token, choice) pairs per expert over both kinds, the global batch's balance
    loss          the training loss, the mean of the last 5 steps (each step's batch is new: one step's is noisy)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch

from benchmarks import harness
from benchmarks.harness import Row
from config import Optimizer
from data.loader import Batch
from forward import ForwardBackward
from loss import Loss
from models import with_seq_len
from models.moe import Balancer, MoEBalance
from models.qwen3_moe import FLAVORS, Transformer
from optimizer import build_optimizer
from train import train_step

PROBLEM = "#7 MoE balance"
SCOPES = ("microbatch", "global_batch")  # broken, fixed
TILT = 4.0  # how far the two kinds' embeddings move apart, along one direction (specialize)


def kinds(vocab: int, *, rows: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """Two batches of `rows` sequences of seq_len + 1 tokens: kind A in [0, vocab / 2), kind B in [vocab / 2, vocab),
    each token followed by its kind's successor in a fixed random cycle (the same for every seed), from random starts."""
    half = vocab // 2
    cycle = torch.randperm(half, generator=torch.Generator().manual_seed(0))
    successor = torch.empty(half, dtype=torch.long)
    successor[cycle] = cycle.roll(-1)
    starts = torch.randint(0, half, (2, rows), generator=torch.Generator().manual_seed(seed))
    batches = []
    for kind in range(2):
        tokens = torch.empty(rows, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = starts[kind]
        for i in range(seq_len):
            tokens[:, i + 1] = successor[tokens[:, i]]
        batches.append(tokens + kind * half)
    return batches


def train(scope: str, args: argparse.Namespace) -> dict[str, Any]:
    """`args.steps` steps of the debug MoE balancing with `scope`; the routing of a held-out batch of each kind."""
    shape = with_seq_len(FLAVORS["debugmodel"], args.seq_len)
    shape = dataclasses.replace(shape, balance=MoEBalance(args.coef, scope))  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = Transformer(shape)
    model.init_weights()
    specialize(model, gap=args.gap)
    optimizer = build_optimizer(Optimizer(lr=args.lr), model)
    balancer = Balancer.of(model, shape, pieces_per_step=2)
    assert balancer is not None
    forward_backward = ForwardBackward(model, Loss(), device=torch.device("cpu"))
    losses, logged, start = [], [], time.perf_counter()
    for step in range(1, args.steps + 1):
        batches = kinds(shape.vocab_size, rows=args.rows, seq_len=args.seq_len, seed=step)
        micro = [Batch(t[:, :-1], t[:, 1:], None, 2) for t in batches]  # one micro-batch of each kind
        result = train_step(step, micro, forward_backward, optimizer, max_norm=1.0, stop_request=None)
        assert result is not None
        balancer(step, result)
        losses.append(result.loss.total.item())
        logged.append(balancer.summary().aux_loss)
    seconds = time.perf_counter() - start
    held_out = kinds(shape.vocab_size, rows=args.rows, seq_len=args.seq_len, seed=10_000)
    counts = routing_counts(model, held_out)  # (kinds, layers, experts)
    both = counts.sum(dim=0)
    share = counts.sort(dim=-1, descending=True).values[..., : shape.num_experts // 2].sum(-1) / counts.sum(-1)
    return {
        "losses": losses,
        "aux_loss": logged,  # per step, as Balancer.summary gives it
        "seconds": seconds,
        "kind_share": share.tolist(),  # [kind][layer]
        "load": (both.max(dim=-1).values / both.mean(dim=-1)).tolist(),  # [layer]
        "counts": counts.tolist(),
    }


@torch.no_grad()
def specialize(model: Transformer, *, gap: float) -> None:
    """A start where each kind keeps to its own half of the experts, balanced over the global batch (as experts
    that have specialized): the embeddings of kind A and kind B move apart along a random direction u, every
    router's first half of the experts scores along +u and its second half along -u, `gap` logits apart for a
    token of either kind."""
    dim, vocab = model.args.dim, model.args.vocab_size
    u = torch.randn(dim, generator=torch.Generator().manual_seed(1))
    u /= u.norm()
    embedding = model.tok_embeddings.weight
    kind = torch.ones(vocab)
    kind[vocab // 2 :] = -1
    embedding += TILT * kind[:, None] * u  # a quarter of an embedding's norm (its elements have std 1)
    # After RMSNorm a token's hidden state is about TILT along +-u: a router row +-a u scores it +-a TILT, the
    # halves 2 a TILT apart.
    a = gap / (2 * TILT)
    for block in model.layers.values():
        router = block.moe.router.weight
        router -= torch.outer(router @ u, u)  # within a half, a token's own features choose (balanced)
        half = router.shape[0] // 2
        router[:half] += a * u
        router[half:] -= a * u


@torch.no_grad()
def routing_counts(model: Transformer, batches: list[torch.Tensor]) -> torch.Tensor:
    """(kinds, layers, experts): the (token, choice) pairs each expert of each layer gets of each batch."""
    seen: list[torch.Tensor] = []
    hooks = [
        block.moe.router.register_forward_hook(lambda module, args, out: seen.append(out.tokens_per_expert))
        for block in model.layers.values()
    ]
    try:
        rows = []
        for tokens in batches:
            seen.clear()
            model(tokens[:, :-1])
            rows.append(torch.stack(seen))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(rows).double()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    runs = {scope: train(scope, args) for scope in SCOPES}
    return {"settings": vars(args) | {"out": str(args.out)}, "runs": runs}


def _mean(values: list[Any]) -> float:
    flat = [v for row in values for v in (row if isinstance(row, list) else [row])]
    return statistics.fmean(flat)


def rows(results: dict[str, Any]) -> list[Row]:
    broken, fixed = (results["runs"][scope] for scope in SCOPES)
    s = results["settings"]
    after = f"debug MoE, {s['steps']} steps at coef {s['coef']:g}"
    return [
        Row(PROBLEM, f"a kind's pairs on its busiest half of the 8 experts ({after}; from 1)", "", "per micro-batch",
            _mean(broken["kind_share"]), "global batch", _mean(fixed["kind_share"])),
        Row(PROBLEM, "load-balancing loss logged for experts specialized by kind, balanced (minimum 2)", "",
            "per micro-batch", broken["aux_loss"][0], "global batch", fixed["aux_loss"][0]),
        Row(PROBLEM, f"max / mean expert load over the global batch ({after})", "", "per micro-batch",
            _mean(broken["load"]), "global batch", _mean(fixed["load"])),
        Row(PROBLEM, f"training loss, mean of the last 5 steps ({after})", "", "per micro-batch",
            statistics.fmean(broken["losses"][-5:]), "global batch", statistics.fmean(fixed["losses"][-5:])),
    ]  # fmt: skip


def table(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [
        f"debug MoE specialized by kind, {s['steps']} steps of 2 micro-batches (one per kind) x {s['rows']} x "
        f"{s['seq_len']} tokens, router_aux_loss_coef {s['coef']:g}, lr {s['lr']:g}"
    ]
    for scope in SCOPES:
        run = results["runs"][scope]
        layers = range(len(run["load"]))
        share = " ".join(f"{_mean([kind[layer] for kind in run['kind_share']]):.3f}" for layer in layers)
        load = " ".join(f"{v:.3f}" for v in run["load"])
        lines += [
            f"{scope}: loss {run['losses'][0]:.3f} -> {run['losses'][-1]:.3f}, logged load-balancing loss "
            f"{run['aux_loss'][0]:.4f} -> {run['aux_loss'][-1]:.4f}, {run['seconds']:.1f} s",
            f"  per layer: kind share {share} | load {load}",
        ]
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=20, help="training steps per form")
    p.add_argument("--rows", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=64)
    # 100 x transformers' default weight, so that a run of 20 CPU steps shows the pull of each form.
    p.add_argument("--coef", type=float, default=0.1, help="router_aux_loss_coef of both runs")
    p.add_argument("--gap", type=float, default=2.0, help="logits between a kind's half of the experts and the other's")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)


def main(argv: list[str] | None = None) -> int:
    return harness.main("moe_balance", argv, doc=__doc__, add_args=add_args, measure=measure, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
