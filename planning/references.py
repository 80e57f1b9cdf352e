"""torchtitan's published memory peaks and the setups that reproduce them
(`python -m planning.estimate_memory --references`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from planning.flags import job
from planning.job import GPU, Job, Machine

GiB = 2**30


@dataclass(frozen=True)
class Reference:
    """A published peak and the setup that reproduces it (planning.flags.job's GPUs and flags, on `TT_MACHINE`)."""

    name: str
    keys: dict[str, Any]
    published: dict[str, float]  # label -> GiB
    note: str

    @property
    def job(self) -> Job:
        return job(machine=TT_MACHINE, **self.keys)


# torchtitan docs/performance.md (benchmarks/llama3_h100_202412_torchtitan.md): H100 SXM with
# 96 GB HBM2e, torch nightly of 2024-12-23, eager nn.RMSNorm (composite then), `del pred` before
# backward; "Memory(GiB)" is torch.cuda.max_memory_reserved, without the CUDA context / NCCL, the
# maximum over all GPUs.
TT_MACHINE: Machine = dataclasses.replace(GPU, rmsnorm="composite")
_TT = dict(loss_chunk_tokens=0)  # and its loss: all logits at once
# Table 5's 405B: FSDP 8 x TP 8 x PP 8, local batch 32 in torchtitan's default micro-batches then (as many as
# stages: 8 of 4 sequences), full AC.
_TT_405B_PP = dict(
    flavor="llama3_405b",
    ngpu=512,
    tp=8,
    pp=8,
    local_batch_size=32,
    pp_microbatch_size=4,
    seq_len=8192,
    ac="full",
    **_TT,
)
REFERENCES: tuple[Reference, ...] = (
    Reference(
        "8B, 8 GPUs, FSDP, bs 2, SAC op",
        dict(flavor="llama3_8b", ngpu=8, local_batch_size=2, seq_len=8192, ac="selective-op", **_TT),
        {"FSDP": 82.4, "FSDP + compile": 77.0},
        "torchtitan Table 1 (docs/performance.md)",
    ),
    Reference(
        "8B, 128 GPUs, FSDP, bs 2, SAC op",
        dict(flavor="llama3_8b", ngpu=128, local_batch_size=2, seq_len=8192, ac="selective-op", **_TT),
        {"FSDP": 67.0, "FSDP + compile": 62.0},
        "torchtitan Table 3: same job, state sharded 16x thinner",
    ),
    Reference(
        "70B, 64 GPUs, FSDP8 x TP8, bs 8, full AC",
        dict(flavor="llama3_70b", ngpu=64, tp=8, local_batch_size=8, seq_len=8192, ac="full", **_TT),
        {},
        "torchtitan's llama3_70b.toml preset (64 GPUs); no published peak",
    ),
    Reference(
        "70B, 256 GPUs, FSDP32 x TP8, bs 16, full AC",
        dict(flavor="llama3_70b", ngpu=256, tp=8, local_batch_size=16, seq_len=8192, ac="full", **_TT),
        {"2D + compile + float8": 71.9, "+ async TP": 67.6},
        "torchtitan Table 4; compile + float8 not modelled (bf16 estimate)",
    ),
    Reference(
        "405B, 128 GPUs, FSDP16 x TP8, bs 2, full AC",
        dict(flavor="llama3_405b", ngpu=128, tp=8, local_batch_size=2, seq_len=8192, ac="full", **_TT),
        {},
        "torchtitan's llama3_405b.toml preset (128 H100; no published peak)",
    ),
    Reference(
        "405B, 512 GPUs, FSDP8 x TP8 x PP8 1F1B, bs 32",
        dict(pp_schedule="1F1B", **_TT_405B_PP),
        {"3D + compile + float8 + async TP": 82.5},
        "torchtitan Table 5: 8 micro-batches of 4 (its default then: as many as stages); not modelled: compile, float8",
    ),
    Reference(
        "405B, 512 GPUs, FSDP8 x TP8 x PP8 Interleaved1F1B",
        dict(pp_schedule="Interleaved1F1B", **_TT_405B_PP),
        {"3D + compile + float8 + async TP": 72.7},
        "torchtitan Table 5, 2 stages per rank (its split then differed slightly from stage_layers')",
    ),
)
