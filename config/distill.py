"""The [distill] section (distill.py), in a file of its own beside config/sections.py, whose JobConfig holds it."""

from __future__ import annotations

from dataclasses import dataclass, field

from config.parts import optional_part


@dataclass
class Distill:
    """Knowledge distillation from a frozen teacher in the same job (distill.py), as Llama 3.2's 1B and 3B were trained; the loss keys are TRL's (GKD) and torchtune's (kd_ratio). torchtitan has none."""

    enable: bool = optional_part("distill.py", False)
    """Train the model (the student) on the teacher's next-token distributions as well as on the labels."""
    teacher_path: str | None = field(default=None, metadata={"input_path": True})
    """The teacher's weights: a checkpoint step folder of this repo (its config.toml beside it names the model) or a Hugging Face folder (config.json, *.safetensors) of any family models/ has."""
    teacher_name: str = ""
    """The teacher's model.name where its folder does not say (a step folder without config.toml); empty: what the folder says, else model.name."""
    teacher_flavor: str = ""
    """The teacher's model.flavor where its folder does not say; empty: what the folder says, else model.flavor. A Hugging Face folder gives its shape in config.json."""
    beta: float = 0.0
    """TRL's generalized Jensen-Shannon beta: 0 the forward KL(teacher || student) (torchtune's, Llama 3.2's), 1 the reverse KL(student || teacher), between the JSD with the mixture beta teacher + (1 - beta) student."""
    temperature: float = 1.0
    """Both models' logits are divided by it before the softmax (TRL's; the loss is not rescaled by temperature^2)."""
    kd_ratio: float = 0.5
    """The loss is (1 - kd_ratio) x cross-entropy + kd_ratio x the divergence (torchtune's kd_ratio); 1: the teacher alone."""

    def problems(self, *, pp: int, dpo: bool = False) -> list[str]:
        """What distillation needs of its own keys and of the rest of the config."""
        if not self.enable:
            return []
        p = []
        if self.teacher_path is None:
            p.append(
                "distill.teacher_path: the teacher's weights are needed; point it at a checkpoint step folder "
                "(outputs/debug/checkpoint/step-100) or a Hugging Face folder"
            )
        if not 0 <= self.beta <= 1:
            p.append(f"distill.beta: must lie in [0, 1] (0 forward KL, 1 reverse KL), got {self.beta}")
        if self.temperature <= 0:
            p.append(f"distill.temperature: must be > 0, got {self.temperature}")
        if not 0 <= self.kd_ratio <= 1:
            p.append(f"distill.kd_ratio: must lie in [0, 1], got {self.kd_ratio}")
        if pp > 1:
            p.append(
                "distill.enable: not under pipeline parallel yet (the teacher's last hidden states would have to reach "
                "the student's last stage micro-batch by micro-batch); set parallelism.pipeline_parallel_degree = 1 "
                "and shard with FSDP, TP and CP"
            )
        if dpo:
            p.append("distill.enable: a DPO run has a reference model, not a teacher; set one of them to false")
        return p
