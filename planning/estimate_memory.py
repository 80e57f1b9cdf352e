"""Predict the memory of one GPU of a training setup before asking for GPUs (docs/failures.md #5): the estimate of
planning/memory.py, term by term, per pipeline rank (the worst, or --pp-rank).

    python -m planning.estimate_memory --flavor llama3_8b --ngpu 8 --local-batch-size 2 --ac selective-op
    python -m planning.estimate_memory --flavor llama3_70b --ngpu 64 --tp 8 --local-batch-size 8 --ac full
    python -m planning.estimate_memory --flavor llama3_405b --ngpu 512 --tp 8 --pp 8 --local-batch-size 8 --ac full
    python -m planning.estimate_memory --references   # against torchtitan's published peaks (planning/references.py)
    python -m planning.estimate_memory ... --fake-step  # torch's own count of a whole step (planning/fake_step.py)

How each term is modelled: docs/planning.md, "How the estimator counts".
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

# TorchDispatchMode is the documented way to see every aten op, in a private module (PyTorch 2.13).
from config import Parallelism, Training
from errors import ConfigError
from models import NAMES, family
from parallelisms.pp import SCHEDULES
from planning.fake_step import fake_job_memory
from planning.memory import AC_MODES, DTYPE_BYTES, FRAGMENTATION, GiB, Job, estimate, estimate_rank
from planning.references import REFERENCES


def _row(label: str, value: float, note: str = "") -> str:
    return f"  {label:<30} {value / GiB:8.2f} GiB" + (f"   {note}" if note else "")


def breakdown(job: Job, pp_rank: int | None = None) -> str:
    """The per-GPU breakdown as printed by the script: of `pp_rank`, or of the rank that needs the most."""
    e = estimate(job) if pp_rank is None else estimate_rank(job, pp_rank)
    rows = [*_state_rows(job, e), *_activation_rows(job, e), *_peak_rows(job, e)]
    return "\n".join([_heading(job, e, pp_rank), *rows])


def _heading(job: Job, e: dict[str, Any], pp_rank: int | None) -> str:
    """The job in one line; under PP a second one: the schedule and the rank broken down."""
    shard = f"shard {job.shard // job.cp} x cp {job.cp}" if job.cp > 1 else f"shard {job.shard}"
    pp = f"pp {job.pp} x " if job.pp > 1 else ""
    heading = (
        f"{job.family} {job.flavor}: {job.fam.num_params(job.args) / 1e9:.2f}B params | {job.ngpu} GPUs = "
        f"{pp}replicate {job.replicate} x {shard} x tp {job.tp} | local batch {job.local_batch_size} x "
        f"{job.seq_len} tokens, grad accumulation {job.grad_accum} | params {job.param_dtype}, reduce "
        f"{job.reduce_dtype} | AC {job.ac} | RMSNorm {job.rmsnorm}" + (" | CPU offload" if job.cpu_offload else "")
    )
    if job.pp == 1:
        return heading
    which = "the worst" if pp_rank is None else "asked for"
    return (
        f"{heading}\n  pipeline: {job.pp_schedule}, {job.microbatches} micro-batches of {job.pp_microbatch_size} x "
        f"{job.seq_len} tokens, {len(job.stages)} stages | pp rank {e['pp_rank']} ({which}): stage(s) "
        f"{e['pp_stages']}, {e['rank_blocks']} blocks, up to {e['microbatches_held']} micro-batch(es) in flight"
    )


def _state_rows(job: Job, e: dict[str, Any]) -> list[str]:
    """The sharded state, the gathered parameters and the unsharded gradients."""
    if job.pp > 1:
        grads = "reduce-scattered at the end of the step"
        gathered = "the rank's stages, from their first forward to the end of the step"
        accumulators = "unsharded, reduce_dtype, from a stage's first backward"
        unsharded = _row("gradient accumulators", e["accumulators"], accumulators)
    else:
        grads = "reduce-scattered block by block in backward"
        units = f"norm+output unit {e['output_unit'] / GiB:.2f}, + 2 blocks x {e['block_unit'] / GiB:.2f}"
        gathered = f"{units} in backward"
        unsharded = _row("root unit's gradient", e["root_grad"], "unsharded, param_dtype, loss backward to the end")
    deferred = []
    if job.defers_reduce_scatter:
        grads = "reduce-scattered in the step's last micro-batch"
        what = "unsharded, reduce_dtype, first backward to the step's last (fsdp_defer_reduce_scatter)"
        deferred = [_row("gradient accumulators", e["accumulators"], what)]
    return [
        _row("sharded fp32 params", e["params"], "4 B per parameter of the rank / (shard x tp)"),
        _row("AdamW state (2 x fp32)", e["adam"]),
        _row("gradients (fp32 shards)", e["grads"], f"{grads}; {e['grads_at_peak'] / GiB:.2f} GiB of them at the peak"),
        _row("  -> on the GPU", e["state_on_gpu"], f"host: {e['state_on_host'] / GiB:.2f} GiB" * job.cpu_offload),
        _row("gathered params in flight", max(e["gathered_loss_phase"], e["gathered_block_phase"]), gathered),
        unsharded,
        *deferred,
    ]


def _activation_rows(job: Job, e: dict[str, Any]) -> list[str]:
    """The activations, the loss's buffers, one block's backward and the pipeline's buffers."""
    checkpointed = f", {e['act_per_block_checkpointed'] / GiB:.3f} checkpointed" if job.ac != "none" else ""
    held = f", {e['microbatches_held']} micro-batch(es) of them held" if job.pp > 1 else ""
    per_block = f"per micro-batch{held}; per block {e['act_per_block_no_ac'] / GiB:.3f} without AC{checkpointed}"
    block_backward = (
        f"recompute {e['recompute'] / GiB:.2f} + activation grads {e['grad_acts'] / GiB:.2f} "
        f"+ unsharded grads/RS {e['rs_buffers'] / GiB:.2f}"
    )
    rows = [
        _row(f"activations, {e['rank_blocks']} blocks", e["act_blocks"], per_block),
        _row("activations outside blocks", e["act_outside_blocks"], "final norm, token ids"),
        _row("logits + loss buffers", e["loss_buffers"], _loss_note(job)),
        _row("one block's backward", e["block_backward"], block_backward),
    ]
    return rows + ([_row("pp send/recv buffers", e["pp_buffers"])] if job.pp > 1 else [])


