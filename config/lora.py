"""The [lora] section (lora.py), in a file of its own beside config/sections.py, whose JobConfig holds it."""

from __future__ import annotations

from dataclasses import dataclass, field

from config.parts import optional_part


@dataclass
class Lora:
    """Low-rank adapters on a frozen base (lora.py), saved in PEFT's format by scripts/convert_hf.py; the keys are PEFT's (LoraConfig). torchtitan 0.2.2 has none."""

    enable: bool = optional_part("lora.py", False)
    """Train adapters W + (lora_alpha / r) B A on the target linears and freeze every other weight (no gradient, no optimizer state, not in checkpoints)."""
    r: int = 8
    """The adapters' rank."""
    lora_alpha: float = 16.0
    """The adapters' scale is lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)."""
    lora_dropout: float = 0.0
    """Dropout on each adapter's input (PEFT's); 0: none."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """The linears that get adapters, by the family's Hugging Face module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj); ["all-linear"]: every linear of every block (PEFT's all-linear: not the output head)."""
    use_rslora: bool = False
    """Rank-stabilized LoRA: scale lora_alpha / sqrt(r) instead of lora_alpha / r."""
    adapter_path: str | None = field(default=None, metadata={"input_path": True})
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) the adapters start from; unset: A as PEFT initializes it, B zero. Its r, lora_alpha, use_rslora and target_modules are the run's."""

    def problems(self, *, optimizer: str, seed_checkpoint: bool, last_save_in_hf: bool = False) -> list[str]:
        """What LoRA needs of its own keys and of the rest of the config."""
        if not self.enable:
            return []
        p = []
        if self.r < 1:
            p.append(f"lora.r: the adapters' rank must be >= 1, got {self.r}")
        if not 0 <= self.lora_dropout < 1:
            p.append(f"lora.lora_dropout: must lie in [0, 1), got {self.lora_dropout}")
        if not self.target_modules:
            p.append('lora.target_modules: empty; name the linears (["q_proj", "v_proj"]) or ["all-linear"]')
        if "all-linear" in self.target_modules and len(self.target_modules) > 1:
            p.append('lora.target_modules: "all-linear" stands alone; give it or a list of module names')
        if seed_checkpoint:
            p.append(
                "checkpoint.create_seed_checkpoint: a seed holds a model's initial weights, and a LoRA run's base comes "
                "from checkpoint.initial_load_path; create the seed with lora.enable = false"
            )
        if last_save_in_hf:
            p.append(
                "checkpoint.last_save_in_hf: a LoRA run's steps hold its adapters; set it to false and write them after "
                "the run with `python scripts/convert_hf.py to-peft STEP OUT` (PEFT's folder) or `to-hf STEP OUT` "
                "(merged into the base)"
            )
        if optimizer == "Muon":
            p.append('optimizer.name: Muon orthogonalizes whole weight matrices, not adapters; use "AdamW" with LoRA')
        return p
