"""Predict per-GPU memory of a training setup before asking for GPUs (docs/failures.md #5).

    python -m planning.estimate_memory --flavor llama3_8b --ngpu 8 --local-batch-size 2 --ac selective-op
    python -m planning.estimate_memory --flavor llama3_70b --ngpu 64 --tp 8 --local-batch-size 8 --ac full
    python -m planning.estimate_memory --flavor llama3_405b --ngpu 512 --tp 8 --pp 8 --local-batch-size 8 --ac full
    python -m planning.estimate_memory --references   # against torchtitan's published peaks

Components, per GPU (formulas below, where each term is one tensor):

  sharded state     fp32 params and AdamW exp_avg + exp_avg_sq: 4 + 8 bytes per parameter /
                    (dp_shard x tp) (norm weights are not TP-sharded), for the whole run. bf16
                    param_dtype does not shrink them; --cpu-offload moves them to host memory.
  gradient shards   fp32, 4 bytes per parameter likewise, but not always there: train.py's
                    zero_grad(set_to_none=True) frees them before the first micro-batch, and FSDP
                    creates each block's shard when it reduce-scatters that block's gradient in
                    backward. So at the loss backward of a step of one micro-batch there are none; they
                    grow block by block while backward frees activations (the "block phase" below).
                    With gradient accumulation (--grad-accum > 1) the later micro-batches hold all of
                    them from start to end.
  gathered params   FSDP units all-gathered in param_dtype: the root unit (norm + output), gathered
                    for the whole step, and in backward two blocks (the one in backward and the
                    prefetched one). bf16 halves them.
  activations       per block, what one block of the job's model really saves for backward (a
                    trace on fake tensors, `block_costs`, under "Activations" below): without AC,
                    with the job's AC (full: the block input; selective op: the input + what the
                    family's SAC keeps; selective k: full AC on every k-th block), plus the final
                    norm and token ids. benchmarks/test_memory.py checks them against the bytes
                    benchmarks/memory.py measures per rank on real tensors.
  logits + loss     T x V/tp logits. Forward: bf16 logits + fp32 copy + fp32 log-softmax (saved)
                    = 2+4+4 bytes per logit. Start of backward (higher): the saved log-softmax +
                    the fp32 gradients of nll and of log-softmax = 12 bytes (tp = 1, fused
                    cross-entropy); under loss parallel (tp > 1) torch's DTensor backward keeps up
                    to 4 fp32 temporaries (zeros_like(x), exp(x), their sum, the product): 16 bytes.
                    train.py (like torchtitan) frees the logits before backward; --keep-logits adds
                    2 bytes per logit for a loop that holds them. The chunked loss
                    (--loss-chunk-tokens C, training.loss_chunk_tokens, loss.py) saves no logits:
                    backward recomputes C tokens at a time, a + 4 + 4 + (8 or 12) bytes per
                    logit of C x V/tp, plus the fp32 gradient of the final norm's output (4*T*D)
                    and the output projection's gradient, which the chunks accumulate (a*V*D/tp).
  root gradient     the unsharded gradient of the root unit (output projection + final norm) in
                    param_dtype, a*(V*D/tp + D): FSDP reduce-scatters it only when the whole backward
                    is over (the root's inputs are token ids, so its post-backward hook is the final
                    callback), so it is alive through every block's backward.
  block backward    the recomputation of one checkpointed block (what it did not keep), its
                    activation gradients (~2 T x D + 2 x the widest projection output) and its
                    unsharded gradient in param_dtype + the reduce_dtype copy FSDP reduce-scatters.
  peak (allocated)  state + the worst of the backward's phases, each a sum of what is alive then:
                      loss       root unit + all activations + logits/loss buffers (+ the chunked
                                 loss's output gradient), no gradient shards at grad_accum 1;
                      block i    root unit + two blocks + root gradient + the gradient shards of
                                 the blocks after i + the activations of blocks 0..i + block i's
                                 backward; evaluated for every block, which is exact within this
                                 model (it is linear between the first block, all activations and
                                 no shards, and the last, all shards and one block's activations,
                                 except where selective-k alternates block sizes);
                      embedding  root + embedding units, all shards, the embedding's dense
                                 gradient and its reduce_dtype copy (no activations left).
                    ~ torch.cuda.max_memory_allocated.
  reserved          torch.cuda.max_memory_reserved, what the caching allocator holds (see "Reserved").
  overhead          CUDA context, cuBLAS workspaces, NCCL buffers: a fixed --overhead-gib (default
                    2 GiB; ~0.5-1 for the context, ~1 for NCCL on 8 GPUs), outside PyTorch's allocator.
  total             reserved + overhead: what planning/doctor.py compares with the device's memory.

Reserved. The caching allocator keeps freed blocks in a pool per CUDA stream, and a block cached by
one stream serves no other. FSDP2 (torch 2.13, _fsdp_collectives.py) allocates each unit's gradient
shards in the reduce-scatter stream and its flat all-gather output in the all-gather copy-in stream,
and the rest (unsharded parameters, activations, temporaries) in the compute stream. Hence:

    reserved = sharded params + AdamW state                  allocated once, never freed
             + gradient shards                               reduce-scatter stream: zero_grad frees
                                                             them, only the next step's
                                                             reduce-scatters reuse them, so they
                                                             count also at a peak that comes first
             + a x max(largest unit, 2 blocks)               all-gather stream: the flat outputs
                                                             in flight
             + (1 + FRAGMENTATION) x compute-stream peak     allocated peak - state - shards at it

FRAGMENTATION (rounding, split blocks too small for the next request, and whatever transient the
model misses) is calibrated on torchtitan's two reserved peaks that differ only in the sharded state
(REFERENCES: eager FSDP, 8B, batch 2 x 8192, op SAC): 82.4 GiB on 8 GPUs, 67.0 on 128. Both peaks
are at the loss backward, where the compute stream holds 56.2 GiB in either job; the rest of the rule
is 15.9 and 1.9 GiB. The 15.4 GiB the published peaks differ by is what the stream pools predict
(14.0: 16 bytes per parameter / 8 - / 128), not what the allocated peaks do (10.5: no gradients at
the loss backward). Each reference alone asks for 18.4% and 15.9%; their mean, 17%, puts both
within 1% (81.6 and 67.6 GiB). Without the caching allocator (--allocator cpu: CPU ranks)
reserved = allocated.

Pipeline parallel (--pp, parallelisms/pp.py). The stages come from parallelisms.pp.stage_layers
(the run's own split); pp rank r runs stages r, r + pp, ... Each rank is estimated and the worst
reported (--pp-rank picks one). What changes on a rank:
  * parameters: its stages' blocks, the embedding on stage 0, norm + output on the last, each
    sharded over dp_shard x tp; the others' are not there.
  * FSDP does not reshard after forward (parallelisms/fsdp.py), and torch's pipeline stages run every
    backward without gradient sync and without resharding, then reduce-scatter once after the step's
    last (pipelining/stage.py: set_requires_gradient_sync(False), perform_reduce_grad): the
    rank's stages stay gathered in param_dtype (a bytes per parameter of the rank, / tp) from their
    first forward to the end of the step, and their gradients accumulate unsharded in reduce_dtype
    (FSDP's unsharded_accumulated_grad: r bytes) from each stage's first backward on; the
    reduce-scatter to fp32 shards happens once, at the end of the step.
  * activations: per micro-batch (pp_microbatch_size sequences), for each micro-batch a stage has run
    forward on and not yet backward, plus the stage's output (a*T*D/tp, kept for its backward) on all
    but the last stage. The rank's forward and backward order is the schedule's:
      GPipe          every micro-batch's forward, then every backward: n_mb held;
      1F1B           stage s of S runs min(n_mb, S - s) forwards, then backward/forward pairs, so it
                     holds min(n_mb, S - s) during each backward (torch's Schedule1F1B);
      Interleaved1F1B, InterleavedZeroBubble: the order torch plans for the rank
                     (_calculate_single_rank_operations, torch 2.13), replayed; a micro-batch holds
                     one stage's activations. Zero bubble splits backward into input (I) and weight
                     (W) gradients: between the two a micro-batch is counted with the inputs its
                     weight gradients need (per block: the activations its matmuls read, traced), an
                     estimate that ignores what autograd frees earlier.
  * the loss phase only on the rank with the last stage; the embedding phase only on stage 0.
  * pp send/recv buffers: one micro-batch's hidden states each way, 2*a*T*D/tp.
The estimate replays the rank's order and takes the worst phase of every backward it runs.

Not modelled: torch.compile (fuses norms/activations and lowers the transient terms), float8,
context parallel, fsdp_reshard_after_forward = "never", the optimizer step's temporaries (fused
AdamW has none; the step comes after the activations are freed, and reuses their cached blocks).

Fake-tensor step (fake_step_memory, fake_job_memory, --fake-step). torch's own count of a whole step
instead of this model: the job's model (or pp rank's stage) built on the meta device, parallelized by
parallelize_model on a fake process group of the job's ranks, materialized as fake tensors (no
memory, no compute) and stepped as train.py steps it under torch's FSDPMemTracker, which files every
tensor under a category (sharded/unsharded parameters and gradients, activations, backward
temporaries, optimizer state, collective buffers) and keeps the breakdown at the peak. Without TP it
counts what the same tracker counts on real tensors over gloo; under TP it over-counts (torch 2.13:
one fp32 logits-sized tensor of the loss-parallel forward, probably a collective's output that fake
tensors allocate where the real all-reduce works in place), so read it as an upper bound there. How
close the two are, and how long each takes: docs/benchmarks.md ("Estimator").

Activations. Every per-block number comes from the model itself: `trace_costs` runs one forward and
backward of a one-block model of the job's family, parallelized as the run parallelizes it (the
family's TP plan over a TP mesh, `apply_ac` with the family's SAC list), on fake tensors, and watches
every op. What a block saves is the storages its ops created (or received) that are still alive once
forward is over, parameters and buffers excepted: exactly what autograd, a checkpoint or selective
AC's cache holds, whatever the block computes (SwiGLU or not, QK-norm or not). The same trace gives
the widest output of a column-parallel projection (two of them and two T x D gradients are the
block's backward working set), the activations its matmuls read (what zero bubble's weight gradients
keep), and the bytes of the TP collectives of its forward and backward (the dry run's TP line). The
kernels are the CPU's; the one difference that matters on CUDA is nn.RMSNorm, a fused kernel there
(PyTorch >= 2.8) that saves its input and an fp32 scale per row where the CPU's composite one saves
fp32 copies: with rmsnorm "fused" the trace counts each RMSNorm of an uncheckpointed block so. The
rest (gathered units in flight, allocator and CUDA/NCCL overhead) is a model, stated term by term.

Notation (per rank): T = local_batch_size x seq_len tokens (pp_microbatch_size x seq_len under PP);
D = dim; V = vocab; a = bytes per element of the compute dtype (FSDP param_dtype: 2 for bf16, 4 for
fp32); r = bytes of reduce_dtype; t = TP degree (sequence parallel on: the residual stream and the
norms see T/t tokens, the projections' inputs are gathered to all T).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
import time
import types
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.multiprocessing.reductions import StorageWeakRef

# TorchDispatchMode is the documented way to see every aten op, in a private module (PyTorch 2.13).
from torch.utils._python_dispatch import TorchDispatchMode

from config import JobConfig, Parallelism, Training, global_batch_size, grad_accum_steps, model_args, selective_ac_every
from errors import ConfigError, warn
from loss import chunk_tokens_for
from models import NAMES, ModelFamily, family, with_seq_len
from parallelisms.fsdp import applies_fsdp
from parallelisms.parallel_dims import ParallelDims, layout_problems
from parallelisms.pp import SCHEDULES, rank_stages, stage_layers

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
AC_MODES = ("none", "full", "selective-op", "selective-2")
RMSNorm = Literal["fused", "composite"]
# Compute-stream bytes the caching allocator reserves beyond the allocated peak, as a share of it:
# calibrated on torchtitan's 8B peaks (module docstring, "Reserved").
FRAGMENTATION = 0.17


# ----------------------------------------------------------------- AC modes


def checkpoint_every(ac: str) -> int:
    """apply_ac's rule for `ac`: block i (its position in the model or pipeline stage) is checkpointed when
    every > 0 and (i + 1) % every == 0; 0 = none, 1 = every block (full, selective-op), k = selective-<k>."""
    match ac:
        case "none":
            return 0
        case "full" | "selective-op":
            return 1
        case _ if ac.startswith("selective-") and selective_ac_every(ac.removeprefix("selective-")) is not None:
            return int(ac.removeprefix("selective-"))
    raise ValueError(f"ac: expected one of none, full, selective-op, selective-<k>, got {ac!r}")


def checkpointed_blocks(n_layers: int, ac: str) -> int:
    """How many of n_layers blocks apply_ac checkpoints for `ac` (none, full, selective-op, selective-<k>)."""
    every = checkpoint_every(ac)
    return sum(every > 0 and (i + 1) % every == 0 for i in range(n_layers))


# ----------------------------------------------------------------- the model's costs


@dataclass(frozen=True)
class BlockCosts:
    """What one rank holds and moves for the model's parts per micro-batch, read off one traced step
    (`trace_costs`): parameters after TP, before FSDP; bytes of the tensors themselves."""

    block_params: int
    """Parameters of one block on this rank (TP splits some)."""
    embedding_params: int
    """Of the embedding unit (0 when tied: the matrix lives in the root unit)."""
    root_params: int
    """Of the root unit: final norm + output projection (or the tied matrix)."""
    saved: int
    """Bytes one block saves for backward without activation checkpointing, its input included when saved."""
    kept: int
    """Bytes a block keeps from forward to backward under the AC mode (its input and, for op SAC, its cache)."""
    widest: int
    """Bytes of the widest output of a block's column-parallel (or unsplit) linear, per rank."""
    matmul_inputs: int
    """Bytes of the distinct activations a block's linears read: what its weight gradients need."""
    final_norm: int
    """Bytes the final norm saves, its output excluded (the loss keeps the gathered output)."""
    tp_block: dict[str, int]
    """Bytes of the TP collectives of one block (full tensors; an all-reduce's twice), forward and backward
    (recomputation included), by kind: all_gather, reduce_scatter, all_reduce."""
    tp_embedding: dict[str, int]
    """The same for the embedding (the first pipeline stage's)."""
    tp_head: dict[str, int]
    """The same for the final norm, the output projection and the loss (the last stage's)."""
    tp_replicated: tuple[int, int] = (0, 0)
    """Parameters TP leaves whole on every rank (the norms' weights), of a block and of the root unit: their gradients
    are all-reduced over the TP ranks by every micro-batch's backward."""


