"""What the multi-process benchmarks share: starting themselves under torchrun, and the
process group they measure in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

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
