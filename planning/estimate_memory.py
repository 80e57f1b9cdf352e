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
import dataclasses
import functools
import re
import sys
import time
from typing import Any

from config import JobConfig
from errors import ConfigError
from planning.fake_step import fake_job_memory
from planning.flags import DEFAULTS, FLAGS, job
from planning.job import GiB, Job, Machine
from planning.memory import DTYPE_BYTES, FRAGMENTATION, estimate, estimate_rank, layer_modes
from planning.references import REFERENCES


def _row(label: str, value: float, note: str = "") -> str:
    return f"  {label:<30} {value / GiB:8.2f} GiB" + (f"   {note}" if note else "")


def breakdown(job: Job, pp_rank: int | None = None) -> str:
    """The per-GPU breakdown as printed by the script: of `pp_rank`, or of the rank that needs the most."""
    e = estimate(job) if pp_rank is None else estimate_rank(job, pp_rank)
    rows = [*_state_rows(job, e), *_teacher_rows(job, e), *_activation_rows(job, e), *_peak_rows(job, e)]
    return "\n".join([_heading(job, e, pp_rank), *rows])


def _heading(job: Job, e: dict[str, Any], pp_rank: int | None) -> str:
    """The job in one line; under PP a second one: the schedule and the rank broken down."""
    d, t, ac, par = job.dims, job.cfg.training, job.cfg.activation_checkpoint, job.cfg.parallelism
    shard = f"shard {d.dp_shard} x cp {d.cp}" if d.cp > 1 else f"shard {job.shard}"
    pp = f"pp {d.pp} x " if d.pp > 1 else ""
    ep = f" (ep {d.ep} x efsdp {job.efsdp})" if d.ep > 1 else ""
    ac_mode = f"selective-{ac.selective_ac_option}" if ac.mode == "selective" else ac.mode  # as --ac spells it
    heading = (
        f"{job.cfg.model.name} {job.cfg.model.flavor}: {job.fam.num_params(job.args) / 1e9:.2f}B params | "
        f"{d.world_size} GPUs = {pp}replicate {d.dp_replicate} x {shard} x tp {d.tp}{ep} | local batch "
        f"{t.local_batch_size} x {t.seq_len} tokens, grad accumulation {job.grad_accum} | params "
        f"{t.mixed_precision_param}, reduce {t.mixed_precision_reduce} | AC {ac_mode} | RMSNorm {job.machine.norm}"
        + (" | CPU offload" if job.cpu_offload else "")
        + (f" | LoRA r {job.lora.r} on {', '.join(_lora_targets(job))}" if job.lora is not None else "")
    )
    if d.pp == 1:
        return heading
    which = "the worst" if pp_rank is None else "asked for"
    return (
        f"{heading}\n  pipeline: {par.pipeline_parallel_schedule}, {job.microbatches} micro-batches of "
        f"{par.pipeline_parallel_microbatch_size} x {t.seq_len} tokens, {len(job.stages)} stages | pp rank "
        f"{e['pp_rank']} ({which}): stage(s) "
        f"{e['pp_stages']}, {e['rank_blocks']} blocks, up to {e['microbatches_held']} micro-batch(es) in flight"
    )


def _state_rows(job: Job, e: dict[str, Any]) -> list[str]:
    """The sharded state, the gathered parameters and the unsharded gradients."""
    if job.dims.pp > 1:
        grads = "reduce-scattered at the end of the step"
        gathered = "the rank's stages, from their first forward to the end of the step"
        accumulators = "unsharded, reduce_dtype, from a stage's first backward"
        unsharded = _row("gradient accumulators", e["accumulators"], accumulators)
    else:
        grads = "reduce-scattered block by block in backward"
        units = f"norm+output unit {e['output_unit'] / GiB:.2f}, + 2 blocks x {e['block_unit'] / GiB:.2f}"
        if job.dims.ep > 1:
            units += f" (this rank's experts {e['experts_unit'] / GiB:.2f} of it)"
        gathered = f"{units} in backward"
        unsharded = _row("root unit's gradient", e["root_grad"], "unsharded, param_dtype, loss backward to the end")
    deferred = []
    if job.defers_reduce_scatter:
        grads = "reduce-scattered in the step's last micro-batch"
        what = "unsharded, reduce_dtype, first backward to the step's last (fsdp_defer_reduce_scatter)"
        deferred = [_row("gradient accumulators", e["accumulators"], what)]
    sharded = "4 B per parameter of the rank / (shard x tp)"
    if job.dims.ep > 1:
        sharded = (
            f"4 B per parameter: the dense ones / (shard x tp), the experts / (ep {job.dims.ep} x efsdp {job.efsdp})"
        )
    if job.lora is not None:
        unsharded = _row("root unit's gradient", 0.0, "none: the output and the embedding are frozen")
        dtype = job.cfg.training.mixed_precision_param
        per_rank = f"{e['adapter_params']:,.0f} adapter parameters on the rank before FSDP (A r x in, B out x r)"
        weights = [
            _row(f"frozen base ({dtype} shards)", e["frozen_params"], "no gradients, no optimizer state"),
            _row("adapters' fp32 params", e["params"] - e["frozen_params"], per_rank),
        ]
    else:
        weights = [_row("sharded fp32 params", e["params"], sharded)]
    return [
        *weights,
        _row("AdamW state (2 x fp32)", e["adam"])
        if not job.muon
        else _row("Muon + AdamW state", e["adam"], "fp32: Muon's momentum of the hidden matrices, AdamW's 2 moments"),
        _row("gradients (fp32 shards)", e["grads"], f"{grads}; {e['grads_at_peak'] / GiB:.2f} GiB of them at the peak"),
        _row("  -> on the GPU", e["state_on_gpu"], f"host: {e['state_on_host'] / GiB:.2f} GiB" * job.cpu_offload),
        _row("gathered params in flight", max(e["gathered_loss_phase"], e["gathered_block_phase"]), gathered),
        unsharded,
        *deferred,
    ]