_TRACES: dict[tuple, BlockCosts] = {}


def block_costs(
    family: ModelFamily,
    args: Any,
    *,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    ac: str,
    tp: int = 1,
    rmsnorm: RMSNorm = "fused",
    tp_mesh: DeviceMesh | None = None,
    loss_parallel: bool = True,
    loss_chunk_tokens: int = 0,
    z_loss: bool = False,
    autocast: bool = False,
) -> BlockCosts:
    """The costs of `trace_costs` under `ac` (an AC mode of `checkpoint_every`; "selective-<k>" is traced as full
    AC, which is what the blocks it checkpoints get), `saved` from a trace without AC; cached per shape.

    tp > 1 needs a TP mesh: `tp_mesh` (the run's mesh["tp"] when a process group runs), else a fake
    process group of tp ranks is started for the trace and ended after it."""
    mode = "none" if checkpoint_every(ac) == 0 else "op" if ac == "selective-op" else "full"
    traced = {}
    for m in dict.fromkeys(("none", mode)):
        key = (
            family.name,
            args,
            batch,
            seq_len,
            dtype,
            m,
            tp,
            rmsnorm,
            loss_parallel,
            loss_chunk_tokens,
            z_loss,
            autocast,
        )
        if key not in _TRACES:
            with _tp_mesh(tp, tp_mesh) as mesh:
                _TRACES[key] = trace_costs(
                    family,
                    args,
                    batch=batch,
                    seq_len=seq_len,
                    dtype=dtype,
                    ac=m,
                    rmsnorm=rmsnorm,
                    tp_mesh=mesh,
                    loss_parallel=loss_parallel,
                    loss_chunk_tokens=loss_chunk_tokens,
                    z_loss=z_loss,
                    autocast=autocast,
                )
        traced[m] = _TRACES[key]
    return dataclasses.replace(traced[mode], saved=traced["none"].saved)


@contextlib.contextmanager
def _tp_mesh(tp: int, mesh: DeviceMesh | None) -> Iterator[DeviceMesh | None]:
    if tp == 1:
        yield None
        return
    if mesh is not None:
        assert mesh.size() == tp, f"a TP mesh of {mesh.size()} ranks for tp {tp}"
        yield mesh
        return
    if dist.is_initialized():
        raise ValueError(f"block_costs: tp {tp} needs a TP mesh; pass tp_mesh (a process group is running)")
    # torch's "fake" backend (torch.testing, PyTorch 2.13, as the dry run uses it): collectives that return at once.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        yield init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


OpCallback = Callable[[torch._ops.OpOverload, tuple[Any, ...], dict[str, Any], Any], None]


class _OpObserver(TorchDispatchMode):
    def __init__(self, on_op: OpCallback):
        super().__init__()
        self.on_op = on_op

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Let DTensor lower itself first (as CommDebugMode does): its local ops and collectives
        # come back here on plain tensors.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.on_op(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def observe_ops(on_op: OpCallback) -> Iterator[None]:
    """Call `on_op(op, args, kwargs, output)` after every aten/c10d op that runs inside (eager mode)."""
    with _OpObserver(on_op):
        yield


_WARNED_NORMS: set[tuple[str, str]] = set()


def _warn_unfused_norms(family: ModelFamily, block: nn.Module) -> None:
    """The fused-kernel correction knows nn.RMSNorm only: a family's own norm class (a module whose class name ends
    in "Norm") is counted as traced, the CPU's composite ops, which may overstate what it saves on CUDA. Said once."""
    for name, module in block.named_modules():
        kind = type(module).__name__
        if kind.endswith("Norm") and not isinstance(module, nn.RMSNorm) and (family.name, kind) not in _WARNED_NORMS:
            _WARNED_NORMS.add((family.name, kind))
            warn(
                f"estimate: {family.name}'s {name} is a {kind}, not nn.RMSNorm, whose fused CUDA kernel the estimate "
                "counts; it is counted as traced on this CPU (composite ops), which may overstate what it saves"
            )


