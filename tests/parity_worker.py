"""Loss parity of parallel layouts against one process, on the same weights and global batch.

    python tests/parity_worker.py RUN_DIR --reference
    torchrun --nproc_per_node=N tests/parity_worker.py RUN_DIR LAYOUT [LAYOUT ...]

RUN_DIR holds `reference.pt` from `write_reference` (the first command; initial full state dict, token batch,
the single-process losses and final parameters). For each LAYOUT (a key of LAYOUTS with
the world size N) the worker builds the model on the meta device, parallelizes it, loads the
reference weights, trains STEPS AdamW steps and compares; rank 0 writes RUN_DIR/LAYOUT.json.

The module is also imported by tests/test_parallelisms.py for the shared single-process
pieces (tiny model, train loop). Every layout and the reference step with train.py's own
`train_step` and optimizer, so what is compared is what trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

import models
from config import (
    ActivationCheckpoint,
    Compile,
    Distill,
    Dpo,
    JobConfig,
    Lora,
    Model,
    Optimizer,
    Parallelism,
    QuantizeLinearFloat8,
    Training,
)
from data.chat import IGNORE_INDEX
from data.loader import Batch
from data.preference import Pairs
from distill import DistillLoss
from distributed import mean_over_loss_ranks
from dpo import PreferenceLoss
from forward import ForwardBackward
from lora import apply_lora
from loss import Loss, build_loss_fn
from models import with_seq_len
from models.llama3 import FLAVORS, ModelArgs
from models.olmo2 import FAMILY as OLMO2
from models.qwen3 import FAMILY as QWEN3
from models.qwen3_moe import FAMILY as QWEN3_MOE
from muon import build_muon
from optimizer import build_optimizer
from parallelisms.async_tp import SummedMatmuls
from parallelisms.cp import ContextParallel, context_parallel
from parallelisms.float8 import apply_float8, precompute_scales_after_each_step
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import build_model, init_model
from parallelisms.pp import Pipeline
from tests.instruments import CollectiveLog, count_host_reads, mesh_group_dims, observe_ops
from train import train_step

TINY: ModelArgs = with_seq_len(
    dataclasses.replace(FLAVORS["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128), 32
)
# The second family on the same layouts: QK-norm, and heads wider than dim / n_heads (4 x 32 = 2 x dim).
TINY_QWEN3 = with_seq_len(
    dataclasses.replace(
        QWEN3.flavors["debugmodel"],
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        hidden_dim=192,
        vocab_size=128,
    ),
    32,
)
# The third: post-norm blocks and a QK-norm over the whole q (k) projection, split over TP ranks.
TINY_OLMO2 = with_seq_len(
    dataclasses.replace(
        OLMO2.flavors["debugmodel"],
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=192,
        vocab_size=128,
    ),
    32,
)
# The fourth: a mixture of experts, 4 experts of 2 per token, what expert parallel splits.
TINY_QWEN3_MOE = with_seq_len(
    dataclasses.replace(
        QWEN3_MOE.flavors["debugmodel"],
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        moe_hidden_dim=32,
        num_experts=4,
        top_k=2,
        vocab_size=128,
    ),
    32,
)
# Every family's tiny shape, one row each: the reference, the layouts (Layout.family) and the dry-run tests read it.
TINY_SHAPES = {"llama3": TINY, "qwen3": TINY_QWEN3, "olmo2": TINY_OLMO2, "qwen3_moe": TINY_QWEN3_MOE}
# Each family's all-reduces per block and direction under its TP plan, beyond sequence parallel's all-gathers and
# reduce-scatters: OLMo 2's QK-norms over column-split projections all-reduce a (bs, seqlen, 1) float32 statistic
# (models/olmo2/plans.py). The TP count (tests/test_parallelisms.py) and the async-TP fusion count read it.
TP_STATISTICS = {
    "llama3": 0,
    "qwen3": 0,
    "olmo2": 2,
    "qwen3_moe": 0,
}
# The sequence-parallel all-gathers per block forward (each mirrored by a reduce-scatter, and both again in backward)
# of the families whose blocks have other than two, before the attention and before the MLP: Qwen3 MoE's MoE none
# (each TP rank routes its own tokens to expert parallel's ranks, models/qwen3_moe/plans.py).
TP_GATHERS = {"qwen3_moe": 1}
STEPS = 5
GLOBAL_BATCH = 4
SEQ_LEN = 32
LR = 1e-3
# AdamW's epsilon, above the float32 rounding of a gradient summed in another order. An element whose gradient is near
# epsilon moves by about lr * g / (|g| + eps) on the first step, so at torch's 1e-8 a rounding difference of 6e-10 in a
# gradient of 1e-8 (OLMo 2's TP 2: every gradient within 5e-8 of one process') moved a weight 1.4e-5, above TOL. At
# 1e-6 the same difference moves it 6e-7; the steps of gradients far above epsilon do not change.
ADAM_EPS = 1e-6
# Below the tiny model's gradient norm (about 1-2 at init), so clipping really scales the gradients.
MAX_NORM = 0.5
Z_LOSS_WEIGHT = 1e-2  # the tiny model's z-loss is about 24 (logsumexp near log 128): 0.24 of its loss of about 5
TRAINING = Training(seq_len=SEQ_LEN, mixed_precision_param="float32")
# float8 linears as a CPU runs them (high-precision matmuls on float8-cast operands), tensorwise, under FSDP the
# weights all-gathered in float8; Layout.float8 = "precompute" computes their scales once after each optimizer step.
FLOAT8 = QuantizeLinearFloat8(emulate=True, enable_fsdp_float8_all_gather=True)


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    loss_parallel: bool = True
    ac: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: bool = False
    reshard_after_forward: str = "default"
    block_causal: bool = False  # attention within the documents of random_segments()
    loss_chunk_tokens: int = 0  # training.loss_chunk_tokens (each rank scores 64 or 128 tokens)
    pp: int = 1
    schedule: str = "1F1B"  # parallelism.pipeline_parallel_schedule (micro-batches of one sequence)
    family: str = "llama3"  # [model] name: its row of TINY_SHAPES
    z_loss: bool = False  # training.z_loss_weight = Z_LOSS_WEIGHT
    cp: int = 1  # parallelism.context_parallel_degree (load-balanced: each rank holds 2 chunks of SEQ_LEN / 2cp)
    ep: int = 1  # parallelism.expert_parallel_degree (family "qwen3_moe")
    cp_load_balance: bool = True  # parallelism.context_parallel_load_balancer "headtail", else "none"
    chat: bool = False  # chat_labels(): only some labels count, unevenly over rows (block_causal documents too)
    grad_accum: int = 1  # micro-batches per step: each rank's rows split into this many
    defer_reduce_scatter: bool = False  # parallelism.fsdp_defer_reduce_scatter
    # Async TP's own pass (parallelisms/async_tp.py SummedMatmuls) in the compile, without micro-pipeline TP (CUDA)
    summed_matmuls: bool = False
    # optimizer.name = "Muon" with this muon_orthogonalize ("matrix": the recipe's; "shard": each rank's own block)
    muon: str = ""
    # float8 linears (FLOAT8): "all_gather" (each all-gather scales its weights) or "precompute" (once after each step)
    float8: str = ""
    dpo: bool = False  # dpo.py's loss (DPO_SETTINGS) on the pairs of dpo_pairs(), documents kept apart
    dpo_live: bool = False  # its reference a second model in the layout (dpo.reference = "live"), not the table
    distill: bool = False  # distill.py's loss (DISTILL_SETTINGS) against a teacher of the family in this layout
    lora: bool = False  # lora.py's adapters (LORA_SETTINGS) on the frozen base; with dpo_live the base is the reference

    @property
    def float8_linear(self) -> QuantizeLinearFloat8 | None:
        """[quantize.linear.float8] of this layout; None without float8."""
        if not self.float8:
            return None
        return dataclasses.replace(FLOAT8, precompute_float8_dynamic_scale_for_fsdp=self.float8 == "precompute")

    @property
    def world_size(self) -> int:
        return math.prod((self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp))


FULL = ActivationCheckpoint(mode="full")
OP_SAC = ActivationCheckpoint(mode="selective", selective_ac_option="op")

LAYOUTS: dict[str, Layout] = {
    # 2 ranks
    "fsdp2": Layout(dp_shard=2),
    "fsdp2_full_ac_reshard_never": Layout(dp_shard=2, ac=FULL, reshard_after_forward="never"),
    # parallelism.fsdp_defer_reduce_scatter: unsharded gradients summed over the step's micro-batches, reduced once.
    "fsdp2_accum2_defer_rs": Layout(dp_shard=2, grad_accum=2, defer_reduce_scatter=True),
    "tp2": Layout(tp=2),
    "tp2_no_loss_parallel": Layout(tp=2, loss_parallel=False),
    "tp2_op_sac": Layout(tp=2, ac=OP_SAC),
    # Full AC around a compiled TP block (the big recipes' combination): PyTorch 2.13 cannot compile the checkpoint
    # with the block, so it stays eager around it (parallelisms/ac.py CheckpointedModule.compile; a block without TP
    # is compiled whole).
    "tp2_compile_full_ac": Layout(tp=2, ac=FULL, compile=True, summed_matmuls=True),
    "tp2_block_causal": Layout(tp=2, block_causal=True),
    "fsdp2_chunked_loss": Layout(dp_shard=2, loss_chunk_tokens=16),
    "tp2_chunked_loss": Layout(tp=2, loss_chunk_tokens=16),
    "tp2_no_loss_parallel_chunked_loss": Layout(tp=2, loss_parallel=False, loss_chunk_tokens=24),
    "tp2_chunked_loss_z_loss": Layout(tp=2, loss_chunk_tokens=16, z_loss=True),  # logsumexp on vocabulary shards
    # Pipelines of TINY's 2 blocks: 1 + 1 over two stages; interleaved: 4 stages, the first with the
    # embedding alone, the last with norm + output + loss alone.
    "pp2_1f1b": Layout(pp=2, loss_chunk_tokens=24),
    "pp2_1f1b_z_loss": Layout(pp=2, z_loss=True),
    "pp2_gpipe": Layout(pp=2, schedule="GPipe"),
    "pp2_interleaved_1f1b": Layout(pp=2, schedule="Interleaved1F1B"),
    "pp2_interleaved_zero_bubble": Layout(pp=2, schedule="InterleavedZeroBubble"),
    # 4 ranks
    "hsdp2x2_reshard_always": Layout(dp_replicate=2, dp_shard=2, reshard_after_forward="always"),
    # HSDP with gradient accumulation: the replicas' all-reduce once per step, on the last micro-batch (train.py).
    "hsdp2x1_tp2_accum2": Layout(dp_replicate=2, dp_shard=1, tp=2, grad_accum=2),
    "fsdp2_tp2": Layout(dp_shard=2, tp=2),
    "fsdp2_tp2_op_sac": Layout(dp_shard=2, tp=2, ac=OP_SAC),
    "hsdp2x1_tp2": Layout(dp_replicate=2, dp_shard=1, tp=2),
    "fsdp2_tp2_chunked_loss": Layout(dp_shard=2, tp=2, loss_chunk_tokens=16),
    "pp2_fsdp2": Layout(pp=2, dp_shard=2),
    "pp2_tp2": Layout(pp=2, tp=2),
    # Muon against one process's Muon (torch.optim.Muon's update): row shards, column shards, both, stages, replicas.
    "muon_fsdp2": Layout(dp_shard=2, muon="matrix"),
    "muon_tp2": Layout(tp=2, muon="matrix"),
    "muon_pp2": Layout(pp=2, muon="matrix"),
    "muon_fsdp2_tp2": Layout(dp_shard=2, tp=2, muon="matrix"),
    "muon_hsdp2x2": Layout(dp_replicate=2, dp_shard=2, muon="matrix"),
    "muon_pp2_fsdp2": Layout(pp=2, dp_shard=2, muon="matrix"),  # each stage's matrices within its shard group
    "muon_fsdp2_shard": Layout(dp_shard=2, muon="shard"),  # docs/failures.md #6 on purpose: a different optimizer
    # float8 linears (FLOAT8) under FSDP: AdamW exact; Muon's exchange on float8 weights; and compiled, one layout for
    # both (compile with Muon alone: 1.3e-4 when measured on 2026-11-28; one compile costs more than the rest here).
    "fsdp2_float8": Layout(dp_shard=2, float8="all_gather"),
    "muon_fsdp2_float8": Layout(dp_shard=2, muon="matrix", float8="precompute"),
    "muon_fsdp2_float8_compile": Layout(dp_shard=2, muon="matrix", float8="precompute", compile=True),
    # Qwen3 through the same code: its TP plan (QK-norm weights replicated over TP, 2-D under FSDP x TP), its
    # pipeline stages.
    "qwen3_fsdp2": Layout(dp_shard=2, family="qwen3"),
    "qwen3_pp2": Layout(pp=2, family="qwen3", loss_chunk_tokens=24),
    # OLMo 2 through the same code: FSDP, its TP plan (norms over column-split projections), its pipeline stages.
    "olmo2_fsdp2": Layout(dp_shard=2, family="olmo2"),
    "olmo2_tp2": Layout(tp=2, family="olmo2"),
    "olmo2_tp2_op_sac": Layout(tp=2, ac=OP_SAC, family="olmo2"),  # op SAC keeps the norms' all-reduced statistics
    "olmo2_fsdp2_tp2": Layout(dp_shard=2, tp=2, family="olmo2"),  # the split norms' weights sharded twice
    "olmo2_pp2": Layout(pp=2, family="olmo2"),
    # Compile on FSDP x TP: its named SAC linears, the documents' segments, TP + compile's first-block input (see
    # parallelisms.tp._wait_async_output). One compiled layout of 4 ranks, because one costs more than all the eager
    # layouts of its launch together, and OLMo 2's, the block with the most to compile: post-norms, the QK-norm's
    # statistic all-reduced by an autograd function, op SAC keeping it. (Qwen3's block is Llama's plus a per-head
    # norm; it was this layout until 2026-11-27.) The rest of compile is covered elsewhere: Llama's named SAC linears
    # and the plain causal mask in cp2_compile_op_sac, TP alone in tp2_compile_full_ac, FSDP alone in
    # configs/debug_compile.toml (tests/test_parallel_configs.py).
    "olmo2_fsdp2_tp2_compile_op_sac_block_causal": Layout(
        dp_shard=2, tp=2, ac=OP_SAC, compile=True, block_causal=True, family="olmo2"
    ),
}
# Context parallel (parallelisms/cp.py): FSDP shards over the CP ranks; on CPU, SDPA with a dense mask of the rank's
# queries x the window.
CP_LAYOUTS: dict[str, Layout] = {
    "cp2": Layout(cp=2),
    "cp2_block_causal": Layout(cp=2, block_causal=True, loss_chunk_tokens=16),
    "cp2_compile_op_sac": Layout(cp=2, ac=OP_SAC, compile=True),
    "cp2_full_ac": Layout(cp=2, ac=FULL),  # the recomputation gathers the keys and values again
    "cp2_op_sac": Layout(cp=2, ac=OP_SAC),  # op SAC keeps the gathered keys and values: no second all-gather
    "cp2_no_load_balance": Layout(cp=2, cp_load_balance=False),  # rank 0 the first half of each window, rank 1 the rest
    "cp4": Layout(cp=4),
    "fsdp2_cp2": Layout(dp_shard=2, cp=2),
    "cp2_tp2": Layout(cp=2, tp=2, block_causal=True),  # sequence parallel splits each CP rank's tokens
    "pp2_cp2": Layout(pp=2, cp=2),
    "hsdp2x1_cp2": Layout(dp_replicate=2, cp=2),  # FSDP over the CP ranks inside, replicas outside
    "qwen3_cp2": Layout(cp=2, family="qwen3"),  # the shared attention core, QK-norm before it
    "olmo2_cp2": Layout(cp=2, family="olmo2"),  # post-norm blocks around the same core
    "cp2_chat": Layout(cp=2, chat=True, block_causal=True),
    "muon_cp2": Layout(cp=2, muon="matrix"),  # FSDP shards over the CP ranks: Muon's group is theirs
}
# Chat data (data/chat.py): the loss is the mean over the global batch's counted labels, however unevenly the ranks,
# the pipeline's micro-batches or the loss chunks hold them.
CHAT_LAYOUTS: dict[str, Layout] = {
    "fsdp2_chat": Layout(dp_shard=2, chat=True, block_causal=True),
    "tp2_chat_chunked_loss": Layout(tp=2, chat=True, block_causal=True, loss_chunk_tokens=16),
    "pp2_chat": Layout(pp=2, chat=True, block_causal=True),
}
# Qwen3 MoE's experts split over 2 ranks (parallelisms/ep.py), last in each launch: ParallelDims.expert_meshes
# flattens dp_shard x cp x tp on the (process-wide) root mesh, and DTensor then reduces FSDP x TP gradient norms over
# that flattened group, so a dense FSDP x TP layout run after EP with TP would send its norms otherwise than alone.
EP_LAYOUTS: dict[str, Layout] = {
    # Alone, with FSDP sharding each rank's experts over the ranks left, with pipeline stages, with TP's ranks as the
    # ep ranks (sequence parallel gives each its own tokens); one read of the all-to-all's split sizes per MoE block
    # and forward.
    "qwen3_moe_ep2": Layout(dp_shard=2, ep=2, family="qwen3_moe"),
    "qwen3_moe_ep2_fsdp2": Layout(dp_shard=4, ep=2, family="qwen3_moe"),
    "qwen3_moe_ep2_pp2": Layout(pp=2, dp_shard=2, ep=2, family="qwen3_moe"),
    # op SAC keeps the exchanged rows (parallelisms/ac.py _SAVE_OPS); full AC sends them again.
    "qwen3_moe_ep2_op_sac": Layout(dp_shard=2, ep=2, ac=OP_SAC, family="qwen3_moe"),
    "qwen3_moe_ep2_fsdp2_full_ac": Layout(dp_shard=4, ep=2, ac=FULL, family="qwen3_moe"),
    "qwen3_moe_ep2_tp2": Layout(dp_shard=2, tp=2, ep=2, family="qwen3_moe"),
}
# DPO (dpo.py): each pair's summed reply log-probabilities, on vocabulary shards, in chunks; a step's pairs split
# unevenly over ranks and micro-batches. (Its Qwen3 MoE layout is among EP_LAYOUTS.)
DPO_LAYOUTS: dict[str, Layout] = {
    "fsdp2_accum2_dpo": Layout(dp_shard=2, grad_accum=2, dpo=True, block_causal=True),
    "tp2_chunked_loss_dpo": Layout(tp=2, loss_chunk_tokens=16, dpo=True, block_causal=True),
    "hsdp2x2_dpo": Layout(dp_replicate=2, dp_shard=2, dpo=True, block_causal=True),
    "fsdp2_tp2_op_sac_dpo": Layout(dp_shard=2, tp=2, ac=OP_SAC, dpo=True, block_causal=True),
    # The live reference: a frozen copy sharded as the policy is, its forward before the policy's.
    "fsdp2_dpo_live": Layout(dp_shard=2, dpo=True, dpo_live=True, block_causal=True),
    "tp2_chunked_loss_dpo_live": Layout(tp=2, loss_chunk_tokens=16, dpo=True, dpo_live=True, block_causal=True),
}
DPO_EP_LAYOUTS = {"qwen3_moe_ep2_dpo": Layout(dp_shard=2, ep=2, family="qwen3_moe", dpo=True, block_causal=True)}
# Distillation (distill.py): a teacher built and sharded as the student, the divergence in chunks on vocabulary shards,
# on chat labels (some count, unevenly over rows). (Its Qwen3 MoE layout is among the expert-parallel ones, last.)
DISTILL_LAYOUTS: dict[str, Layout] = {
    "fsdp2_distill": Layout(dp_shard=2, chat=True, block_causal=True, distill=True),
    "tp2_chunked_loss_distill": Layout(tp=2, loss_chunk_tokens=16, chat=True, block_causal=True, distill=True),
    "cp2_distill": Layout(cp=2, chat=True, block_causal=True, distill=True),
    "fsdp2_tp2_distill": Layout(dp_shard=2, tp=2, chat=True, block_causal=True, distill=True),
    # The teacher's blocks compiled too: its no-grad graph beside the student's, neither recompiled after step 1.
    "fsdp2_compile_distill": Layout(dp_shard=2, compile=True, chat=True, block_causal=True, distill=True),
}
DISTILL_EP_LAYOUTS = {
    "qwen3_moe_ep2_distill": Layout(dp_shard=2, ep=2, family="qwen3_moe", chat=True, block_causal=True, distill=True)
}
# LoRA (lora.py): adapters on every linear of the tiny model's blocks, A and B nonzero (lora_run), the base frozen. TP
# splits them by PEFT's rule (column-parallel: B split, A whole; row-parallel: A split); the frozen base must not move.
LORA_LAYOUTS: dict[str, Layout] = {
    "fsdp2_lora": Layout(dp_shard=2, lora=True),
    "tp2_lora": Layout(tp=2, lora=True),
    "cp2_lora": Layout(cp=2, lora=True),
    "pp2_lora": Layout(pp=2, lora=True),
    "fsdp2_tp2_op_sac_lora": Layout(dp_shard=2, tp=2, ac=OP_SAC, lora=True),
    # DPO's reference the policy itself with its adapters off (no second model), scoring before each forward; and
    # compiled (DPO's compiled layout): the adapters' switch is a second graph of the block, not a recompile a step.
    "fsdp2_compile_full_ac_dpo_lora": Layout(
        dp_shard=2, ac=FULL, compile=True, dpo=True, dpo_live=True, block_causal=True, lora=True
    ),
    "tp2_chunked_loss_dpo_lora": Layout(
        tp=2, loss_chunk_tokens=16, dpo=True, dpo_live=True, block_causal=True, lora=True
    ),
}
LAYOUTS |= CHAT_LAYOUTS
LAYOUTS |= DPO_LAYOUTS
LAYOUTS |= DISTILL_LAYOUTS
LAYOUTS |= LORA_LAYOUTS
LAYOUTS |= CP_LAYOUTS
LAYOUTS |= EP_LAYOUTS
LAYOUTS |= DPO_EP_LAYOUTS  # expert parallel's, last (EP_LAYOUTS says why)
LAYOUTS |= DISTILL_EP_LAYOUTS


# ------------------------------------------------------------------- shared pieces


def model_args(*, block_causal: bool = False, family: str = "llama3") -> Any:
    return dataclasses.replace(TINY_SHAPES[family], attn_mask_type="block_causal" if block_causal else "causal")


def build_tiny(*, seed: int = 0, block_causal: bool = False, family: str = "llama3") -> nn.Module:
    torch.manual_seed(seed)
    model = models.family(family).model_cls(model_args(block_causal=block_causal, family=family))
    model.init_weights()
    return model


def random_batch(*, seed: int = 1) -> torch.Tensor:
    """(GLOBAL_BATCH, SEQ_LEN + 1) tokens: inputs are [:, :-1], labels [:, 1:]."""
    return torch.randint(0, TINY.vocab_size, (GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(seed))


def random_segments(*, seed: int = 2) -> torch.Tensor:
    """(GLOBAL_BATCH, SEQ_LEN) document index of each input token: 1 to 4 documents per row."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.rand(GLOBAL_BATCH, SEQ_LEN, generator=generator) < 0.1
    starts[:, 0] = False
    return torch.cumsum(starts.int(), dim=1).int()