def _loss_note(job: Job) -> str:
    """The logits the loss buffers are made of, and the bytes per logit."""
    tokens, param_bytes = job.microbatch_tokens, DTYPE_BYTES[job.param_dtype]
    per_logit = (12 if job.tp == 1 else 16) + (param_bytes if job.logits_kept_in_backward else 0)
    kept = "logits held through backward" if job.logits_kept_in_backward else "logits freed before backward"
    if job.chunk_tokens:
        tokens, per_logit = job.chunk_tokens, 8 + param_bytes + (8 if job.tp == 1 else 12)
        kept = (
            f"chunked: one chunk of {tokens:,} tokens at a time + the gradients of the final norm's output and the "
            "output"
        )
    return f"{tokens:,} x {job.args.vocab_size // job.tp:,} logits x {per_logit} B ({kept})"


def _peak_rows(job: Job, e: dict[str, Any]) -> list[str]:
    """The allocated and reserved peaks, the overhead outside the allocator and the total."""
    phases = (
        f"at the {e['peak_phase']}: static state + max(loss phase {e['loss_phase'] / GiB:.2f}, "
        f"block phase {e['block_phase'] / GiB:.2f}, embedding phase {e['embedding_phase'] / GiB:.2f})"
    )
    if job.allocator == "cuda":
        reserved = (
            f"static + shards {e['rs_pool'] / GiB:.2f} + all-gather outputs {e['ag_pool'] / GiB:.2f} + "
            f"{1 + FRAGMENTATION:.2f} x compute stream {e['compute_peak'] / GiB:.2f} (caching allocator)"
        )
    else:
        reserved = "no caching allocator: = allocated"
    return [
        _row("peak, allocated", e["allocator_peak"], phases),
        _row("peak, reserved", e["reserved"], reserved),
        _row("CUDA context + NCCL (assumed)", e["overhead"]),
        _row("total per GPU", e["total"], "reserved + overhead"),
    ]


