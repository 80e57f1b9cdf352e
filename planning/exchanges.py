"""What context and expert parallel add to a block's memory: the tensors they exchange, per micro-batch.

planning/memory.py adds them to what one traced block keeps (the trace runs on one rank: it sees neither the window's
keys and values that context parallel gathers, nor the rows that expert parallel's all-to-all brings), and the dry
run counts the bytes of the gathers (planning/dry_run.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from planning.job import Job
    from planning.trace import BlockCosts


def cp_kv_bytes(job: Job) -> dict[str, int]:
    """What context parallel adds to one block's activations (parallelisms/cp.py), per micro-batch: attention
    saves its keys and values for the whole window instead of this rank's 1/cp of it, expanded to the query
    heads (grouped-query attention repeats them before SDPA): `saved`; an op-SAC block keeps the all-gather's output,
    the window's keys and values at the KV heads, so that backward does not gather again: `kept`; one
    all-gather's payload, the window's keys and values: `gathered`; on CPU ranks, SDPA's dense additive mask of
    this rank's queries x the window, one per forward (models/attention.py; CUDA's BlockMask is a few KiB): `mask`.
    All 0 without context parallel."""
    if job.dims.cp == 1:
        return dict.fromkeys(("saved", "kept", "gathered", "mask"), 0)
    args, param_bytes, tp = job.args, getattr(torch, job.cfg.training.mixed_precision_param).itemsize, job.dims.tp
    batch, window = job.microbatch_tokens // job.local_seq_len, job.cfg.training.seq_len
    head_bytes = batch * args.head_dim * param_bytes
    saved = 2 * head_bytes * (window - job.local_seq_len) * (args.n_heads // tp)
    gathered = 2 * head_bytes * window * (args.kv_heads // tp)
    mask = batch * job.local_seq_len * window * param_bytes if not job.machine.reserves else 0
    return {"saved": saved, "kept": gathered, "gathered": gathered, "mask": mask}


def ep_bytes(job: Job, costs: BlockCosts) -> dict[str, float]:
    """What expert parallel (parallelisms/ep.py) changes in one MoE block's memory per micro-batch on this rank, for
    routing that sends its experts `job.ep_load` times balanced routing's rows. The rank's own rows are its tokens at
    the MoE (each TP rank its own, sequence parallel) x top_k; balanced, its experts receive as many from its ep group.

      saved          what the experts keep for backward (their input rows and what their forward keeps of them: the
                     trace's experts_saved, of the rank's own rows) grows with the rows they receive, by
                     (ep_load - 1) x experts_saved. The rest of the block, combine's buffers included, holds the
                     rank's own tokens: balanced routing saves what the block without expert parallel saves.
      kept           op SAC keeps the exchanged tensors (parallelisms/ac.py): dispatch's received rows, combine's
                     rows back home, and the counts per expert (int64).
      exchange       in a block's backward, one received rows' worth more: a gradient all-to-all's output beside
                     its input (measured, tests/test_estimate_memory.py).
      received_rows  the rows (token, choice pairs) its experts receive per block.

    In forward, dispatch holds the received rows twice for a moment (the all-to-all's output and its regrouped copy)
    and combine the experts' output twice beside the rows sent home: no phase of the peak, which is in backward. All
    0 without expert parallel."""
    if job.dims.ep == 1 or not costs.experts_params:
        return dict.fromkeys(("saved", "kept", "exchange", "received_rows"), 0)
    args, param_bytes = job.args, getattr(torch, job.cfg.training.mixed_precision_param).itemsize
    rows = job.microbatch_tokens // job.dims.tp * job.fam.experts_per_token(args)
    received = job.ep_load * rows
    return {
        "saved": (job.ep_load - 1) * costs.experts_saved,
        "kept": (received + rows) * args.dim * param_bytes + 8 * job.fam.num_experts(args),
        "exchange": received * args.dim * param_bytes,
        "received_rows": received,
    }