def one_process(model: nn.Module) -> ForwardBackward:
    """train.py's forward-backward of one CPU process: no TP, CP or pipeline, the whole logits at once."""
    return ForwardBackward(model, Loss(), device=torch.device("cpu"))


def micro_batches(tokens: torch.Tensor, count: int = 1) -> list[Batch]:
    """(rows, seq_len + 1) tokens as `count` micro-batches of rows, every label counted (loss divisor `count`)."""
    return [Batch(t[:, :-1], t[:, 1:], None, count) for t in tokens.tensor_split(count)]


def chat_labels(tokens: torch.Tensor) -> torch.Tensor:
    """Labels of `tokens` as chat data has them: IGNORE_INDEX but where an "assistant" token counts, a share
    per row of 80%, 50%, 20% and 5%, so that data-parallel ranks and micro-batches hold unequal counts."""
    counted = torch.rand(GLOBAL_BATCH, SEQ_LEN, generator=torch.Generator().manual_seed(3))
    counted = counted < torch.tensor([0.8, 0.5, 0.2, 0.05])[:, None]
    return tokens[:, 1:].masked_fill(~counted, IGNORE_INDEX)


DPO_SETTINGS = Dpo(enable=True, beta=0.1, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.2])
# Each row's documents (its pairs' chosen and rejected, then padding): uneven lengths and pairs per row.
DPO_DOCUMENTS = [[7, 9, 6, 8], [12, 14], [5, 6, 9, 7], [10, 8, 6, 7]]
DPO_PROMPT = 3  # tokens of a document's start that no label counts