def _lora_targets(job: Job) -> list[str]:
    """The Hugging Face names of the linears [lora] puts adapters on (lora.py target_names)."""
    from lora import target_names  # a leaf of the recipe: loaded only for a job with adapters

    return target_names(job.fam, job.args, job.lora)


def _teacher_rows(job: Job, e: dict[str, Any]) -> list[str]:
    """[distill]'s frozen teacher (planning/memory.py `_Teacher`): its weights, what it keeps, what the loss adds."""
    if not job.cfg.distill.enable:
        return []
    from distill import teacher_config

    m = teacher_config(job.cfg).model
    name = f"{m.name} {m.hf_assets_path if m.shape_from_hf_config else m.flavor}"
    return [
        _row("teacher's params (fp32 shards)", e["teacher_params"], f"{name}: no gradients, no optimizer state"),
        _row("teacher's root unit", e["teacher_root"], "norm + output in param_dtype, gathered from its forward on"),
        _row("teacher's hidden states", e["teacher_hidden"], "to the loss backward; no_grad keeps no activations"),
        _row("teacher's logits + divergence", e["teacher_loss"], "at the loss phase, beside the student's"),
    ]


def _activation_rows(job: Job, e: dict[str, Any]) -> list[str]:
    """The activations, the loss's buffers, one block's backward and the pipeline's buffers."""
    checkpointed = (
        f", {e['act_per_block_checkpointed'] / GiB:.3f} checkpointed"
        if job.cfg.activation_checkpoint.mode != "none"
        else ""
    )
    held = f", {e['microbatches_held']} micro-batch(es) of them held" if job.dims.pp > 1 else ""
    per_block = f"per micro-batch{held}; per block {e['act_per_block_no_ac'] / GiB:.3f} without AC{checkpointed}"
    exchange = f" + EP rows in flight {e['ep_exchange'] / GiB:.2f}" if job.dims.ep > 1 else ""
    block_backward = (
        f"recompute {e['recompute'] / GiB:.2f} + activation grads {e['grad_acts'] / GiB:.2f}{exchange} "
        f"+ unsharded grads/RS {e['rs_buffers'] / GiB:.2f}"
    )
    rows = [
        _row(f"activations, {e['rank_blocks']} blocks", e["act_blocks"], per_block),
        _row("activations outside blocks", e["act_outside_blocks"], "final norm, token ids"),
        _row("logits + loss buffers", e["loss_buffers"], _loss_note(job)),
        _row("one block's backward", e["block_backward"], block_backward),
    ]
    if job.dims.ep > 1:
        rows.append(_row("expert-parallel exchange", e["ep_exchange"], _exchange_note(job, e)))
    return rows + ([_row("pp send/recv buffers", e["pp_buffers"])] if job.dims.pp > 1 else [])


def _exchange_note(job: Job, e: dict[str, Any]) -> str:
    """What expert parallel's all-to-all moves per MoE block and where its rows are counted."""
    load = "balanced routing" if job.ep_load == 1 else f"{job.ep_load:g} x balanced routing's rows"
    return (
        f"per MoE block, {e['ep_rows']:,.0f} rows of {job.args.dim} received ({load}; no capacity factor: skew grows "
        "them); op SAC keeps both ways' rows"
    )


def _loss_note(job: Job) -> str:
    """The logits the loss buffers are made of, and the bytes per logit."""
    tokens, param_bytes = job.microbatch_tokens, DTYPE_BYTES[job.cfg.training.mixed_precision_param]
    per_logit = (12 if job.dims.tp == 1 else 16) + (param_bytes if job.logits_kept_in_backward else 0)
    kept = "logits held through backward" if job.logits_kept_in_backward else "logits freed before backward"
    if job.chunk_tokens:
        tokens, per_logit = job.chunk_tokens, 8 + param_bytes + (8 if job.dims.tp == 1 else 12)
        output = "" if job.lora is not None else " and the output"  # LoRA: the output projection is frozen
        kept = f"chunked: one chunk of {tokens:,} tokens at a time + the gradients of the final norm's output{output}"
    return f"{tokens:,} x {job.args.vocab_size // job.dims.tp:,} logits x {per_logit} B ({kept})"


