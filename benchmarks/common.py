"""What the multi-process benchmarks share: starting themselves under torchrun, and the
process group they measure in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]


def launch_self(module: str, *, nproc: int, argv: list[str]) -> int:
    """Not under torchrun yet: run `torchrun --nproc_per_node=nproc -m module argv...` from the repo root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module, *argv]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


def init_process_group() -> torch.device:
    """NCCL on this rank's GPU where there is one, gloo on CPU; returns the device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


@torch.no_grad()
def unit_scale_init_(model: nn.Module, *, seed: int, gain_noise: float = 0.1) -> None:
    """Weights that give O(1) activations, logits and gradients (a transformers model's names).

    transformers' init (std 0.02) leaves the logits nearly uniform and the gradients tiny, where
    a wrong RoPE, norm or gradient would hardly show above float32 noise.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.ndim == 1:  # RMSNorm gains
            p.copy_(1 + gain_noise * noise)
        elif "embed" in name:
            p.copy_(noise)
        else:  # (out, in) projections: unit variance out for unit variance in
            p.copy_(noise * p.shape[1] ** -0.5)