def fake_breakdown(job: Job, pp_rank: int = 0) -> str:
    """fake_job_memory's categories at its peak next to the formula's allocated peak, for the same rank (MiB)."""
    start = time.perf_counter()
    fake = fake_job_memory(job, pp_rank=pp_rank)
    seconds = time.perf_counter() - start
    e = estimate_rank(job, pp_rank)
    MiB = 2**20
    lines = [
        f"fake-tensor step (torch's FSDPMemTracker, {seconds:.1f} s), pp rank {pp_rank}: peak "
        f"{fake['total'] / MiB:,.1f} MiB; the estimate's allocated peak {e['allocator_peak'] / MiB:,.1f} MiB "
        f"({fake['total'] / e['allocator_peak'] - 1:+.1%})"
    ]
    lines += [f"  {name:<30} {nbytes / MiB:10,.1f} MiB" for name, nbytes in fake.items() if nbytes and name != "total"]
    return "\n".join(lines)


def references() -> str:
    head = f"{'setup':<52} {'alloc':>6} {'resvd':>6} {'+ovh':>6}  published (torch.cuda max reserved, GiB) vs resvd"
    lines = [
        "Estimates in GiB: allocated peak, reserved (caching allocator), reserved + assumed CUDA/NCCL overhead",
        head,
        "-" * len(head),
    ]
    for ref in REFERENCES:
        e = estimate(ref.job)
        reserved = e["reserved"] / GiB
        published = ", ".join(f"{k} {v:.1f} ({reserved / v - 1:+.0%})" for k, v in ref.published.items()) or "-"
        lines.append(
            f"{ref.name:<52} {e['allocator_peak'] / GiB:6.1f} {reserved:6.1f} {e['total'] / GiB:6.1f}  {published}"
        )
        where = f"peak at the {e['peak_phase']}" + (f", pp rank {e['pp_rank']}" if ref.job.pp > 1 else "")
        lines.append(f"{'':<52} {'':>6} {'':>6} {'':>6}  {ref.note}; {where}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama3", choices=NAMES, help="model family ([model] name)")
    p.add_argument("--flavor", default="llama3_8b", help="a flavor of the family (train.py's model.flavor)")
    p.add_argument("--ngpu", type=int, default=8, help="GPUs in the job")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree (sequence + loss parallel on)")
    p.add_argument(
        "--replicate", type=int, default=1, help="HSDP replicate degree (dp_shard = ngpu / pp / tp / replicate)"
    )
    p.add_argument("--cp", type=int, default=1, help="context_parallel_degree: each rank holds seq_len / cp tokens")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--local-batch-size", type=int, default=1, help="sequences per data-parallel rank")
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="micro-batches per optimizer step (global batch / (local batch x dp))",
    )
    p.add_argument(
        "--defer-reduce-scatter",
        action="store_true",
        help="parallelism.fsdp_defer_reduce_scatter: with --grad-accum > 1, gradients unsharded until the step's last",
    )
    p.add_argument("--param-dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--reduce-dtype", default="float32", choices=sorted(DTYPE_BYTES))
    p.add_argument("--ac", default="selective-op", help=f"one of {', '.join(AC_MODES)} (or selective-<k>)")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP CPUOffloadPolicy: sharded state in host memory")
    p.add_argument(
        "--rmsnorm", default="fused", choices=["fused", "composite"], help="fused kernel (torch >= 2.8 CUDA)"
    )
    p.add_argument("--keep-logits", action="store_true", help="a loop that holds the logits through backward")
    p.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=Training().loss_chunk_tokens,
        help="training.loss_chunk_tokens (0: the whole micro-batch's logits at once; -1: chunks of 2048 where they exceed 256 MiB)",
    )
    pp = Parallelism()
    p.add_argument("--pp", type=int, default=1, help="pipeline_parallel_degree")
    p.add_argument("--pp-schedule", default=pp.pipeline_parallel_schedule, choices=list(SCHEDULES))
    p.add_argument(
        "--pp-microbatch-size",
        type=int,
        default=pp.pipeline_parallel_microbatch_size,
        help="sequences per pipeline micro-batch (local batch / this = micro-batches)",
    )
    p.add_argument(
        "--pp-layers-per-stage",
        type=int,
        default=pp.pipeline_parallel_layers_per_stage,
        help="blocks per stage (default: 1 stage per rank, 2 for the interleaved schedules)",
    )
    p.add_argument("--pp-first-stage-less-layers", type=int, default=pp.pipeline_parallel_first_stage_less_layers)
    p.add_argument("--pp-last-stage-less-layers", type=int, default=pp.pipeline_parallel_last_stage_less_layers)
    p.add_argument("--pp-rank", type=int, default=None, help="break down this pp rank (default: the worst)")
    p.add_argument("--allocator", default="cuda", choices=["cuda", "cpu"], help="cpu: no caching allocator")
    p.add_argument("--overhead-gib", type=float, default=2.0, help="CUDA context + NCCL, outside the allocator")
    p.add_argument(
        "--fake-step",
        action="store_true",
        help="also step the job on fake tensors (fake_job_memory) and print torch's count next to the formula's",
    )
    p.add_argument("--references", action="store_true", help="compare with torchtitan's published peaks and exit")
    return p.parse_args(argv)