def dpo_pairs(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Pairs, float]:
    """Preference pairs packed as data/preference.py packs them: (labels, segments, pair ids, the global batch's
    pairs) of `tokens`; a label counts where its token is a reply's (past its document's DPO_PROMPT tokens)."""
    segments = torch.full((GLOBAL_BATCH, SEQ_LEN), 0, dtype=torch.int32)
    counted = torch.zeros(GLOBAL_BATCH, SEQ_LEN, dtype=torch.bool)
    ids = torch.full((GLOBAL_BATCH, 2), -1, dtype=torch.int64)
    for row, lengths in enumerate(DPO_DOCUMENTS):
        at = 0
        for document, length in enumerate(lengths):
            segments[row, at : at + length] = document
            counted[row, at + DPO_PROMPT - 1 : at + length - 1] = True  # label t is token t + 1
            at += length
        segments[row, at:] = len(lengths)
        ids[row, : len(lengths) // 2] = torch.arange(len(lengths) // 2) + 2 * row
    chosen = sum(length - DPO_PROMPT for lengths in DPO_DOCUMENTS for length in lengths[0::2])
    pairs = int((ids >= 0).sum())
    return tokens[:, 1:].masked_fill(~counted, IGNORE_INDEX), segments, Pairs(ids, chosen / pairs), pairs


def dpo_loss(reference: torch.Tensor, *, chunk_tokens: int = 0, vocab_shards: int = 1) -> PreferenceLoss:
    loss = PreferenceLoss(DPO_SETTINGS, chunk_tokens=chunk_tokens, vocab_shards=vocab_shards)
    loss.reference = reference
    return loss


def dpo_reference(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The initial model's [chosen, rejected] log-probabilities of each pair of dpo_pairs(), one process."""
    labels, segments, pairs, count = dpo_pairs(tokens)
    forward = ForwardBackward(model, Loss(), device=torch.device("cpu"))
    with forward.scoring():
        scores = forward.score_documents(Batch(tokens[:, :-1], labels, segments, 1.0, pairs), documents=4)
    table = torch.zeros(2 * GLOBAL_BATCH, 2)
    valid = pairs.ids >= 0
    table[pairs.ids[valid]] = scores.view(GLOBAL_BATCH, 2, 2)[valid]
    return table


def dpo_reference_run(family: str, initial: dict[str, torch.Tensor], tokens: torch.Tensor) -> dict[str, Any]:
    """One process's DPO on dpo_pairs() from `initial`: its reference table, losses and final weights."""
    model = build_tiny(block_causal=True, family=family)
    model.load_state_dict(initial)
    table = dpo_reference(model, tokens)
    labels, segments, pairs, count = dpo_pairs(tokens)
    losses, times = train(
        model, tokens, labels=labels, segments=segments, pairs=pairs, divisor=count, loss_fn=dpo_loss(table)
    )
    return {"reference": table, "losses": losses, "times": times, "final": model.state_dict()}


# The forward KL's counterpart in a JSD at temperature 2 exercises both log-softmaxes and the mixture's gradients.
DISTILL_SETTINGS = Distill(enable=True, beta=0.5, temperature=2.0, kd_ratio=0.5)
TEACHER_SEED = 7  # the teacher: the student's family and shape, other weights


def distill_run(family: str, initial: dict[str, torch.Tensor], tokens: torch.Tensor, segments: torch.Tensor) -> dict:
    """One process's distillation on chat_labels() from `initial`, its teacher build_tiny(seed=TEACHER_SEED): the
    teacher's weights, losses and the student's final weights."""
    model = build_tiny(block_causal=True, family=family)
    model.load_state_dict(initial)
    teacher = build_tiny(seed=TEACHER_SEED, block_causal=True, family=family).eval().requires_grad_(False)
    labels = chat_labels(tokens)
    losses, times = train(
        model, tokens, labels=labels, divisor=loss_divisor(labels, GLOBAL_BATCH, 1), segments=segments,
        loss_fn=DistillLoss(settings=DISTILL_SETTINGS, teacher=teacher),
    )  # fmt: skip
    return {"teacher": teacher.state_dict(), "losses": losses, "times": times, "final": model.state_dict()}


LORA_SETTINGS = Lora(enable=True, r=4, lora_alpha=8.0)  # every linear of a block; scale 2
LORA_SEED = 11  # the adapters' start: A and B both random, so that both take gradients from step 1


def lora_model(family: str, initial: dict[str, torch.Tensor], *, block_causal: bool = False) -> nn.Module:
    """The tiny model of `family` with LORA_SETTINGS' adapters, its base `initial`, A and B drawn from LORA_SEED."""
    model = build_tiny(block_causal=block_causal, family=family)
    apply_lora(model, LORA_SETTINGS, models.family(family), base_dtype=torch.float32)
    model.load_state_dict(initial, strict=False)
    generator = torch.Generator().manual_seed(LORA_SEED)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def lora_run(family: str, initial: dict[str, torch.Tensor], tokens: torch.Tensor) -> dict[str, Any]:
    """One process's LoRA training from `initial` (plain next-token loss), and its DPO on dpo_pairs() with the base
    (the adapters off) as the reference: the initial weights (base and adapters), losses and final weights."""
    model = lora_model(family, initial)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    losses, times = train(model, tokens)
    run = {"initial": start, "losses": losses, "times": times, "final": model.state_dict()}
    policy = lora_model(family, initial, block_causal=True)
    with policy.adapters_off():
        table = dpo_reference(policy, tokens)
    labels, segments, pairs, count = dpo_pairs(tokens)
    losses, times = train(
        policy, tokens, labels=labels, segments=segments, pairs=pairs, divisor=count, loss_fn=dpo_loss(table)
    )
    run["dpo"] = {"reference": table, "losses": losses, "times": times, "final": policy.state_dict()}
    return run


def loss_divisor(labels: torch.Tensor, rows: int, dp: int) -> float:
    """Batch.loss_divisor (data/loader.py) of a rank's `rows` of the global batch `labels`."""
    return int((labels != IGNORE_INDEX).sum()) / (rows * SEQ_LEN * dp)


def train(
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    divisor: float | None = None,
    segments: torch.Tensor | None = None,
    steps: int = STEPS,
    loss_parallel: bool = False,
    loss_chunk_tokens: int = 0,
    z_loss_weight: float = 0.0,
    collectives: Counter[str] | None = None,
    pipeline: Pipeline | None = None,
    counts: dict[str, Any] | None = None,
    mesh: DeviceMesh | None = None,
    cp: ContextParallel | None = None,
    grad_accum: int = 1,
    defer_reduce_scatter: bool = False,
    muon: str = "",
    precompute_float8_scales: bool = False,
    grad_norms: list[float] | None = None,
    expert_meshes: tuple[DeviceMesh, DeviceMesh] | None = None,
    pairs: Pairs | None = None,
    loss_fn: Any = None,
) -> tuple[list[float], list[float]]:
    """`steps` steps of train.py's `train_step` on `tokens` (this rank's slice); (losses, seconds per step).
    counts: filled with what decides GPU speed: the host reads of the last step, the graphs dynamo compiled
    in the first step and recompiled after it, and its graph breaks; with `mesh` (its dimensions name the groups,
    those the optimizer flattened included) the collectives of the last step (eager: a dispatch mode does not see into compiled graphs).

    The loss is the mean over this rank's tokens. With a process group it is averaged over all
    ranks (`mean_over_loss_ranks`, as train.py logs it): TP ranks of a data-parallel group hold the same
    loss, so this is the mean over the data-parallel ranks, the average FSDP takes of the
    gradients, and thus the single-process mean over the global batch.
    """
    if muon:  # Muon for the hidden matrices, AdamW for the rest (muon.py)
        o = Optimizer(lr=LR, eps=ADAM_EPS, name="Muon", muon_orthogonalize=muon)  # type: ignore[arg-type]
        optimizer = build_muon(o, model, models.family("llama3"))
    else:
        optimizer = build_optimizer(Optimizer(lr=LR, eps=ADAM_EPS), model)
    if precompute_float8_scales:  # as train.py (quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp)
        precompute_scales_after_each_step(optimizer, model)
    group_dims = mesh_group_dims(mesh) if mesh is not None else None
    if group_dims is not None and expert_meshes:  # expert parallel's groups, where no dimension has their ranks
        for name, sub in zip(("ep", "efsdp"), expert_meshes, strict=True):
            group_dims.setdefault(tuple(dist.get_process_group_ranks(sub.get_group(sub.ndim - 1))), name)
    labels = tokens[:, 1:] if labels is None else labels
    # The rows as `grad_accum` micro-batches (a divisor of counted labels holds for all of them: the step's).
    rows = [torch.arange(len(tokens)).tensor_split(grad_accum)[i] for i in range(grad_accum)]
    batch = [
        Batch(
            tokens[r, :-1],
            labels[r],
            segments[r] if segments is not None else None,
            divisor or grad_accum,
            pairs._replace(ids=pairs.ids[r]) if pairs is not None else None,  # DPO: each micro-batch's pairs
        )
        for r in rows
    ]
    if loss_fn is None:
        loss_fn = build_loss_fn(Compile(), chunk_tokens=loss_chunk_tokens, z_loss_weight=z_loss_weight)
    device = torch.device("cpu")
    forward_backward = ForwardBackward(
        model,
        loss_fn,
        device=device,
        loss_parallel=loss_parallel,
        cp=cp,
        pipeline=pipeline,
        defer_reduce_scatter=defer_reduce_scatter,
    )
    losses, times = [], []
    breaks_before, graphs_before = graph_breaks(), compiled_graphs()
    for step in range(steps):
        start = time.perf_counter()
        if step == 1 and counts is not None:  # the graphs the first step compiled
            counts["graphs_compiled"] = compiled_graphs() - graphs_before
        # The collectives of the last step (FSDP's lazy initialization is behind it), and what it reads back.
        last = step == steps - 1
        log = CollectiveLog(group_dims or {})
        with (
            count_collectives(collectives if last else None),
            count_host_reads(torch.device("cpu")) as reads,
            observe_ops(log) if last and group_dims is not None else contextlib.nullcontext(),
        ):
            result = train_step(step + 1, batch, forward_backward, optimizer, max_norm=MAX_NORM, stop_request=None)
        loss = result.loss.total
        if grad_norms is not None:
            grad_norms.append(result.grad_norm.item())
        if last and counts is not None:
            counts["host_reads"] = dict(reads)
            # Bytes this rank sent in the step, by mesh dimension, and its collectives (what the dry run predicts).
            # Also by collective kind: "dim op" -> bytes (the floor table of docs/benchmarks.md).
            counts["sent_by_dim"], counts["sent_by_op"], counts["collective_ops"] = Counter(), Counter(), Counter()
            for c in log.records:
                counts["sent_by_dim"][c.dim] += c.sent_per_rank
                counts["sent_by_op"][f"{c.dim} {c.op}"] += c.sent_per_rank
                counts["collective_ops"][f"{c.dim} {c.op}"] += 1
            counts["graphs_recompiled"] = compiled_graphs() - graphs_before - counts["graphs_compiled"]
            counts["graph_breaks"] = graph_breaks() - breaks_before
        pp = dist.get_world_size(pipeline.pp_group) if pipeline else 1
        losses.append(mean_over_loss_ranks(loss, pp_degree=pp).item() if dist.is_initialized() else loss.item())
        times.append(time.perf_counter() - start)
    return losses, times


def compiled_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


@contextlib.contextmanager
def count_collectives(counts: Counter[str] | None) -> Iterator[None]:
    """Count FSDP's all-gathers and reduce-scatters (torch.distributed's *_single calls) into `counts`."""
    if counts is None:
        yield
        return
    saved = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return saved[name](*args, **kwargs)

        return call

    try:
        for name in saved:
            setattr(dist, name, counting(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def write_reference(path: Path) -> dict:
    """Single process, no parallelism: initial weights, batch, losses and final parameters."""
    model = build_tiny()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = random_batch()
    grad_norms: list[float] = []
    losses, times = train(model, tokens, grad_norms=grad_norms)
    ref = {"initial": initial, "tokens": tokens, "losses": losses, "times": times, "final": model.state_dict()}
    ref["grad_norms"] = grad_norms
    # The same start, with attention kept inside the documents of random_segments().
    block = build_tiny(block_causal=True)
    ref["segments"] = random_segments()
    ref["block_causal"] = dict(zip(("losses", "times"), train(block, tokens, segments=ref["segments"]), strict=True))
    ref["block_causal"]["final"] = block.state_dict()
    # The same batch through each other family, causal and within the documents.
    for family in [name for name in TINY_SHAPES if name != "llama3"]:
        other = build_tiny(family=family)
        ref[family] = {"initial": {k: v.clone() for k, v in other.state_dict().items()}}
        ref[family]["grad_norms"] = []
        ref[family]["losses"], ref[family]["times"] = train(other, tokens, grad_norms=ref[family]["grad_norms"])
        ref[family]["final"] = other.state_dict()
        block = build_tiny(block_causal=True, family=family)
        block.load_state_dict(ref[family]["initial"])
        trained = train(block, tokens, segments=ref["segments"])
        ref[family]["block_causal"] = dict(zip(("losses", "times"), trained, strict=True)) | {
            "final": block.state_dict()
        }
    # The same start, trained with Muon (its hidden matrices) and AdamW (the rest).
    muon = build_tiny()
    ref["muon"] = dict(zip(("losses", "times"), train(muon, tokens, muon="matrix"), strict=True))
    ref["muon"]["final"] = muon.state_dict()
    # The same start with float8 linears, AdamW and Muon. float8 scales activations and output gradients by the
    # batch each rank holds (dynamic scaling): one process matches 2 data-parallel ranks when it runs their rows as 2
    # micro-batches (FSDP 2 against one batch of all 4 rows: 8e-3 apart after 5 AdamW steps).
    for name, orthogonalize in (("float8", ""), ("muon_float8", "matrix")):
        model = build_tiny()
        apply_float8(model, FLOAT8, device=torch.device("cpu"), fsdp_sharded=False)
        trained = train(model, tokens, muon=orthogonalize, grad_accum=2)
        ref[name] = dict(zip(("losses", "times"), trained, strict=True))
        ref[name]["final"] = model.state_dict()
    # The same start, with the z-loss added.
    z_loss = build_tiny()
    ref["z_loss"] = dict(zip(("losses", "times"), train(z_loss, tokens, z_loss_weight=Z_LOSS_WEIGHT), strict=True))
    ref["z_loss"]["final"] = z_loss.state_dict()
    # The same start on chat data: documents kept apart, a few labels counted.
    chat, labels = build_tiny(block_causal=True), chat_labels(tokens)
    divisor = loss_divisor(labels, GLOBAL_BATCH, 1)
    ref["chat"] = dict(
        zip(
            ("losses", "times"),
            train(chat, tokens, labels=labels, divisor=divisor, segments=ref["segments"]),
            strict=True,
        )
    )
    ref["chat"]["final"] = chat.state_dict()
    # The same start on preference pairs (dpo.py), and Qwen3 MoE's (expert parallel's layout).
    ref["dpo"] = dpo_reference_run("llama3", initial, tokens)
    ref["qwen3_moe"]["dpo"] = dpo_reference_run("qwen3_moe", ref["qwen3_moe"]["initial"], tokens)
    # The same start distilled from a teacher (distill.py), and Qwen3 MoE's.
    ref["distill"] = distill_run("llama3", initial, tokens, ref["segments"])
    ref["qwen3_moe"]["distill"] = distill_run("qwen3_moe", ref["qwen3_moe"]["initial"], tokens, ref["segments"])
    # The same start with LoRA's adapters on the frozen base (lora.py), and its DPO with the base as the reference.
    ref["lora"] = lora_run("llama3", initial, tokens)
    torch.save(ref, path)
    return ref


def max_param_diff(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert state.keys() == ref.keys(), sorted(set(state) ^ set(ref))
    return max((state[k].float() - ref[k].float()).abs().max().item() for k in ref)


# --------------------------------------------------------------------- one layout


_compiled_family: list[str] = []  # the family the worker's compiled layouts so far were


def run_layout(name: str, layout: Layout, ref: dict) -> dict:
    # A second family compiled in one process as a run would compile it: otherwise dynamo takes its block for a new
    # shape of the same frame (the checkpointed forward is shared) and recompiles with dynamic shapes, which inductor
    # 2.13 fails on ("mul expected 2 arguments, got 3"). A run compiles one family, so training never meets it.
    if layout.compile and _compiled_family[-1:] not in ([], [layout.family]):
        torch._dynamo.reset()
    if layout.compile:
        _compiled_family.append(layout.family)
    world = dist.get_world_size()
    z_loss_weight = Z_LOSS_WEIGHT if layout.z_loss else 0.0
    assert layout.world_size == world, f"{name} needs {layout.world_size} ranks, got {world}"
    parallelism = Parallelism(
        data_parallel_replicate_degree=layout.dp_replicate,
        data_parallel_shard_degree=layout.dp_shard,
        tensor_parallel_degree=layout.tp,
        disable_loss_parallel=not layout.loss_parallel,
        fsdp_reshard_after_forward=layout.reshard_after_forward,  # type: ignore[arg-type]
        fsdp_defer_reduce_scatter=layout.defer_reduce_scatter,
        pipeline_parallel_degree=layout.pp,
        pipeline_parallel_schedule=layout.schedule,
        context_parallel_degree=layout.cp,
        context_parallel_load_balancer="headtail" if layout.cp_load_balance else "none",
        expert_parallel_degree=layout.ep,
    )
    dims = ParallelDims.from_config(parallelism, world_size=world)
    mesh = dims.build_mesh("cpu")
    cfg = JobConfig(
        model=Model(name=layout.family),
        training=dataclasses.replace(TRAINING, local_batch_size=GLOBAL_BATCH // dims.dp),
        parallelism=parallelism,
        activation_checkpoint=layout.ac,
        compile=Compile(enable=layout.compile),
    )
    if layout.float8_linear is not None:
        cfg.model.converters, cfg.quantize.linear.float8 = ["quantize.linear.float8"], layout.float8_linear
    if layout.lora:
        cfg.lora = LORA_SETTINGS
    # As train.py builds it (pipeline stages included); init_model fills the RoPE buffer, the weights come from
    # the reference next.
    model, pipeline = build_model(
        cfg,
        model_args(block_causal=layout.block_causal, family=layout.family),
        dims=dims,
        mesh=mesh,
        loss_fn=build_loss_fn(Compile(), chunk_tokens=layout.loss_chunk_tokens, z_loss_weight=z_loss_weight),
        device=torch.device("cpu"),
    )
    init_model(model, pipeline, device=torch.device("cpu"))
    options = StateDictOptions(full_state_dict=True)
    # A copy (set_model_state_dict replaces the dict's tensors with this layout's DTensors) of the
    # weights this rank holds (a pipeline stage holds some).
    held = get_model_state_dict(model).keys()
    initial = ref["initial"] if layout.family == "llama3" else ref[layout.family]["initial"]
    if layout.lora:  # the base and the adapters lora_run started from
        initial = ref["lora"]["initial"]
    set_model_state_dict(model, {k: v for k, v in initial.items() if k in held}, options=options)

    # Each data-parallel rank takes its slice of the global batch; the TP ranks of one
    # data-parallel group take the same slice.
    per_rank = GLOBAL_BATCH // dims.dp
    dp_rank = dims.dp_rank(mesh)
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    segments = ref["segments"][rows] if layout.block_causal else None
    labels = chat_labels(ref["tokens"]) if layout.chat else None
    family = ref if layout.family == "llama3" else ref[layout.family]
    divisor = loss_divisor(labels, per_rank, dims.dp) if labels is not None else None
    preference: dict[str, Any] = {}  # DPO's pairs and loss
    if layout.dpo:  # the global batch's pairs over the data-parallel ranks (data/loader.py)
        labels, all_segments, all_pairs, count = dpo_pairs(ref["tokens"])
        segments, divisor = all_segments[rows], count / dims.dp
        vocab_shards = dims.tp if dims.tp_enabled and layout.loss_parallel else 1
        preference = {
            "pairs": all_pairs._replace(ids=all_pairs.ids[rows]),
            "loss_fn": dpo_loss(
                family["dpo"]["reference"], chunk_tokens=layout.loss_chunk_tokens, vocab_shards=vocab_shards
            ),
        }
        if layout.dpo_live:  # a second model of this layout holding the initial weights, frozen
            live, _ = build_model(cfg, model_args(block_causal=True, family=layout.family), dims=dims, mesh=mesh,
                                  loss_fn=build_loss_fn(Compile()), device=torch.device("cpu"))  # fmt: skip
            init_model(live, None, device=torch.device("cpu"))
            set_model_state_dict(live, {k: v for k, v in initial.items() if k in held}, options=options)
            preference["loss_fn"].live = live.eval().requires_grad_(False)
        if layout.dpo_live and layout.lora:  # but with adapters, the policy with them off (dpo.prepare_reference)
            preference["loss_fn"].live, preference["loss_fn"].as_reference = model, model.adapters_off
    if layout.distill:  # the teacher in this layout, as distill.build_teacher builds it, its weights the reference's
        teacher, _ = build_model(cfg, model_args(block_causal=True, family=layout.family), dims=dims, mesh=mesh,
                                 loss_fn=build_loss_fn(Compile()), device=torch.device("cpu"))  # fmt: skip
        init_model(teacher, None, device=torch.device("cpu"))
        set_model_state_dict(teacher, dict(family["distill"]["teacher"]), options=options)  # a copy, as above
        vocab_shards = dims.tp if dims.tp_enabled and layout.loss_parallel else 1
        preference["loss_fn"] = DistillLoss(
            layout.loss_chunk_tokens, settings=DISTILL_SETTINGS, teacher=teacher.eval().requires_grad_(False),
            vocab_shards=vocab_shards,
        )  # fmt: skip
    collectives: Counter[str] = Counter()
    counts: dict[str, Any] = {}
    passes: dict[str, list] = {}
    if layout.summed_matmuls:
        passes["post_grad_custom_pre_pass"] = [SummedMatmuls()]
    grad_norms: list[float] = []
    with torch._inductor.config.patch(**passes):
        losses, times = train(
            model,
            ref["tokens"][rows],
            labels=labels[rows] if labels is not None else None,
            divisor=divisor,
            **preference,
            segments=segments,
            loss_parallel=dims.tp_enabled and layout.loss_parallel,
            loss_chunk_tokens=layout.loss_chunk_tokens,
            z_loss_weight=z_loss_weight,
            collectives=collectives,
            pipeline=pipeline,
            counts=counts,
            mesh=None if layout.compile else mesh,
            cp=context_parallel(mesh, parallelism),
            grad_accum=layout.grad_accum,
            defer_reduce_scatter=layout.defer_reduce_scatter,
            muon=layout.muon,
            precompute_float8_scales=layout.float8 == "precompute",
            grad_norms=grad_norms,
            expert_meshes=dims.expert_meshes(mesh) if dims.ep_enabled else None,
        )
    counts["summed_matmuls"] = sum(p.rewrites for p in passes.get("post_grad_custom_pre_pass", []))
    if layout.chat:
        expected = ref["chat"]
    elif layout.block_causal:
        expected = family["block_causal"]
    elif layout.z_loss:
        expected = ref["z_loss"]
    elif layout.muon:
        expected = ref["muon"]
    else:
        expected = family
    if layout.float8:
        expected = ref["muon_float8"] if layout.muon else ref["float8"]
    if layout.dpo:
        expected = family["dpo"]
    if layout.distill:
        expected = family["distill"]
    if layout.lora:
        expected = ref["lora"]["dpo"] if layout.dpo else ref["lora"]

    final = get_model_state_dict(model, options=options)
    # Every rank compares the weights it holds (a pipeline stage: its own); the worst over all ranks.
    param_diff = torch.tensor(max_param_diff(final, {k: v for k, v in expected["final"].items() if k in final}))
    dist.all_reduce(param_diff, op=dist.ReduceOp.MAX)
    return {
        "losses": losses,
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses, expected["losses"], strict=True)),
        "max_param_diff": param_diff.item(),
        # Relative, where the reference kept its norms (a family's plain causal run, AdamW).
        "max_grad_norm_diff": max(
            (abs(a - b) / b for a, b in zip(grad_norms, expected.get("grad_norms", []), strict=False)), default=None
        ),
        # Step 1 includes lazy initialization (FSDP) and compilation.
        "step_time_s": sum(times[1:]) / len(times[1:]),
        "param_types": sorted({type(p).__name__ for p in model.parameters()}),
        "collectives": dict(collectives),
        **counts,
    }


def main(argv: list[str]) -> int:
    run_dir, names = Path(argv[0]), argv[1:]
    if names == ["--reference"]:  # one process, before the launches
        write_reference(run_dir / "reference.pt")
        return 0
    dist.init_process_group("gloo")
    try:
        ref = torch.load(run_dir / "reference.pt")
        for name in names:
            start = time.perf_counter()
            result = run_layout(name, LAYOUTS[name], ref)
            result["seconds"] = round(time.perf_counter() - start, 2)  # where a launch's time goes
            if dist.get_rank() == 0:
                (run_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
                print(name, json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