def trace_costs(
    family: ModelFamily,
    args: Any,
    *,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    ac: Literal["none", "full", "op"],
    rmsnorm: RMSNorm = "fused",
    tp_mesh: DeviceMesh | None = None,
    loss_parallel: bool = True,
    loss_chunk_tokens: int = 0,
    z_loss: bool = False,
    autocast: bool = False,
) -> BlockCosts:
    """One forward and backward of a one-block model of `family` on fake tensors (no memory, no compute),
    parallelized as a run does it (the family's TP plan over `tp_mesh`, `apply_ac`; the loss.py loss of
    `loss_chunk_tokens` and `z_loss`, on vocabulary shards with `loss_parallel`), watched op by op: in `dtype`
    parameters as FSDP's mixed precision gives them, or with `autocast` in float32 parameters under autocast to
    `dtype`, as one rank trains (parallelisms/fsdp.py apply_autocast; its casts are activations then).

    Saved bytes are storages an op created that are still alive once forward is over (what autograd, a
    checkpoint or selective AC's cache hold), parameters and buffers not counted. So every term is
    whatever the family's modules really keep, SwiGLU or not. The kernels are this machine's (the
    CPU's); one difference matters on CUDA: nn.RMSNorm is a fused kernel there (PyTorch >= 2.8) that
    saves its input and one fp32 scale per row, where the CPU's composite one saves fp32 copies. With
    rmsnorm "fused" the trace counts each RMSNorm of an uncheckpointed block (and the final one) so.
    """
    from config import ActivationCheckpoint
    from loss import Loss
    from parallelisms.ac import apply_ac
    from parallelisms.fsdp import apply_autocast
    from parallelisms.tp import apply_tp, loss_parallel_context

    one = dataclasses.replace(args, n_layers=1, max_seq_len=seq_len, attn_mask_type="causal")
    with torch.device("meta"):
        model = family.model_cls(one).to(torch.float32 if autocast else dtype)
    model.init_buffers(torch.device("meta"))  # float32 again, as in training: FSDP's mixed precision casts parameters
    if autocast:
        apply_autocast(model, param_dtype=dtype, device_type="cpu")
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, block_plan=family.tp_plan, loss_parallel=loss_parallel, seq_len=seq_len)
    if ac != "none":
        cfg = ActivationCheckpoint(mode="full" if ac == "full" else "selective", selective_ac_option="op")
        apply_ac(model, cfg, saved_linears=family.sac_saved_linears)
    block = model.layers["0"]
    if rmsnorm == "fused":
        _warn_unfused_norms(family, block)
    tp = tp_mesh.size() if tp_mesh is not None else 1
    watch = _Watch(model, block, tp=tp)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        watch.skip |= {_key(_local(t)) for t in [*model.parameters(), *model.buffers()]}
        tokens, labels = (torch.randint(0, one.vocab_size, (batch, seq_len)) for _ in range(2))
        # The step's loss, as train.py computes it: its collectives count with the output projection's.
        with loss_parallel_context(tp_mesh is not None and loss_parallel):
            with observe_ops(watch.on_op):
                loss_fn = Loss(loss_chunk_tokens, z_loss_weight=1.0 if z_loss else 0.0)
                loss = model(tokens, head=functools.partial(loss_fn, model, labels=labels))
            watch.phase = "after"
            saved, final_norm = watch.saved(block), watch.saved(model.norm)
            if rmsnorm == "fused":
                final_norm += watch.fused_correction(model.norm)
                if ac == "none":
                    saved += sum(watch.fused_correction(m) for m in block.modules() if isinstance(m, nn.RMSNorm))
            watch.phase = "backward"
            with observe_ops(watch.on_op):
                loss.backward()
    embedding = 0 if one.tie_word_embeddings else _numel(model.tok_embeddings)
    root = _numel(model.norm) + (_numel(model.output) if model.output is not None else _numel(model.tok_embeddings))
    return BlockCosts(
        block_params=_numel(block),
        embedding_params=embedding,
        root_params=root,
        saved=saved,
        kept=saved,
        widest=max(watch.linear_outputs, default=0),
        matmul_inputs=sum(watch.linear_inputs.values()),
        final_norm=final_norm,
        tp_block=dict(watch.comm["block"]),
        tp_embedding=dict(watch.comm["embedding"]),
        tp_head=dict(watch.comm["head"]),
        tp_replicated=(_replicated_numel(block), _replicated_numel(model.norm)) if tp_mesh is not None else (0, 0),
    )


def _replicated_numel(module: nn.Module) -> int:
    """Parameters of `module` that TP replicates (DTensors placed Replicate() on every mesh dimension)."""
    return sum(
        p.numel()
        for p in module.parameters()
        if isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements)
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def _numel(module: nn.Module) -> int:
    return sum(_local(p).numel() for p in module.parameters())