def _peak_rows(job: Job, e: dict[str, Any]) -> list[str]:
    """The allocated and reserved peaks, the overhead outside the allocator and the total."""
    muon = f", Muon's step {e['muon_step_phase'] / GiB:.2f}" if job.muon else ""
    if job.cfg.distill.enable:
        muon += f", teacher forward {e['teacher_forward_phase'] / GiB:.2f}"
    phases = (
        f"at the {e['peak_phase']}: static state + max(loss phase {e['loss_phase'] / GiB:.2f}, "
        f"block phase {e['block_phase'] / GiB:.2f}, embedding phase {e['embedding_phase'] / GiB:.2f}{muon})"
    )
    if job.machine.reserves:
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
    if job.dims.ep > 1:
        raise ValueError(
            "expert parallel reads its all-to-all's split sizes from the routing, which fake tensors do not have; "
            "the formulas' estimate is the breakdown above"
        )
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
        where = f"peak at the {e['peak_phase']}" + (f", pp rank {e['pp_rank']}" if ref.job.dims.pp > 1 else "")
        lines.append(f"{'':<52} {'':>6} {'':>6} {'':>6}  {ref.note}; {where}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The command's flags, and what is left: `--section.key value` overrides for the run's own loader."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
        epilog="Any other --section.key value sets that config key, as train.py takes it.",
    )
    p.add_argument("--config", help="a TOML of the run (default: the flags' config keys over " + _defaults() + ")")
    p.add_argument("--ngpu", type=int, default=8, help="GPUs in the job")
    defaults = JobConfig()
    for name, key in FLAGS.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(functools.reduce(getattr, key.split("."), defaults), bool):
            p.add_argument(flag, dest=name, action="store_true", default=None, help=key)
        else:
            p.add_argument(flag, dest=name, help=key + (" (selective-op, selective-<k>, full, none)" * (name == "ac")))
    p.add_argument(
        "--grad-accum",
        type=int,
        help="micro-batches per optimizer step (training.global_batch_size / (local batch x dp))",
    )
    p.add_argument("--pp-rank", type=int, default=None, help="break down this pp rank (default: the worst)")
    p.add_argument("--allocator", default="cuda", choices=["cuda", "cpu"], help="cpu: no caching allocator")
    p.add_argument("--overhead-gib", type=float, default=2.0, help="CUDA context + NCCL, outside the allocator")
    p.add_argument(
        "--rmsnorm", default="fused", choices=["fused", "composite"], help="fused kernel (torch >= 2.8 CUDA)"
    )
    p.add_argument("--keep-logits", action="store_true", help="a loop that holds the logits through backward")
    p.add_argument(
        "--fake-step",
        action="store_true",
        help="also step the job on fake tensors (fake_job_memory) and print torch's count next to the formula's",
    )
    p.add_argument("--references", action="store_true", help="compare with torchtitan's published peaks and exit")
    return p.parse_known_args(argv)


def _defaults() -> str:
    return ", ".join(f"{FLAGS[name]} = {value}" for name, value in DEFAULTS.items())


def _as_flags(problem: str) -> str:
    """A problem the loader states in config keys, in this command's flags (planning/flags.py FLAGS)."""
    for name, key in FLAGS.items():
        flag = "--" + name.replace("_", "-")
        problem = re.sub(rf"set {re.escape(key)} = '?([^';]+)'?", rf"pass {flag} \1", problem)
        problem = problem.replace(key, flag)
        bare = key.split(".")[1]
        if "_" in bare:  # a key's bare name in a sentence ("does not divide local_batch_size 16")
            problem = re.sub(rf"\b{bare}\b", flag, problem)
    return problem


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    if args.references:
        print(references())
        return 0
    flags = {name: getattr(args, name) for name in FLAGS}
    machine = Machine(
        cuda=True, caching_allocator=args.allocator == "cuda", overhead_gib=args.overhead_gib, rmsnorm=args.rmsnorm
    )
    try:
        the_job = job(
            args.ngpu, config=args.config, machine=machine, grad_accum=args.grad_accum, extra=overrides, **flags
        )
        the_job = dataclasses.replace(the_job, logits_kept_in_backward=args.keep_logits)
        layer_modes(the_job, [0])  # mode auto is chosen where the job starts: refused here in one line, naming the way
        if args.pp_rank is not None and not 0 <= args.pp_rank < the_job.dims.pp:
            raise ValueError(f"--pp-rank: expected 0 to {the_job.dims.pp - 1}, got {args.pp_rank}")
    except ConfigError as e:
        print("\n".join(f"error: {_as_flags(problem)}" for problem in e.problems), file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(breakdown(the_job, args.pp_rank))
    if args.fake_step:
        try:
            print(fake_breakdown(the_job, 0 if args.pp_rank is None else args.pp_rank))
        except ValueError as e:  # a job the fake step cannot run (interleaved schedules, context parallel, EP)
            print(f"error: --fake-step: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
