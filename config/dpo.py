"""The [dpo] section (dpo.py), in a file of its own beside config/sections.py, whose JobConfig holds it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from config.parts import optional_part

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "sft")  # TRL's names (dpo.py); sft: the NLL of the chosen


@dataclass
class Dpo:
    """Direct preference optimization on preference pairs (dpo.py), as Llama 3's chat models were aligned; TRL's key names. torchtitan has none."""

    enable: bool = optional_part("dpo.py", False)
    """Train on data.path's preference pairs ({prompt, chosen, rejected}: TRL's formats) with the DPO loss instead of the next-token loss."""
    beta: float = 0.1
    """How far the policy may move from the reference: the rewards are beta x the log-probability ratios."""
    loss_type: list[str] = field(default_factory=lambda: ["sigmoid"])
    """The losses, summed with loss_weights: sigmoid (DPO), ipo, hinge, robust, sft (the NLL of the chosen replies)."""
    loss_weights: list[float] = field(default_factory=list)
    """One weight per loss_type; empty: 1 each. Llama 3: loss_type = ["sigmoid", "sft"], loss_weights = [1.0, 0.2]."""
    label_smoothing: float = 0.0
    """The probability that a pair's preference is wrong, in [0, 0.5): the robust loss's (robust DPO)."""
    mask_format_tokens: bool = True
    """Count only the replies' own text, not the chat format's tokens around it (the end of turn, headers): Llama 3's change (docs/failures.md #8)."""
    reference: Literal["precomputed", "live"] = "precomputed"
    """The reference model's log-probabilities: precomputed once before step 1 from the initial weights and stored beside the prepared data (training holds one model), or live: a frozen copy of the initial weights, sharded like the policy, scores each micro-batch (no gradients, no optimizer state, not in checkpoints)."""

    def problems(
        self, *, chat: bool, attn_mask_type: str, mixture: bool, pp: int, cp: int, z_loss_weight: float
    ) -> list[str]:
        """What DPO needs of the rest of the config: chat data of its own, and no pipeline or context parallel yet."""
        if not self.enable:
            return []
        p = []
        if unknown := [t for t in self.loss_type if t not in DPO_LOSS_TYPES]:
            p.append(f"dpo.loss_type: unknown {', '.join(unknown)}; choose from {', '.join(DPO_LOSS_TYPES)}")
        if not self.loss_type or self.loss_type == ["sft"]:
            p.append('dpo.loss_type: name a preference loss (e.g. ["sigmoid"], Llama 3\'s ["sigmoid", "sft"])')
        if self.loss_weights and len(self.loss_weights) != len(self.loss_type):
            p.append(
                f"dpo.loss_weights: {len(self.loss_weights)} weights for {len(self.loss_type)} dpo.loss_type entries; "
                "give one per loss type, or none (1 each)"
            )
        if self.beta <= 0:
            p.append(f"dpo.beta: must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            p.append(f"dpo.label_smoothing: must lie in [0, 0.5), got {self.label_smoothing}")
        elif self.label_smoothing and "robust" not in self.loss_type:
            p.append(
                'dpo.label_smoothing: only the robust loss uses it (as TRL\'s); add "robust" to dpo.loss_type, or set 0'
            )
        if not chat:
            p.append("dpo.enable: preference pairs are rendered with the chat template; set data.chat = true")
        if attn_mask_type != "block_causal":
            p.append(
                "dpo.enable: a pair's rejected reply would attend to its chosen one in the same window under "
                'model.attn_mask_type = "causal"; set it to "block_causal"'
            )
        if mixture:
            p.append("data.mixture: preference pairs are trained on alone (dpo.enable); set data.path instead")
        if pp > 1:
            p.append(
                "dpo.enable: not under pipeline parallel yet (its schedules carry one loss, not a pair's "
                "log-probabilities); set parallelism.pipeline_parallel_degree = 1 and shard with FSDP and TP"
            )
        if cp > 1:
            p.append(
                "dpo.enable: not under context parallel yet (each rank would hold part of every reply); set "
                "parallelism.context_parallel_degree = 1"
            )
        if z_loss_weight > 0:
            p.append("training.z_loss_weight: not added to the DPO loss; set it to 0 for a DPO run")
        return p
