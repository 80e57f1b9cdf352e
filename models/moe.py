"""Load balancing of a mixture of experts, what every MoE family shares (models/qwen3_moe/ calls it): an auxiliary
loss over the global batch, and DeepSeek V3's auxiliary-loss-free expert bias. A family's MoE block holds one
`LoadBalance` in training and calls it twice: its `expert_bias` on the router's choice, and on the block's output;
a run holds one `Balancer`, train.py's work after each step, which also gives the metrics the step's routing (with
both techniques off too). Deleting this file deletes all three.

The load-balancing loss (Switch Transformer; transformers' `load_balancing_loss_func` and `router_aux_loss_coef`):
per MoE layer

    LBL = num_experts x sum_e f_e x P_e      f_e: the fraction of tokens that picked expert e among their top_k
                                             (summing to top_k: transformers' normalization; Megatron divides by it),
                                             P_e: the mean router probability of e over the same tokens,

minimal (top_k) when both are uniform; the training loss gains router_aux_loss_coef x the mean of LBL over the MoE
layers. transformers pools every layer's tokens into one f and one P, as if expert e of each layer were one expert,
so that one layer's overloaded expert hides behind another's idle one of the same number; here each layer balances
its own, and a model of one layer gets transformers' value exactly (tests/test_moe_balance.py).

Over what f is counted is the point (docs/failures.md #7). Per micro-batch of one rank ("microbatch" scope), as
most code does, every few thousand tokens must spread evenly over the experts, and an expert cannot specialize in
what one micro-batch holds (a language, code). The default, "global_batch", counts f over a whole global batch: every
rank's micro-batches, summed by one all_reduce of each block's counts per expert after the step. The step's
micro-batch k runs its backward before micro-batch k + 1's forward, so no micro-batch's gradient can have the f of
its own step (exact counts would need another forward); Megatron's global_aux_loss gives micro-batch k the counts
of micro-batches 1..k over the ranks, which makes the gradient depend on how the layout cuts the global batch into
waves of micro-batches (one process of 4 micro-batches and 2 ranks of 2 train apart: docs/benchmarks.md, #7). Here
every micro-batch's gradient takes f of the previous step's global batch: the same in every layout, never a partial
batch's, one step late (the router moves by one optimizer step in between; the first step has no such gradient, and
the Balancer checkpoints `load` so that a resumed run goes on with it). The logged value is the step's own: its
counts and probabilities summed over every micro-batch and rank.

How the loss reaches the gradients without leaving the block: the block's output passes through `_Attach`, the
identity in forward, whose backward adds the loss's gradient to the router probabilities, d(LBL)/d(P_e) being a
constant per expert (Megatron's MoEAuxLossAutoScaler does the same). Nothing is returned beside the output, so
pipeline stages, activation checkpointing and compile see a plain block, and the forward runs no collective. Each
rank's gradient is its share as loss.py scales the cross-entropy's: its forward's mean over its tokens, divided by
the pieces a data-parallel rank's step is cut into (`pieces_per_step`: gradient accumulation x pipeline
micro-batches x the TP ranks that split each sequence at the experts, whose router gradients add up); FSDP's mean
over the data-parallel ranks makes it the global batch's.

How the statistics outlive a forward: the backward of `_Attach` also returns this forward's counts and
probability sums as the gradient of `stats`, a leaf the block holds, and autograd adds them into `stats.grad`
exactly once per backward: a forward that activation checkpointing recomputes, or a pipeline schedule that runs
several micro-batches' forwards before their backwards, counts each micro-batch once (the forward itself writes
nothing). The `Balancer` reads `stats.grad` after the step, then clears it.

Auxiliary-loss-free balancing (DeepSeek V3, torchtitan's `load_balance_coeff`): a per-expert bias added to the
router's scores for the top-k choice only (the routing weights stay the unbiased probabilities), moved after each
step by coeff x sign(mean load - load) from the global step's counts, the moves centered to sum to 0 (torchtitan
0.2.2's rule). It is the `expert_bias` buffer, in the checkpoint (torchtitan names it layers.N.moe.expert_bias; here
layers.N.moe.balance.expert_bias). transformers' Qwen3MoeForCausalLM has no such bias: a model trained with it is
not exported to a Hugging Face folder (config refuses checkpoint.last_save_in_hf).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from errors import warn

AuxLossScope = Literal["global_batch", "microbatch"]


@dataclass(frozen=True)
class MoEBalance:
    """How an MoE model balances its experts in training (config's [model.moe]; the module docstring). Both off, a
    run still counts its routing for the metrics; a model built without one (a flavor, a Hugging Face folder) has no
    LoadBalance at all."""

    router_aux_loss_coef: float = 0.0  # the load-balancing loss's weight; 0: none
    aux_loss_scope: AuxLossScope = "global_batch"  # over what f is counted
    load_balance_coeff: float = 0.0  # the expert bias's step after each optimizer step; 0: no bias


class _Stats(NamedTuple):
    """Where each statistic lies in a block's `stats` vector (float64: counts stay exact up to 2^53)."""

    experts: int

    @property
    def size(self) -> int:
        return 2 * self.experts + 3

    def counts(self, v: torch.Tensor) -> torch.Tensor:  # (token, choice) pairs per expert on this rank
        return v[..., : self.experts]

    def tokens(self, v: torch.Tensor) -> torch.Tensor:  # this rank's tokens
        return v[..., self.experts]

    def probs(self, v: torch.Tensor) -> torch.Tensor:  # router probabilities summed over this rank's tokens
        return v[..., self.experts + 1 : 2 * self.experts + 1]

    def own_loss(self, v: torch.Tensor) -> torch.Tensor:  # each forward's LBL over its own tokens, summed
        return v[..., 2 * self.experts + 1]

    def forwards(self, v: torch.Tensor) -> torch.Tensor:  # forwards (micro-batches) counted
        return v[..., 2 * self.experts + 2]

    def load(self, v: torch.Tensor) -> torch.Tensor:  # counts per expert, then tokens
        return v[..., : self.experts + 1]


def lbl(counts: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor | float) -> torch.Tensor:
    """num_experts x sum_e f_e x P_e from counts per expert (..., experts), probabilities summed per expert (...,
    experts) and the tokens they are over (transformers' load_balancing_loss_func of one layer)."""
    return counts.shape[-1] * (counts / tokens * probs / tokens).sum(dim=-1)


class LoadBalance(nn.Module):
    """One MoE block's balancing: its expert bias, and the load-balancing loss's gradient on the block's output (the
    module docstring). Statistics are kept once a `Balancer` tracks the block."""

    def __init__(self, num_experts: int, settings: MoEBalance, *, moe_layers: int):
        super().__init__()
        self.settings, self.moe_layers, self.layout = settings, moe_layers, _Stats(num_experts)
        self.pieces_per_step = 1  # of a data-parallel rank's step (Balancer.of)
        bias = torch.zeros(num_experts) if settings.load_balance_coeff > 0 else None
        self.register_buffer("expert_bias", bias, persistent=True)  # added to the scores for the choice only
        # The step's statistics, in the gradient of this leaf (requires_grad once tracked); `load`: the counts per
        # expert and the tokens of the previous step's global batch, the "global_batch" f (checkpointed by the
        # Balancer, so not a part of the model's state).
        self.register_buffer("stats", torch.zeros(self.layout.size, dtype=torch.float64), persistent=False)
        self.register_buffer("load", torch.zeros(num_experts + 1, dtype=torch.float64), persistent=False)

    def forward(self, out: torch.Tensor, probs: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The block's output, unchanged; in backward, the load-balancing loss's gradient on `probs` (tokens, experts)
        and this forward's statistics into `stats.grad`. tokens_per_expert (experts,): the (token, choice) pairs of
        each expert. Nothing under no_grad (scoring, generation): no backward, nothing to balance or count."""
        if not torch.is_grad_enabled():
            return out
        tokens = probs.shape[0]
        counts = tokens_per_expert.to(torch.float64)
        prob_sums = probs.detach().sum(dim=0).to(torch.float64)
        own = lbl(counts, prob_sums, tokens)[None]
        stats = torch.cat([counts, counts.new_full((1,), tokens), prob_sums, own, counts.new_ones(1)])
        probs_grad = None
        if (coef := self.settings.router_aux_loss_coef) > 0:
            if self.settings.aux_loss_scope == "global_batch":  # the previous step's; zeros before the first
                f = self.load[:-1] / self.load[-1].clamp(min=1)
            else:
                f = counts / tokens
            # d(coef x mean over the layers of LBL) / d(probability of e) for one token, as this rank's share (loss.py)
            share = coef * self.layout.experts / self.moe_layers / (tokens * self.pieces_per_step)
            probs_grad = (share * f).to(probs.dtype)
        return _Attach.apply(out, probs, probs_grad, self.stats, stats)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """A fresh start (no bias, no statistics): after the meta device's to_empty, before a checkpoint loads."""
        for buffer in (self.expert_bias, self.stats, self.load):
            if buffer is not None:
                buffer.zero_()

    def track(self, *, pieces_per_step: int) -> None:
        """Keep this block's statistics (the step's, for its Balancer)."""
        self.pieces_per_step = pieces_per_step
        self.stats = self.stats.detach().zero_().requires_grad_()  # a fresh leaf on the block's device

    def taken(self) -> torch.Tensor:
        """The step's statistics (zeros where no backward ran), cleared for the next step's."""
        grad = self.stats.grad
        taken = grad.detach().clone() if grad is not None else torch.zeros_like(self.stats, requires_grad=False)
        self.stats.grad = None
        return taken

    @torch.no_grad()
    def after_step(self, load: torch.Tensor) -> None:
        """The global batch's counts per expert and tokens of the step just taken (`load`): the next step's f, and the
        expert bias moved by torchtitan 0.2.2's rule."""
        self.load.copy_(load)
        if self.expert_bias is not None:
            counts = load[:-1]
            step = self.settings.load_balance_coeff * torch.sign(counts.mean() - counts)
            self.expert_bias.add_((step - step.mean()).to(self.expert_bias.dtype))


class _Attach(torch.autograd.Function):
    """out -> out; in backward also the load-balancing loss's gradient for `probs` and the statistics for `sink`."""

    @staticmethod
    def forward(
        ctx: Any,
        out: torch.Tensor,
        probs: torch.Tensor,
        probs_grad: torch.Tensor | None,
        sink: torch.Tensor,
        stats: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(probs_grad, stats)
        ctx.probs_shape = probs.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        probs_grad, stats = ctx.saved_tensors
        probs = probs_grad.expand(ctx.probs_shape) if probs_grad is not None else None
        return grad, probs, None, stats, None


# ------------------------------------------------------------------------ a run's


class RoutingSummary(NamedTuple):
    """What the metrics log of a step's routing."""

    aux_loss: float  # the load-balancing loss as the run's scope counts it, mean over the MoE layers (unweighted)
    load: dict[int, float]  # MoE layer -> max / mean (token, choice) pairs per expert over the global batch


class Balancer:
    """A run's side of its blocks' balancing, train.py's work after each step (before the log, which reads it): the
    step's statistics summed over all ranks (one all_reduce of a row per layer: each rank adds its own tokens', a
    pipeline stage its own layers'), the next step's f and the expert biases set from the global counts, the blocks'
    statistics cleared. Checkpointed (Stateful): the last step's counts, which the next step's gradient uses."""

    def __init__(
        self,
        blocks: dict[int, LoadBalance],
        *,
        settings: MoEBalance,
        experts: int,
        n_layers: int,
        device: torch.device,
    ):
        self.blocks, self.settings, self.layout = blocks, settings, _Stats(experts)
        self.rows = torch.zeros(n_layers, self.layout.size, dtype=torch.float64, device=device)  # the last step's

    @classmethod
    def of(cls, model: nn.Module, args: Any, *, pieces_per_step: int) -> Balancer | None:
        """The Balancer of `model` (this rank's blocks: a pipeline stage holds some) of shape `args`, None unless it
        is a mixture of experts with [model.moe]'s settings. pieces_per_step: the forwards whose tokens make a data-parallel
        rank's step (gradient accumulation x pipeline micro-batches) x the TP ranks that split each sequence at the
        experts (sequence parallel; their router gradients add up)."""
        settings: MoEBalance | None = getattr(args, "balance", None)
        if settings is None:
            return None
        if settings.aux_loss_scope == "microbatch" and settings.router_aux_loss_coef > 0:
            warn(
                'model.moe.aux_loss_scope = "microbatch": the load-balancing loss spreads each micro-batch of each '
                "rank over all experts, which keeps them from specializing (docs/failures.md #7)"
            )
        blocks = {
            int(name): m for name, layer in model.layers.items() for m in layer.modules() if isinstance(m, LoadBalance)
        }
        for block in blocks.values():
            block.track(pieces_per_step=pieces_per_step)
        device = next(model.parameters()).device
        return cls(blocks, settings=settings, experts=args.num_experts, n_layers=args.n_layers, device=device)

    def __call__(self, step: int, result: object) -> bool:
        """After step `step`: its statistics over all ranks (one all_reduce), each block's next f and bias."""
        self.rows.zero_()
        for layer, block in self.blocks.items():
            self.rows[layer] = block.taken()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.rows)
        for layer, block in self.blocks.items():
            block.after_step(self.layout.load(self.rows[layer]))
        return False

    def summary(self) -> RoutingSummary:
        """The last step's routing over its global batch, read on the host."""
        layout, rows = self.layout, self.rows
        counts, tokens = layout.counts(rows), layout.tokens(rows)
        if self.settings.aux_loss_scope == "global_batch":
            loss = lbl(counts, layout.probs(rows), tokens[:, None])
        else:  # the mean over the ranks' forwards of each one's own LBL
            loss = layout.own_loss(rows) / layout.forwards(rows)
        load = counts.max(dim=1).values / counts.mean(dim=1)
        table = torch.stack([tokens, loss, load], dim=1).tolist()  # the one host read
        moe = {layer: (loss, load) for layer, (tokens, loss, load) in enumerate(table) if tokens > 0}  # (else dense)
        aux_loss = sum(loss for loss, _ in moe.values()) / len(moe) if moe else float("nan")  # nan: no step yet
        return RoutingSummary(aux_loss=aux_loss, load={layer: load for layer, (_, load) in moe.items()})

    # Stateful (the run's checkpoint): the counts the next step's f is made of, per layer, whatever the layout.

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"layers.{layer}.load": block.load for layer, block in self.blocks.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for layer, block in self.blocks.items():
            block.load.copy_(state[f"layers.{layer}.load"])