# The run's config keys, as this script's flags: the recipe's rules name the keys.
_FLAGS = {
    "parallelism.pipeline_parallel_degree": "--pp",
    "parallelism.pipeline_parallel_schedule": "--pp-schedule",
    "parallelism.pipeline_parallel_microbatch_size": "--pp-microbatch-size",
    "parallelism.pipeline_parallel_layers_per_stage": "--pp-layers-per-stage",
    "parallelism.pipeline_parallel_first/last_stage_less_layers": "--pp-first/last-stage-less-layers",
    "parallelism.tensor_parallel_degree": "--tp",
    "parallelism.context_parallel_degree": "--cp",
    "parallelism.data_parallel_replicate_degree": "--replicate",
    "training.local_batch_size": "--local-batch-size",
    "training.seq_len": "--seq-len",
}


def _as_flags(problem: str) -> str:
    for key, flag in _FLAGS.items():
        problem = problem.replace(key, flag).replace(key.split(".")[1], flag)
    return problem


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.references:
        print(references())
        return 0
    fam = family(args.model)
    if args.flavor not in fam.flavors and args.flavor not in fam.flavor_aliases:
        names = ", ".join([*fam.flavors, *fam.flavor_aliases])
        other = [n for n in NAMES if n != args.model and args.flavor in family(n).flavors]
        print(
            f"error: --flavor: {args.flavor!r} is no {args.model} flavor (choose from {names})"
            + (f"; or pass --model {other[0]}" if other else ""),
            file=sys.stderr,
        )
        return 2
    group = args.pp * args.tp * args.replicate * args.cp
    if args.ngpu < 1 or args.ngpu % group:
        print(
            f"error: --ngpu: {args.ngpu} GPUs do not split into groups of --pp {args.pp} x --replicate "
            f"{args.replicate} x --cp {args.cp} x --tp {args.tp} = {group}; use a multiple of that",
            file=sys.stderr,
        )
        return 2
    try:
        job = Job(
            family=args.model,
            flavor=args.flavor,
            ngpu=args.ngpu,
            tp=args.tp,
            replicate=args.replicate,
            seq_len=args.seq_len,
            local_batch_size=args.local_batch_size,
            grad_accum=args.grad_accum,
            param_dtype=args.param_dtype,
            reduce_dtype=args.reduce_dtype,
            ac=args.ac,
            cpu_offload=args.cpu_offload,
            defer_reduce_scatter=args.defer_reduce_scatter,
            rmsnorm=args.rmsnorm,
            logits_kept_in_backward=args.keep_logits,
            loss_chunk_tokens=args.loss_chunk_tokens,
            pp=args.pp,
            pp_schedule=args.pp_schedule,
            pp_microbatch_size=args.pp_microbatch_size,
            pp_layers_per_stage=args.pp_layers_per_stage,
            pp_first_stage_less_layers=args.pp_first_stage_less_layers,
            pp_last_stage_less_layers=args.pp_last_stage_less_layers,
            allocator=args.allocator,
            overhead_gib=args.overhead_gib,
            cp=args.cp,
        )
        if args.pp_rank is not None and not 0 <= args.pp_rank < job.pp:
            raise ValueError(f"pp-rank: expected 0 to {job.pp - 1}, got {args.pp_rank}")
    except ConfigError as e:
        print("\n".join(f"error: {_as_flags(problem)}" for problem in e.problems), file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(breakdown(job, args.pp_rank))
    if args.fake_step:
        try:
            print(fake_breakdown(job, 0 if args.pp_rank is None else args.pp_rank))
        except ValueError as e:  # a job the fake step cannot run (interleaved schedules, context parallel)
            print(f"error: --fake-step: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