class _Watch:
    """The bookkeeping of trace_costs: which storages each part of the model created and which survive, the
    linears' inputs and outputs, and the bytes of the collectives, by phase of the step."""

    # Functional collectives (DTensor's): their kind, which tensor is the full one (its bytes count) and how often (an
    # all-reduce's twice: a ring all-reduce sends as much as a reduce-scatter plus an all-gather).
    _COLLECTIVES = {
        "all_gather_into_tensor": ("all_gather", "out", 1),
        "reduce_scatter_tensor": ("reduce_scatter", "in", 1),
        "all_reduce": ("all_reduce", "in", 2),
    }

    def __init__(self, model: nn.Module, block: nn.Module, *, tp: int):
        self.phase = "forward"  # forward, block forward, after, backward, block backward
        self.part = "embedding"  # outside the block: before it in forward (after it in backward), or the head
        self.skip: set[int] = set()
        self.created: dict[int, tuple[StorageWeakRef, int]] = {}  # every storage an op made, and its bytes
        self.windows: dict[nn.Module, dict] = {}  # module -> its forward's input, output and the storages it made
        self.linear_outputs: list[int] = []
        self.linear_inputs: dict[int, int] = {}
        self.comm: dict[str, Counter[str]] = defaultdict(Counter)  # part -> kind -> bytes
        self._open: list[nn.Module] = []
        self.block = block
        watched = [block, model.norm, *(m for m in block.modules() if isinstance(m, nn.RMSNorm))]
        for module in dict.fromkeys(watched):
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit)
        for linear in block.modules():
            if isinstance(linear, nn.Linear):
                # Column-parallel (or unsplit): the output is split over the TP ranks, its width / tp.
                columns = tp == 1 or getattr(linear.weight, "placements", (None,))[0] == Shard(0)
                linear.register_forward_hook(functools.partial(self._linear, columns))
        block.register_forward_pre_hook(self._mark_block_input)
        block.register_forward_hook(self._mark_block_output)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        if self.phase.endswith("forward") and module not in self.windows:  # the first call, not a recomputation
            x = _local(args[0])
            self.windows[module] = {"input": (StorageWeakRef(x.untyped_storage()), x.untyped_storage().nbytes()),
                                    "rows": x.numel() // x.shape[-1], "made": set(), "output": None}  # fmt: skip
            self._open.append(module)
            if module is self.block:
                self.phase = "block forward"

    def _exit(self, module: nn.Module, args: tuple, out: Any) -> None:
        if self._open and self._open[-1] is module:
            self._open.pop()
            self.windows[module]["output"] = _key(_local(out))
            if self.phase == "block forward" and module is self.block:
                self.phase, self.part = "forward", "head"

    def _mark_block_input(self, module: nn.Module, args: tuple) -> None:
        if self.phase.endswith("forward"):
            args[0].register_hook(self._block_backward_end)  # its gradient is the block backward's last

    def _mark_block_output(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(self._block_backward_start)

    def _block_backward_start(self, grad: torch.Tensor) -> None:
        self.phase = "block backward"

    def _block_backward_end(self, grad: torch.Tensor) -> None:
        self.phase, self.part = "backward", "embedding"

    def _linear(self, columns: bool, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if self.phase == "block forward":
            if columns:
                self.linear_outputs.append(_local(out).untyped_storage().nbytes())
            x = _local(args[0])
            self.linear_inputs[_key(x)] = x.untyped_storage().nbytes()

    def on_op(self, op: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> None:
        if self.phase == "after":
            return
        name = op._opname if op.namespace == "_c10d_functional" else ""
        if name in self._COLLECTIVES:
            kind, which, times = self._COLLECTIVES[name]
            tensor = out if which == "out" else args[0]
            part = "block" if self.phase.startswith("block") else self.part
            self.comm[part][kind] += times * tensor.numel() * tensor.element_size()
        if self.phase.endswith("backward"):
            return
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.skip and ref.cdata not in self.created:
                    self.created[ref.cdata] = (ref, t.untyped_storage().nbytes())
                    for module in self._open:
                        self.windows[module]["made"].add(ref.cdata)

    def _alive(self, keys: set[int]) -> int:
        return sum(self.created[k][1] for k in keys if not self.created[k][0].expired())

    def saved(self, module: nn.Module) -> int:
        """Bytes of what `module`'s forward made (its output excluded) or received that is still alive."""
        w = self.windows[module]
        ref, nbytes = w["input"]
        received = nbytes if not ref.expired() and ref.cdata not in w["made"] else 0
        return self._alive(w["made"] - {w["output"]}) + received

    def fused_correction(self, norm: nn.Module) -> int:
        """A fused RMSNorm's saved bytes (its input and one fp32 scale per row) minus the composite one's."""
        w = self.windows[norm]
        ref, nbytes = w["input"]
        return -self._alive(w["made"] - {w["output"]}) + 4 * w["rows"] + (nbytes if ref.expired() else 0)


# --------------------------------------------------------------- whole GPU


@dataclass(frozen=True)
class Job:
    """One training setup: what estimate() needs to know (the CLI's flags, or planning/doctor.py's config)."""

    flavor: str = "llama3_8b"
    family: str = "llama3"  # [model] name: the folder of models/ that has the flavor
    ngpu: int = 8  # ranks of the job (GPUs, or CPU processes)
    tp: int = 1
    replicate: int = 1
    seq_len: int = 8192
    local_batch_size: int = 1
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    ac: str = "selective-op"
    cpu_offload: bool = False
    rmsnorm: RMSNorm = "fused"
    # train.py, like torchtitan, deletes the logits before loss.backward(); a loop that keeps
    # them alive holds T x V/tp more elements in param_dtype through the loss backward.
    logits_kept_in_backward: bool = False
    # training.loss_chunk_tokens (-1: chunks where the logits are large, loss.py); 0 (torchtitan's loss, the
    # references') = all logits at once.
    loss_chunk_tokens: int = 0
    # Not parallelism.disable_loss_parallel: under TP the loss runs on vocabulary shards (its collectives).
    loss_parallel: bool = True
    z_loss_weight: float = 0.0  # training.z_loss_weight: the z-loss's collectives, under loss parallel
    overhead_gib: float = 2.0
    model: Any = None  # ModelArgs of a shape that is not a flavor (a Hugging Face config.json); flavor names it
    # Micro-batches per optimizer step: training.global_batch_size / (local_batch_size x dp). From the
    # second on, the gradient shards of the earlier ones are alive through forward and backward.
    grad_accum: int = 1
    # parallelism.fsdp_defer_reduce_scatter: with grad_accum > 1 (and FSDP, no PP), every unit's gradient stays
    # unsharded in reduce_dtype from the first micro-batch's backward to the step's last (parallelisms/fsdp.py).
    defer_reduce_scatter: bool = False
    # [parallelism] pipeline_parallel_degree, _schedule, _microbatch_size, _layers_per_stage,
    # _first_stage_less_layers, _last_stage_less_layers (torchtitan v0.2.2's meanings, parallelisms/pp.py).
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatch_size: int = 1
    pp_layers_per_stage: int | None = None
    pp_first_stage_less_layers: int = 1
    pp_last_stage_less_layers: int = 1
    # [parallelism] context_parallel_degree (parallelisms/cp.py): each rank holds seq_len / cp of every window.
    cp: int = 1
    # "cuda": the caching allocator reserves more than it allocates (module docstring, "Reserved");
    # "cpu": CPU ranks have none, reserved = allocated.
    allocator: Literal["cuda", "cpu"] = "cuda"

    def __post_init__(self) -> None:
        """The recipe's own rules (ParallelDims, the TP plan, the pipeline split and micro-batches) raise one
        ConfigError with all their problems; the estimator's own inputs ValueError."""
        problems = layout_problems(
            **self.parallelism.layout_settings(),
            world_size=self.ngpu,
            args=self.args,
            seq_len=self.seq_len,
            local_batch_size=self.local_batch_size,
        )
        if problems:
            raise ConfigError(*problems)
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name}: expected one of {', '.join(DTYPE_BYTES)}")
        checkpoint_every(self.ac)  # raises on a bad ac
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum: expected >= 1, got {self.grad_accum}")
        if self.allocator not in ("cuda", "cpu"):
            raise ValueError(f"allocator: expected cuda or cpu, got {self.allocator!r}")

    @property
    def fam(self) -> ModelFamily:
        return family(self.family)

    @property
    def args(self) -> Any:
        if self.model is not None:
            return self.model
        return self.fam.flavors[self.fam.flavor_aliases.get(self.flavor, self.flavor)]

    @property
    def parallelism(self) -> Parallelism:
        """The [parallelism] section of this job, for the run's own rules."""
        return Parallelism(
            data_parallel_replicate_degree=self.replicate,
            tensor_parallel_degree=self.tp,
            pipeline_parallel_degree=self.pp,
            pipeline_parallel_schedule=self.pp_schedule,
            pipeline_parallel_microbatch_size=self.pp_microbatch_size,
            pipeline_parallel_layers_per_stage=self.pp_layers_per_stage,
            pipeline_parallel_first_stage_less_layers=self.pp_first_stage_less_layers,
            pipeline_parallel_last_stage_less_layers=self.pp_last_stage_less_layers,
            context_parallel_degree=self.cp,
        )

    @property
    def shard(self) -> int:
        """The ranks FSDP shards parameters over: dp_shard x cp."""
        return self.ngpu // (self.pp * self.tp * self.replicate)

    @property
    def local_seq_len(self) -> int:
        """The tokens of each window this rank computes: seq_len / cp."""
        return self.seq_len // self.cp

    @property
    def stages(self) -> list[list[int]]:
        """The blocks of every (virtual) pipeline stage; one stage of all blocks without PP."""
        return stage_layers(self.args, self.parallelism) if self.pp > 1 else [list(range(self.args.n_layers))]

    @property
    def microbatches(self) -> int:
        """Micro-batches of the pipeline per local batch (1 without PP; grad_accum counts the loader's)."""
        return self.local_batch_size // self.pp_microbatch_size if self.pp > 1 else 1

    @property
    def microbatch_tokens(self) -> int:
        """T: the tokens one forward of a stage (or of the model, without PP) processes on this rank."""
        return (self.pp_microbatch_size if self.pp > 1 else self.local_batch_size) * self.local_seq_len

    @property
    def fsdp(self) -> bool:
        """Whether the run shards with FSDP; a job of one rank does not, and trains a bf16 param_dtype under autocast
        (parallelisms/fsdp.py applies_fsdp)."""
        dims = ParallelDims.from_config(self.parallelism, world_size=self.ngpu)
        return applies_fsdp(dims, param_dtype=self.param_dtype, cpu_offload=self.cpu_offload)

    @property
    def defers_reduce_scatter(self) -> bool:
        """parallelism.fsdp_defer_reduce_scatter where it changes something: FSDP, several micro-batches, no PP."""
        return self.defer_reduce_scatter and self.fsdp and self.grad_accum > 1 and self.pp == 1

    @property
    def accumulates_unsharded(self) -> bool:
        """Whether gradients are summed unsharded in reduce_dtype across micro-batches: pipeline stages always,
        FSDP when it defers its reduce-scatters."""
        return self.pp > 1 or self.defers_reduce_scatter

    @property
    def autocast(self) -> bool:
        return not self.fsdp and self.param_dtype != "float32"

    @property
    def chunk_tokens(self) -> int:
        """The loss's chunk for this job's micro-batches (loss.chunk_tokens_for of loss_chunk_tokens); 0 = whole."""
        shards = self.tp if self.loss_parallel else 1
        return chunk_tokens_for(
            self.loss_chunk_tokens, tokens=self.microbatch_tokens, vocab=self.args.vocab_size // shards
        )


_ACTIONS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def job_of(cfg: JobConfig, dims: ParallelDims, *, cuda: bool) -> Job:
    """A run's config as a Job (the doctor's memory check, the dry run): for CUDA GPUs, or for CPU ranks. ConfigError
    for a shape the layout cannot split, which the run itself refuses with its own message."""
    training, ac, par = cfg.training, cfg.activation_checkpoint, cfg.parallelism
    return Job(
        family=cfg.model.name,
        flavor=cfg.model.flavor,
        model=model_args(cfg.model),
        ngpu=dims.world_size,
        tp=dims.tp,
        replicate=dims.dp_replicate,
        seq_len=training.seq_len,
        local_batch_size=training.local_batch_size,
        grad_accum=grad_accum_steps(
            global_batch_size(training, dp=dims.dp), local_batch=training.local_batch_size, dp=dims.dp
        ),
        param_dtype=training.mixed_precision_param,
        reduce_dtype=training.mixed_precision_reduce,
        ac=f"selective-{ac.selective_ac_option}" if ac.mode == "selective" else ac.mode,
        cpu_offload=training.enable_cpu_offload and cuda,
        loss_chunk_tokens=training.loss_chunk_tokens,
        defer_reduce_scatter=par.fsdp_defer_reduce_scatter,
        loss_parallel=not par.disable_loss_parallel,
        z_loss_weight=training.z_loss_weight,
        pp=dims.pp,
        pp_schedule=par.pipeline_parallel_schedule,
        pp_microbatch_size=par.pipeline_parallel_microbatch_size,
        pp_layers_per_stage=par.pipeline_parallel_layers_per_stage,
        pp_first_stage_less_layers=par.pipeline_parallel_first_stage_less_layers,
        pp_last_stage_less_layers=par.pipeline_parallel_last_stage_less_layers,
        cp=dims.cp,
        # Eager CPU RMSNorm is the composite one; a CPU process has no CUDA context, NCCL buffers or caching
        # allocator.
        rmsnorm="fused" if cuda else "composite",
        overhead_gib=2.0 if cuda else 0.5,
        allocator="cuda" if cuda else "cpu",
    )


def rank_ops(schedule: str, *, pp_rank: int, pp: int, n_local: int, n_mb: int) -> list[tuple[str, int, int]]:
    """The forwards (F) and backwards (B; zero bubble: input I, weight W) pp rank `pp_rank` runs, in
    order, as (kind, local stage, micro-batch)."""
    match schedule:
        case "GPipe":
            return [("F", 0, m) for m in range(n_mb)] + [("B", 0, m) for m in range(n_mb)]
        case "1F1B":
            # torch's Schedule1F1B: stage s runs min(n_mb, S - s) forwards, then backward/forward pairs.
            warmup = min(n_mb, pp - pp_rank)
            ops = [("F", 0, m) for m in range(warmup)]
            for m in range(n_mb):
                ops += [("B", 0, m)] + ([("F", 0, warmup + m)] if warmup + m < n_mb else [])
            return ops
    # The interleaved schedules plan every rank's actions in __init__, which needs real PipelineStages
    # (a process group, a device). Their planner (private, torch 2.13) reads only these attributes;
    # the rounds are as in ScheduleInterleaved1F1B.__init__.
    rounds = max(1, n_mb // pp)
    plan = types.SimpleNamespace(
        n_local_stages=n_local, pp_group_size=pp, microbatches_per_round=n_mb // rounds, _n_microbatches=n_mb
    )
    actions = SCHEDULES[schedule].torch_class()._calculate_single_rank_operations(plan, pp_rank)
    return [
        (_ACTIONS[a.computation_type.name], a.stage_index // pp, a.microbatch_index) for a in actions if a is not None
    ]


def job_costs(job: Job, *, tp_mesh: DeviceMesh | None = None) -> BlockCosts:
    """block_costs of one micro-batch of `job` through one block, in its param_dtype. Under context parallel the
    block is traced on this rank's tokens, and attention's keys and values span the whole window (`cp_kv_bytes`)."""
    costs = block_costs(
        job.fam,
        job.args,
        batch=job.microbatch_tokens // job.local_seq_len,
        seq_len=job.local_seq_len,
        dtype=getattr(torch, job.param_dtype),
        ac=job.ac,
        tp=job.tp,
        rmsnorm=job.rmsnorm,
        tp_mesh=tp_mesh,
        loss_parallel=job.loss_parallel,
        loss_chunk_tokens=job.chunk_tokens,
        z_loss=job.z_loss_weight > 0,
        autocast=job.autocast,
    )
    extra = cp_kv_bytes(job)
    return dataclasses.replace(costs, saved=costs.saved + extra["saved"], kept=costs.kept + extra["kept"])


def cp_kv_bytes(job: Job) -> dict[str, int]:
    """What context parallel adds to one block's activations (parallelisms/cp.py), per micro-batch: attention
    saves its keys and values for the whole window instead of this rank's 1/cp of it, expanded to the query
    heads (grouped-query attention repeats them before SDPA): `saved`; op SAC keeps the all-gather's output,
    the window's keys and values at the KV heads, so that backward does not gather again: `kept`; one
    all-gather's payload, the window's keys and values: `gathered`; on CPU ranks, SDPA's dense additive mask of
    this rank's queries x the window, one per forward (models/attention.py; CUDA's BlockMask is a few KiB): `mask`.
    All 0 without context parallel."""
    if job.cp == 1:
        return dict.fromkeys(("saved", "kept", "gathered", "mask"), 0)
    args, param_bytes = job.args, DTYPE_BYTES[job.param_dtype]
    batch, window = job.microbatch_tokens // job.local_seq_len, job.seq_len
    head_bytes = batch * args.head_dim * param_bytes
    saved = 2 * head_bytes * (window - job.local_seq_len) * (args.n_heads // job.tp)
    gathered = 2 * head_bytes * window * (args.kv_heads // job.tp)
    mask = batch * job.local_seq_len * window * param_bytes if job.allocator == "cpu" else 0
    return {"saved": saved, "kept": gathered if job.ac == "selective-op" else 0, "gathered": gathered, "mask": mask}


def activation_bytes(job: Job, *, tp_mesh: DeviceMesh | None = None) -> dict[str, int]:
    """Bytes saved for backward at the end of one micro-batch's forward through the whole model (what
    benchmarks/memory.py measures), by part: the blocks, what lies outside them (token ids, the final
    norm and its gathered output), the loss's fp32 log-softmax."""
    costs, args, param_bytes = job_costs(job, tp_mesh=tp_mesh), job.args, DTYPE_BYTES[job.param_dtype]
    tokens, checkpointed = job.microbatch_tokens, checkpointed_blocks(job.args.n_layers, job.ac)
    blocks = (args.n_layers - checkpointed) * costs.saved + checkpointed * costs.kept
    outside = 16 * tokens + costs.final_norm + param_bytes * tokens * args.dim + cp_kv_bytes(job)["mask"]
    log_softmax = 4 * tokens * args.vocab_size // job.tp
    return {
        "per_block_no_ac": costs.saved,
        "per_block_checkpointed": costs.kept if checkpointed else 0,
        "blocks": blocks,
        "outside_blocks": outside,
        "log_softmax": log_softmax,
        "total": blocks + outside + log_softmax,
    }


# estimate_rank's terms, phase by phase: the parameters a rank holds and their sharded state (the whole step),
# the parameters gathered during backward, the activations a micro-batch leaves for backward, the transients of a
# backward; then a replay of the rank's schedule finds the worst moment, and the reserved bytes follow from it.


@dataclass(frozen=True)
class _RankParams:
    """The parameters of one pp rank as TP left them, before FSDP shards them (the family's plan splits a block's
    matmul weights, the skeleton's the vocabulary). A tied model's one matrix lives in the root unit
    (parallelisms/fsdp.py)."""

    stages: list[list[int]]
    """The blocks of every (virtual) pipeline stage of the job; one stage of all blocks without PP."""
    local: list[int]
    """The stages this rank runs."""
    block: int
    embedding: int
    root: int
    """The root unit: final norm + output projection (or the tied matrix)."""

    @property
    def last_stage(self) -> int:
        return len(self.stages) - 1

    def of_stage(self, stage: int) -> int:
        embedding = self.embedding if stage == 0 else 0
        root = self.root if stage == self.last_stage else 0
        return len(self.stages[stage]) * self.block + embedding + root

    @property
    def total(self) -> int:
        """Of all the rank's stages."""
        return sum(self.of_stage(stage) for stage in self.local)

    @property
    def largest_unit(self) -> int:
        """The largest FSDP unit of the rank: a block, or the embedding or root unit where the rank has them."""
        return max([self.block] + [self.embedding] * (0 in self.local) + [self.root] * (self.last_stage in self.local))


def _rank_params(job: Job, costs: BlockCosts, pp_rank: int) -> _RankParams:
    stages = job.stages
    local = rank_stages(pp_rank, pp=job.pp, stages=len(stages)) if job.pp > 1 else [0]
    return _RankParams(
        stages, local, block=costs.block_params, embedding=costs.embedding_params, root=costs.root_params
    )


@dataclass(frozen=True)
class _ShardedState:
    """The fp32 master state of a rank, FSDP's shards of what TP left: 4 bytes per parameter for the parameters,
    4 for the gradients, 8 for AdamW's two moments. On the GPU unless CPU offload moves it to the host."""

    params: float
    grads: float
    adam: float
    on_gpu: bool
    static: float
    """Allocated once and never freed, on the GPU: parameters and AdamW state."""
    block_grads: float
    """One block's gradient shards, on the GPU."""
    earlier_grads: float
    """The gradient shards of the step's earlier micro-batches (gradient accumulation), on the GPU."""


def _sharded_state(job: Job, params: _RankParams) -> _ShardedState:
    master, grads, adam = (n * params.total / job.shard for n in (4, 4, 8))
    on_gpu = not job.cpu_offload
    return _ShardedState(
        params=master,
        grads=grads,
        adam=adam,
        on_gpu=on_gpu,
        static=master + adam if on_gpu else 0.0,
        block_grads=4 * params.block / job.shard if on_gpu else 0.0,
        # (deferred reduce-scatters make no shards before the step's last micro-batch)
        earlier_grads=grads if on_gpu and job.grad_accum > 1 and not job.defers_reduce_scatter else 0.0,
    )


def _gathered_params(job: Job, params: _RankParams) -> dict[str, float]:
    """Bytes of the parameters gathered in param_dtype during each phase of backward (loss, block, embedding).

    Without PP the embedding and blocks are resharded after forward and the root (norm + output) is not; in
    backward one block is gathered plus the prefetched one, and the embedding is not gathered again (its backward
    does not read it, parallelisms/fsdp.py). Under PP the rank's stages stay gathered from their first forward to
    the end of the step."""
    param_bytes = DTYPE_BYTES[job.param_dtype]
    if not job.fsdp:
        # One rank, nothing gathered: under autocast each weight's param_dtype copy lives while autograd needs it, the
        # output projection's through the loss backward (chunked: the chunk term's), a block's through its backward
        # (saved without AC, counted with the activations then; cast again by the recomputation under AC).
        if not job.autocast:
            return dict.fromkeys(("loss", "block", "embedding"), 0.0)
        root = 0.0 if job.chunk_tokens else param_bytes * params.root
        return {"loss": root, "block": param_bytes * params.block, "embedding": 0.0}
    if job.pp > 1:
        return dict.fromkeys(("loss", "block", "embedding"), param_bytes * params.total)
    root = param_bytes * params.root
    return {"loss": root, "block": param_bytes * (params.root + 2 * params.block), "embedding": root}


@dataclass(frozen=True)
class _Activations:
    """What one micro-batch leaves for backward on this rank, as the trace found it: per block of a stage, and
    outside the blocks."""

    stages: list[list[int]]
    no_ac: int
    """One block's saved bytes without activation checkpointing."""
    checkpointed: int
    """What a checkpointed block keeps (its input; under op SAC also its cache)."""
    every: int
    """apply_ac's period (checkpoint_every)."""
    token_ids: int
    """Token ids and labels (int64), and CP's mask on CPU."""
    final_norm: int
    """The final norm's saves and its output, gathered over the sequence, which the loss keeps."""
    log_softmax: int
    """The loss's fp32 log-softmax (loss parallel keeps the vocabulary sharded); the chunked loss keeps none."""
    stage_output: float
    """Kept by a pipeline stage for its backward; the last stage's feeds the final norm."""

    def blocks(self, stage: int) -> list[int]:
        every = self.every
        checkpointed = [every and (i + 1) % every == 0 for i in range(len(self.stages[stage]))]
        return [self.checkpointed if ckpt else self.no_ac for ckpt in checkpointed]

    def outside(self, stage: int) -> float:
        last = stage == len(self.stages) - 1
        return self.token_ids + (self.final_norm + self.log_softmax if last else self.stage_output)


def _activations(job: Job, costs: BlockCosts, stages: list[list[int]]) -> _Activations:
    param_bytes, tokens, dim = DTYPE_BYTES[job.param_dtype], job.microbatch_tokens, job.args.dim
    chunked = job.chunk_tokens > 0
    return _Activations(
        stages=stages,
        no_ac=costs.saved,
        checkpointed=costs.kept,
        every=checkpoint_every(job.ac),
        token_ids=16 * tokens + cp_kv_bytes(job)["mask"],
        final_norm=costs.final_norm + param_bytes * tokens * dim,
        log_softmax=0 if chunked else 4 * tokens * job.args.vocab_size // job.tp,
        stage_output=param_bytes * tokens * dim / job.tp,
    )


@dataclass(frozen=True)
class _Transients:
    """What exists during part of a backward only, per micro-batch."""

    logits_held: float
    """The logits in param_dtype, while a loop that keeps them holds them."""
    loss: float
    """The loss backward's buffers beyond the saved log-softmax (module docstring, "logits + loss")."""
    activation_grads: float
    """A block backward's activation gradients."""
    reduce_scatter_inputs: float
    """A block's unsharded gradient in param_dtype and its reduce_dtype copy."""
    root_grad: float
    """The root unit's unsharded gradient, from the loss backward to the end."""
    pp_buffers: float
    """The pipeline's send and receive buffers."""
    weight_grad_inputs: int
    """Zero bubble: per block, what its weight gradients need between a micro-batch's input and weight backward."""


def _transients(job: Job, costs: BlockCosts) -> _Transients:
    tp, tokens, vocab, dim = job.tp, job.microbatch_tokens, job.args.vocab_size, job.args.dim
    param_bytes, reduce_bytes = DTYPE_BYTES[job.param_dtype], DTYPE_BYTES[job.reduce_dtype]
    # Start of the loss backward, in fp32 per logit: the saved log-softmax (4, counted with the activations) plus,
    # for the fused cross-entropy (tp 1), nll's gradient and log-softmax's gradient (4 + 4); under loss parallel
    # (tp > 1) torch's DTensor backward builds zeros_like(x), exp(x), their sum and the product (up to 4 x 4
    # alive). Plus the logits in param_dtype while the loop still holds them.
    logits = param_bytes * tokens * vocab / tp if job.logits_kept_in_backward else 0.0
    loss = (8 if tp == 1 else 12) * tokens * vocab / tp + logits
    if job.chunk_tokens:
        # loss.py: forward keeps no logits; backward recomputes one chunk (bf16 logits, fp32 copy, log-softmax,
        # gradients) while the gradients of the final norm's output and of the output projection accumulate.
        per_logit = param_bytes + 4 + 4 + (8 if tp == 1 else 12)
        loss = per_logit * job.chunk_tokens * vocab / tp + 4 * tokens * dim + param_bytes * costs.root_params
    return _Transients(
        logits_held=logits,
        loss=loss,
        # Backward of one block: besides the recomputation (AC) of what it did not keep, its activation gradients
        # (about two T x D tensors and two of the widest projection's output alive at once, SwiGLU's hidden
        # units for Llama; under TP one T x D is the full-size partial gradient of a gathered input) and its
        # unsharded gradient in param_dtype plus its reduce_dtype copy (FSDP's reduce-scatter input; under PP
        # the accumulator's first upcast).
        activation_grads=param_bytes * tokens * (dim + dim / tp) + 2 * costs.widest,
        # Without FSDP (one rank) a gradient is float32 in .grad as soon as backward makes it: under autocast a
        # block's param_dtype gradients before their casts, and the output projection's from the loss backward on.
        reduce_scatter_inputs=(param_bytes + reduce_bytes if job.fsdp else param_bytes if job.autocast else 0)
        * costs.block_params,
        root_grad=(param_bytes if job.fsdp else 4) * costs.root_params,
        pp_buffers=2 * param_bytes * tokens * dim / tp if job.pp > 1 else 0.0,
        weight_grad_inputs=costs.matmul_inputs,
    )


class _Replay:
    """The rank's forwards and backwards in its schedule's order, and the worst moment of each phase of backward
    (loss, block, embedding): the bytes alive then beyond the static state, the gradient shards among them (they
    live in the reduce-scatter stream's pool, see "Reserved"), and where."""

    def __init__(
        self,
        job: Job,
        *,
        params: _RankParams,
        state: _ShardedState,
        gathered: dict[str, float],
        acts: _Activations,
        transients: _Transients,
    ) -> None:
        self.params, self.state, self.gathered, self.acts, self.transients = params, state, gathered, acts, transients
        self.pipelined, self.fsdp = job.pp > 1, job.fsdp
        # Gradients summed unsharded from a stage's first backward on (PP, or FSDP deferring its reduce-scatters).
        self.accumulates = job.accumulates_unsharded
        self.param_bytes, self.reduce_bytes = DTYPE_BYTES[job.param_dtype], DTYPE_BYTES[job.reduce_dtype]
        self.held: dict[tuple[int, int], float] = {}  # (local stage, micro-batch) -> its activations
        self.backward_done: set[int] = set()  # stages with reduce_dtype accumulators (after their first backward)
        self.phases: dict[str, tuple[float, float, str]] = {}  # phase -> (bytes, shards among them, where)
        self.most_held = 0

    def run(self, ops: list[tuple[str, int, int]]) -> None:
        """ops: (kind, local stage, micro-batch) as rank_ops lists them; kind F forward, B backward, or zero bubble's
        I (input) and W (weight) backward."""
        for kind, local_stage, microbatch in ops:
            stage, key = self.params.local[local_stage], (local_stage, microbatch)
            if kind == "F":
                self.held[key] = sum(self.acts.blocks(stage)) + self.acts.outside(stage)
                self.most_held = max(self.most_held, len(self.held))
            elif kind == "W":
                del self.held[key]
            else:
                self._backward(stage, key)
                self.backward_done.add(stage)
                if kind == "I":
                    self.held[key] = len(self.acts.blocks(stage)) * self.transients.weight_grad_inputs
                else:
                    del self.held[key]

    def _backward(self, stage: int, key: tuple[int, int]) -> None:
        """One backward of `stage` for one micro-batch: the loss (on the last stage), every block from the last to
        the first, the embedding (on stage 0)."""
        params, state, acts, transients = self.params, self.state, self.acts, self.transients
        others = sum(self.held.values()) - self.held[key]
        first = stage not in self.backward_done
        accumulated = sum(params.of_stage(k) for k in self.backward_done)
        accumulators = self.reduce_bytes * accumulated if self.accumulates else 0.0
        base = state.earlier_grads + accumulators + others + transients.pp_buffers
        where = f"stage {stage}, micro-batch {key[1]}" if self.pipelined else ""
        last = stage == params.last_stage
        if last:
            value = self.gathered["loss"] + base + self.held[key] + transients.loss
            self._record("loss", value, state.earlier_grads, where)
        blocks = acts.blocks(stage)
        remaining = sum(blocks) + acts.token_ids
        root_grad = transients.root_grad if last else 0.0
        # Per block processed: its gradient joins the shards (no PP) or, in a stage's first backward, the
        # accumulators (PP, deferred reduce-scatters); later backwards add into accumulators that exist.
        done_each = (self.reduce_bytes * params.block if first else 0.0) if self.accumulates else state.block_grads
        unsharded = (
            transients.reduce_scatter_inputs if first or not self.accumulates else self.param_bytes * params.block
        )
        for j, i in enumerate(reversed(range(len(blocks)))):
            transient = acts.no_ac - blocks[i] + transients.activation_grads + unsharded  # recompute + gradients
            done = j * done_each
            value = self.gathered["block"] + base + done + root_grad + remaining + transient
            shards = state.earlier_grads + (0.0 if self.accumulates else done)
            self._record("block", value, shards, f"{where}, block {params.stages[stage][i]}".removeprefix(", "))
            remaining -= blocks[i]
        if stage == 0 and params.embedding:
            done = len(blocks) * done_each
            # Its unsharded gradient and FSDP's reduce_dtype copy; without FSDP (one rank) its float32 .grad.
            grads = (self.param_bytes + (self.reduce_bytes if first else 0) if self.fsdp else 4) * params.embedding
            value = self.gathered["embedding"] + base + done + root_grad + acts.token_ids + grads
            self._record("embedding", value, state.earlier_grads + (0.0 if self.accumulates else done), where)

    def worst(self) -> tuple[str, float, float, str]:
        """The phase with the most bytes alive at its worst moment: its name, the bytes, the shards in them, where."""
        phase = max(self.phases, key=lambda k: self.phases[k][0])
        return (phase, *self.phases[phase])

    def _record(self, phase: str, value: float, shards: float, where: str) -> None:
        if value > self.phases.get(phase, (-1.0,))[0]:
            self.phases[phase] = (value, shards, where)


def estimate_rank(job: Job, pp_rank: int = 0, *, tp_mesh: DeviceMesh | None = None) -> dict[str, float | int | str]:
    """Per-GPU bytes by component, the allocated peak and the reserved estimate of one pp rank (the module
    docstring tells the story). tp_mesh: see block_costs."""
    costs = job_costs(job, tp_mesh=tp_mesh)
    params = _rank_params(job, costs, pp_rank)
    state = _sharded_state(job, params)
    acts, transients = _activations(job, costs, params.stages), _transients(job, costs)
    replay = _Replay(
        job, params=params, state=state, gathered=_gathered_params(job, params), acts=acts, transients=transients
    )
    if job.pp > 1:
        n_local, n_mb = len(params.local), job.microbatches
        replay.run(rank_ops(job.pp_schedule, pp_rank=pp_rank, pp=job.pp, n_local=n_local, n_mb=n_mb))
    elif job.accumulates_unsharded:  # the second micro-batch runs with every gradient accumulated unsharded
        replay.run([("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)])
    else:
        replay.run([("F", 0, 0), ("B", 0, 0)])
    return _report(job, pp_rank, replay)


def _peak(job: Job, replay: _Replay) -> dict[str, float | str]:
    """The allocated peak (static state + the worst phase) and what the caching allocator reserves for it: state +
    the reduce-scatter stream's shards + the all-gather stream's flat outputs + the compute stream's peak with
    fragmentation (module docstring, "Reserved")."""
    params, state, phases = replay.params, replay.state, replay.phases
    peak_phase, peak_value, _, peak_where = replay.worst()
    allocated = state.static + peak_value
    rs_pool = state.grads if state.on_gpu else 4 * params.largest_unit / job.shard
    ag_pool = DTYPE_BYTES[job.param_dtype] * max(params.largest_unit, 2 * params.block)
    compute = max(value - shards for value, shards, _ in phases.values())
    if not job.fsdp:  # one rank: no FSDP streams, the gradients are the compute stream's
        rs_pool, ag_pool, compute = 0.0, 0.0, max(value for value, _, _ in phases.values())
    if job.allocator == "cuda":
        reserved = state.static + rs_pool + ag_pool + (1 + FRAGMENTATION) * compute
    else:
        reserved = allocated
    return {
        "peak_phase": f"{peak_phase} backward" + (f" ({peak_where})" if peak_where else ""),
        "allocator_peak": allocated,
        "rs_pool": rs_pool,
        "ag_pool": ag_pool,
        "compute_peak": compute,
        "reserved": reserved,
    }


def _report(job: Job, pp_rank: int, replay: _Replay) -> dict[str, float | int | str]:
    """estimate_rank's result: every term of the breakdown, the peak and the reserved estimate."""
    params, state, acts, transients, phases = replay.params, replay.state, replay.acts, replay.transients, replay.phases
    param_bytes, reduce_bytes = DTYPE_BYTES[job.param_dtype], DTYPE_BYTES[job.reduce_dtype]
    recompute = max(acts.no_ac - min(acts.blocks(g), default=acts.no_ac) for g in params.local)  # the worst block's
    peak = _peak(job, replay)
    overhead = job.overhead_gib * GiB
    return {
        "pp_rank": pp_rank,
        "pp_stages": ", ".join(map(str, params.local)),
        "rank_blocks": sum(len(params.stages[g]) for g in params.local),
        "microbatches_held": replay.most_held,
        "params": state.params,
        "grads": state.grads,
        "adam": state.adam,
        "state_on_gpu": state.params + state.grads + state.adam if state.on_gpu else 0.0,
        "state_on_host": 0.0 if state.on_gpu else state.params + state.grads + state.adam,
        "grads_at_peak": replay.worst()[2],
        "block_unit": param_bytes * params.block,
        "output_unit": param_bytes * params.root,
        "embedding_unit": param_bytes * params.embedding,
        "gathered_loss_phase": replay.gathered["loss"],
        "gathered_block_phase": replay.gathered["block"],
        "act_per_block_no_ac": acts.no_ac,
        "act_per_block_checkpointed": acts.checkpointed if acts.every else 0,
        "act_blocks": sum(sum(acts.blocks(g)) for g in params.local),
        "act_outside_blocks": acts.token_ids + acts.final_norm,
        "loss_buffers": acts.log_softmax + transients.loss,
        "logits_held": transients.logits_held,
        "root_grad": transients.root_grad,
        "accumulators": reduce_bytes * params.total if job.accumulates_unsharded else 0.0,
        "pp_buffers": transients.pp_buffers,
        "block_backward": recompute + transients.activation_grads + transients.reduce_scatter_inputs,
        "recompute": recompute,
        "grad_acts": transients.activation_grads,
        "rs_buffers": transients.reduce_scatter_inputs,
        **{f"{kind}_phase": phases.get(kind, (0.0,))[0] for kind in ("loss", "block", "embedding")},
        **{f"{kind}_phase_at": phases.get(kind, (0.0, 0.0, "-"))[2] for kind in ("loss", "block", "embedding")},
        **peak,
        "overhead": overhead,
        "total": peak["reserved"] + overhead,
    }


def estimate(job: Job, *, tp_mesh: DeviceMesh | None = None) -> dict[str, float | int | str]:
    """estimate_rank of the pp rank that needs the most memory (reserved; without PP the one rank)."""
    return max((estimate_rank(job, rank, tp_mesh=tp_mesh) for rank in range(job.pp)), key=lambda e: e["reserved"])


# -------------------------------------------------------------- fake-tensor step


# FSDPMemTracker's categories (torch.distributed._tools.fsdp2_mem_tracker._FSDPRefType values) -> ours.
_TRACKED = {
    "Sharded Param": "sharded_params",
    "Unsharded Param": "unsharded_params",
    "Buffer": "buffers",
    "Sharded Grad": "sharded_grads",
    "Unsharded Grad": "unsharded_grads",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "all_gather",
    "Reduce Scatter": "reduce_scatter",
    "OptState": "optimizer_state",
    "Inputs": "inputs",
}


def fake_step_memory(
    model: nn.Module,
    *,
    optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer],
    batch: int,
    seq_len: int,
    loss_fn: Callable[..., torch.Tensor],
    device: torch.device,
    param_dtype: torch.dtype = torch.bfloat16,
    loss_parallel: bool = False,
    microbatches: int = 1,
    accumulated: bool = False,
) -> dict[str, int]:
    """Bytes at the peak of one training step of `model`, by category, as torch's FSDPMemTracker counts
    them on fake tensors: no memory, no compute, no GPU.

    model: a Transformer, or one pipeline stage (parallelisms.pp.stage_module), built on the meta device
        and parallelized (parallelize_model, FSDP included) on a process group whose collectives do nothing
        (torch's "fake" backend). Its meta parameters become fake tensors on `device`, in place: the
        model serves no other purpose afterwards.
    The step is train.py's: zero_grad(set_to_none=True), then the forward with the loss inside
    (`model(inputs, head=partial(loss_fn, model, labels=labels))`) and its backward, of `batch` x
    `seq_len` tokens, under loss_parallel_context(loss_parallel). A stage without the embedding gets
    hidden states (batch, seq_len / tp, dim) in param_dtype; one without the output sends a gradient
    of its output back. `microbatches` forwards run before their backwards: what stage s of S holds
    under 1F1B with min(n_mb, S - s) of them; a stage's backwards then run as the pipeline runs them,
    without gradient sync or resharding. `accumulated`: the gradient shards of an earlier micro-batch
    exist (gradient accumulation).
    Not stepped under the tracker: the optimizer step (fake kernels allocate temporaries fused AdamW does
    not; its state is created before, from zero gradients, and counted) and the pipeline's end-of-step
    reduce-scatter. Returns the categories of _TRACKED and "total", in bytes, at the peak.
    """
    # Imported here: torch's tracking tools are for this check only.
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule

    from parallelisms.tp import loss_parallel_context

    if not isinstance(model, FSDPModule):
        raise ValueError(
            "fake_step_memory: the model is not FSDP-wrapped (a job of one rank is not: parallelisms/fsdp.py "
            "applies_fsdp); FSDPMemTracker needs FSDP's hooks"
        )
    last = model.norm is not None
    meshes = [p.device_mesh for p in model.parameters() if isinstance(p, DTensor)]
    tp = next((m.size(m.mesh_dim_names.index("tp")) for m in meshes if "tp" in (m.mesh_dim_names or ())), 1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=device)
        optimizer = _optimizer_with_state(model, optimizer_factory, accumulated=accumulated)
        labels = torch.randint(0, model.args.vocab_size, (batch, seq_len), device=device)
        x = _stage_input(model, batch=batch, seq_len=seq_len, tp=tp, device=device, dtype=param_dtype)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((x, labels))
        head = functools.partial(loss_fn, model, labels=labels) if last else None
        with tracker, loss_parallel_context(loss_parallel):
            # The same fake tensor for every micro-batch: a pipeline's received inputs cost no more than this.
            _forwards_then_backwards(model, tracker, [x] * microbatches, head=head)
        return _peak_by_category(tracker)


def _optimizer_with_state(
    model: nn.Module, optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer], *, accumulated: bool
) -> torch.optim.Optimizer:
    """The model's optimizer with its state created by a step on zero gradients, which stay as an earlier
    micro-batch's gradients when `accumulated` and are freed (train.py's zero_grad(set_to_none=True)) otherwise."""
    optimizer = optimizer_factory(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    if not accumulated:
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def _stage_input(
    model: nn.Module, *, batch: int, seq_len: int, tp: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """A micro-batch's input: token ids (batch, seq_len) for the model or its first stage, else the hidden states a
    stage receives, (batch, seq_len / tp, dim) in param_dtype."""
    if model.tok_embeddings is not None:
        return torch.randint(0, model.args.vocab_size, (batch, seq_len), device=device)
    return torch.empty((batch, seq_len // tp, model.args.dim), device=device, dtype=dtype, requires_grad=True)


def _forwards_then_backwards(
    model: nn.Module, tracker: Any, inputs: list[torch.Tensor], *, head: Callable[..., torch.Tensor] | None
) -> None:
    """Every micro-batch's forward, then every backward; a pipeline stage's as torch.distributed.pipelining runs
    them (without gradient sync or resharding), and one without the loss (`head`) gets a gradient of its output."""
    stage = model.tok_embeddings is None or model.norm is None
    outputs = []
    for x in inputs:
        # The tracker refuses a second forward of the root module (it takes it for the next step); its per-module
        # statistics are all it resets, not the peak.
        tracker.reset_mod_stats()
        outputs.append(model(x, head=head))
    for out in outputs:
        if stage:
            model.set_requires_gradient_sync(False)
            model.set_reshard_after_backward(False)
        out.backward(None if head is not None else torch.empty_like(out))


def _peak_by_category(tracker: Any) -> dict[str, int]:
    """The bytes of FSDPMemTracker's peak snapshot, by category of _TRACKED, and their "total"."""
    peak: dict[str, int] = {}
    for snapshot in tracker.get_tracker_snapshot("peak").values():
        for kind, nbytes in snapshot.items():
            name = _TRACKED.get(getattr(kind, "value", kind), "total")
            peak[name] = peak.get(name, 0) + nbytes
    return peak


def fake_job_memory(job: Job, *, pp_rank: int = 0, device: str = "cpu") -> dict[str, int]:
    """fake_step_memory for `job`: pp rank `pp_rank`'s stage (the whole model without PP) built on the meta
    device, parallelized by parallelize_model on job.ngpu fake ranks (this process rank 0 of them; it
    starts the fake process group unless one of job.ngpu ranks is running, and ends what it started),
    stepped with the micro-batches the stage holds at once (estimate_rank's microbatches_held).

    Single-stage schedules only (1F1B, GPipe): an interleaved rank's stages interleave their
    micro-batches, which one fake step of one module does not reproduce (estimate_rank replays them).
    Not under context parallel (the fake step does not cut windows).
    """
    if job.cp > 1:
        raise ValueError("context parallel (cp > 1) is estimated by the formulas only (the breakdown above)")
    from config import ActivationCheckpoint, Compile
    from loss import Loss
    from parallelisms.parallelize import parallelize_model
    from parallelisms.pp import stage_module

    if job.pp > 1 and len(job.stages) != job.pp:
        raise ValueError(
            f"fake_job_memory: {job.pp_schedule} runs {len(job.stages) // job.pp} stages per rank; "
            "only single-stage schedules (1F1B, GPipe) are stepped on fake tensors"
        )
    started = not dist.is_initialized()
    if started:
        # Registers torch's "fake" backend (torch.testing, torch 2.13): collectives that return at once.
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=job.ngpu)
    elif dist.get_world_size() != job.ngpu:
        raise ValueError(
            f"fake_job_memory: a process group of {dist.get_world_size()} ranks runs, the job has {job.ngpu}"
        )
    try:
        training = Training(
            seq_len=job.seq_len,
            local_batch_size=job.local_batch_size,
            mixed_precision_param=job.param_dtype,
            mixed_precision_reduce=job.reduce_dtype,
            enable_cpu_offload=job.cpu_offload,
            loss_chunk_tokens=job.chunk_tokens,
        )
        every = checkpoint_every(job.ac)
        ac = ActivationCheckpoint(
            mode="none" if not every else "selective" if job.ac.startswith("selective") else "full",
            selective_ac_option=job.ac.removeprefix("selective-") if job.ac.startswith("selective") else "op",
        )
        dims = ParallelDims.from_config(job.parallelism, world_size=job.ngpu)
        mesh = dims.build_mesh(device)
        with torch.device("meta"):
            model = job.fam.model_cls(with_seq_len(job.args, job.seq_len))
        if job.pp > 1:
            stages, g = job.stages, pp_rank
            model = stage_module(model, stages[g], first=g == 0, last=g == len(stages) - 1)
        model = parallelize_model(
            model,
            family=job.fam,
            dims=dims,
            mesh=mesh,
            training=training,
            parallelism=job.parallelism,
            ac=ac,
            compile=Compile(enable=False),
        )
        return fake_step_memory(
            model,
            optimizer_factory=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True),
            batch=job.microbatch_tokens // job.seq_len,
            seq_len=job.seq_len,
            loss_fn=Loss(job.chunk_tokens),
            device=torch.device(device),
            param_dtype=getattr(torch, job.param_dtype),
            loss_parallel=job.tp > 1,
            microbatches=int(estimate_rank(job, pp_rank, tp_mesh=mesh["tp"])["microbatches_held"]),
            accumulated=job.grad_accum > 1,
        )
    finally:
        if started:
            dist.destroy_process_group()


# ------------------------------------------------------------------------- CLI


@dataclass(frozen=True)
class Reference:
    """A published peak and the Job that reproduces its setup."""

    name: str
    job: Job
    published: dict[str, float]  # label -> GiB
    note: str


# torchtitan docs/performance.md (benchmarks/llama3_h100_202412_torchtitan.md): H100 SXM with
# 96 GB HBM2e, torch nightly of 2024-12-23, eager nn.RMSNorm (composite then), `del pred` before
# backward; "Memory(GiB)" is torch.cuda.max_memory_reserved, without the CUDA context / NCCL, the
# maximum over all GPUs.
_TT = dict(rmsnorm="composite")
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
        Job(flavor="llama3_8b", ngpu=8, local_batch_size=2, seq_len=8192, ac="selective-op", **_TT),
        {"FSDP": 82.4, "FSDP + compile": 77.0},
        "torchtitan Table 1 (docs/performance.md)",
    ),
    Reference(
        "8B, 128 GPUs, FSDP, bs 2, SAC op",
        Job(flavor="llama3_8b", ngpu=128, local_batch_size=2, seq_len=8192, ac="selective-op", **_TT),
        {"FSDP": 67.0, "FSDP + compile": 62.0},
        "torchtitan Table 3: same job, state sharded 16x thinner",
    ),
    Reference(
        "70B, 64 GPUs, FSDP8 x TP8, bs 8, full AC",
        Job(flavor="llama3_70b", ngpu=64, tp=8, local_batch_size=8, seq_len=8192, ac="full", **_TT),
        {},
        "torchtitan's llama3_70b.toml preset (64 GPUs); no published peak",
    ),
    Reference(
        "70B, 256 GPUs, FSDP32 x TP8, bs 16, full AC",
        Job(flavor="llama3_70b", ngpu=256, tp=8, local_batch_size=16, seq_len=8192, ac="full", **_TT),
        {"2D + compile + float8": 71.9, "+ async TP": 67.6},
        "torchtitan Table 4; compile + float8 not modelled (bf16 estimate)",
    ),
    Reference(
        "405B, 128 GPUs, FSDP16 x TP8, bs 2, full AC",
        Job(flavor="llama3_405b", ngpu=128, tp=8, local_batch_size=2, seq_len=8192, ac="full", **_TT),
        {},
        "torchtitan's llama3_405b.toml preset (128 H100; no published peak)",
    ),
    Reference(
        "405B, 512 GPUs, FSDP8 x TP8 x PP8 1F1B, bs 32",
        Job(pp_schedule="1F1B", **_TT_405B_PP),
        {"3D + compile + float8 + async TP": 82.5},
        "torchtitan Table 5: 8 micro-batches of 4 (its default then: as many as stages); not modelled: compile, float8",
    ),
    Reference(
        "405B, 512 GPUs, FSDP8 x TP8 x PP8 Interleaved1F1B",
        Job(pp_schedule="Interleaved1F1B", **_TT_405B_PP),
        {"3D + compile + float8 + async TP": 72.7},
        "torchtitan Table 5, 2 stages per rank (its split then differed slightly from stage_layers')",
    ),
)


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
