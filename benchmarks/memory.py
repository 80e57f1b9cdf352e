"""What each memory technique saves, measured per rank from the tensors themselves (docs/failures.md #5).

    python -m benchmarks.memory --out outputs/bench/memory.json     # starts torchrun (2 CPU ranks) itself
    torchrun --nproc_per_node=2 -m benchmarks.memory --out ...       # the same, launched by hand

One training step of the debug model (local batch 4 x 256 tokens) per setup, each built by the
recipe's own `parallelize_model` (AC, then FSDP through `apply_fsdp`) on a ParallelDims mesh:

    no_shard_fp32            every rank holds the whole model (what DDP keeps); the baseline
    fsdp2_fp32               FSDP over 2 ranks
    fsdp2_bf16               + MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    fsdp2_bf16_ac_sel2       + selective AC, every 2nd block fully checkpointed
    fsdp2_bf16_ac_op         + selective op AC (every other matmul, attention outputs kept)
    fsdp2_bf16_ac_full       + full AC
    fsdp2_bf16_ac_full_offload + CPUOffloadPolicy

Columns, bytes per rank:
  params, grads, optimizer  local shards (`to_local()` of the DTensors) of the parameters, of their
                            gradients after backward and of AdamW's state after the step. bf16
                            param_dtype changes none of them: the sharded master copy, its gradient
                            and the optimizer state stay fp32.
  activations               tensors kept from forward to backward (below), unique storages.
  gathered                  parameters all-gathered at once in forward, in param_dtype: the most
                            seen by any FSDP unit's forward pre-hook (which runs after FSDP's
                            all-gather), here one block plus the root unit (norm + output, gathered
                            for the whole step); bf16 halves it. In backward FSDP also prefetches
                            the next unit (planning/estimate_memory.py models that overlap).
  device total              what a GPU would hold: the sum, minus state that CPU offload keeps
                            in host memory.

How activations are counted. `saved_tensors_hooks` sees every tensor autograd saves, once per
save; views share a storage, so storages are counted once (keyed by data pointer, size read
after forward). Parameters (and views of them: the `w.t()` a matmul saves) and buffers (RoPE
table slices) are not activations and are skipped. The hooks alone miss what activation
checkpointing keeps: a non-reentrant checkpoint installs its own saved_tensors_hooks around the
block (the innermost hooks win), which drop what autograd saves inside the block. So:
  * the block's inputs, which the checkpoint keeps (in its recomputation closure) until backward,
    are read in a forward pre-hook of each checkpointed block and counted;
  * selective op AC keeps the outputs of its save-list ops in its own cache: `planning.trace.observe_ops`
    records a weak reference to the storage of every op output produced inside a checkpointed
    block's forward, and those still alive once forward is over are counted (under full AC the
    only survivors are block outputs, already counted as the next block's input);
  * what is recomputed in backward is not counted: it exists only while that one block runs
    backward (planning/estimate_memory.py adds one block's worth to the peak).
The bf16 logits and the loss are held by the caller, not saved: they are reported apart
(`logits_bytes`) and not in the column. Counts are exact for eager mode; torch.compile changes
what is saved.

On a CPU-only machine CPU offload cannot show a difference in where memory lives (the compute
device is the host too): the table reports the shards' `device` (cpu in both cases) and keeps
the offloaded state out of the device total, which is what a GPU run would do by policy.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from benchmarks import harness
from benchmarks.harness import MiB, Row
from config import ActivationCheckpoint, Compile, JobConfig, Training
from loss import chunked_sums
from models import with_seq_len
from models.llama3 import FLAVORS, ModelArgs, Transformer
from parallelisms.ac import CheckpointedModule
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize_model
from planning.flags import job as estimator_job
from planning.job import Machine
from planning.memory import activation_bytes
from tests.instruments import LiveBytes, observe_ops

PROBLEM = "#5 memory"


@dataclasses.dataclass(frozen=True)
class Setup:
    shard: bool = True  # FSDP over all ranks; False: no FSDP, every rank holds everything
    param_dtype: str = "float32"
    ac: str = "none"  # none | full | selective-op | selective-<k>
    cpu_offload: bool = False


SETUPS: dict[str, Setup] = {
    "no_shard_fp32": Setup(shard=False),
    "fsdp2_fp32": Setup(),
    "fsdp2_bf16": Setup(param_dtype="bfloat16"),
    "fsdp2_bf16_ac_sel2": Setup(param_dtype="bfloat16", ac="selective-2"),
    "fsdp2_bf16_ac_op": Setup(param_dtype="bfloat16", ac="selective-op"),
    "fsdp2_bf16_ac_full": Setup(param_dtype="bfloat16", ac="full"),
    "fsdp2_bf16_ac_full_offload": Setup(param_dtype="bfloat16", ac="full", cpu_offload=True),
}
BASELINE = "no_shard_fp32"


def ac_config(ac: str) -> ActivationCheckpoint:
    """The [activation_checkpoint] section for none / full / selective-op / selective-<k>."""
    if ac in ("none", "full"):
        return ActivationCheckpoint(mode=ac)
    return ActivationCheckpoint(mode="selective", selective_ac_option=ac.removeprefix("selective-"))


# ------------------------------------------------------------ what forward keeps


def _storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


# id of the storage object -> (weak reference to it, who keeps it, dtype of the tensor seen).
# Keyed by the Python storage object, which PyTorch keeps unique per live storage, and not by data
# pointer: a storage's data pointer changes when it is resized (FSDP frees an all-gathered
# parameter by resizing its storage to 0 bytes), and the freed address is then reused.
Seen = dict[int, tuple[weakref.ref, str, torch.dtype]]


def _remember(seen: Seen, t: torch.Tensor, source: str) -> None:
    """Record the storage of `t` unless already recorded (the first source to see it keeps it)."""
    storage = t.untyped_storage()
    old = seen.get(id(storage))
    if old is None or old[0]() is None:  # a dead entry: its id was reused by a new object
        seen[id(storage)] = (weakref.ref(storage), source, t.dtype)


class _BlockOutputs:
    """An `observe_ops` callback: weak references to the storage of each op output made `inside` a block."""

    def __init__(self, is_static: Callable[[torch.Tensor], bool]) -> None:
        self.inside = False
        self.seen: Seen = {}
        self.is_static = is_static

    def __call__(self, op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if not self.inside:
            return
        # Below autograd, views are not marked (`_base` is None): an output sharing a storage
        # with a parameter input (the `w.t()` of a matmul) is recognized by that storage.
        static = {id(a.untyped_storage()) for a in args if isinstance(a, torch.Tensor) and self.is_static(a)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not self.is_static(t) and id(t.untyped_storage()) not in static:
                _remember(self.seen, t, "sac_cache")


@dataclasses.dataclass(frozen=True)
class Kept:
    """Bytes kept from forward to backward."""

    by_source: dict[str, int]  # autograd | checkpoint_input | sac_cache
    by_dtype: dict[str, int]  # "bfloat16", "float32", ...


class ActivationCensus:
    """Unique storages kept from forward to backward, by who keeps them (see the module docstring).

    Use around the forward and the loss only; read `kept()` before backward.
    """

    SOURCES = ("autograd", "checkpoint_input", "sac_cache")

    def __init__(self, model: nn.Module):
        self.model = model
        self._buffers = {b.untyped_storage().data_ptr() for b in model.buffers()}
        self._seen: Seen = {}  # the first source to see a storage keeps it
        self._outputs = _BlockOutputs(self.is_static)

    def is_static(self, t: torch.Tensor) -> bool:
        """Parameters (sharded or all-gathered), views of them, and buffers are not activations."""
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return True
        return t.untyped_storage().data_ptr() in self._buffers

    def _add(self, t: Any, source: str) -> None:
        if isinstance(t, torch.Tensor) and not self.is_static(t):
            _remember(self._seen, t, source)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._add(t, "autograd")
        return t

    def _enter_block(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        for a in args:
            self._add(a, "checkpoint_input")
        self._outputs.inside = True

    def _leave_block(self, *_: Any) -> None:
        self._outputs.inside = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[ActivationCensus]:
        handles = []
        for m in self.model.modules():
            if isinstance(m, CheckpointedModule):
                handles.append(m.register_forward_pre_hook(self._enter_block))
                handles.append(m.register_forward_hook(self._leave_block))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t), observe_ops(self._outputs):
                yield self
        finally:
            for h in handles:
                h.remove()
            for key, entry in self._outputs.seen.items():
                old = self._seen.get(key)
                if entry[0]() is not None and (old is None or old[0]() is None):
                    self._seen[key] = entry

    def kept(self) -> Kept:
        """Bytes of the storages still alive now (call after forward, before backward)."""
        by_source, by_dtype = dict.fromkeys(self.SOURCES, 0), {}
        counted: set[int] = set()  # data pointers of live storages: a second guard against double counting
        for ref, source, dtype in self._seen.values():
            storage = ref()  # None: a temporary, or something the SAC cache did not keep
            # 0 bytes: an FSDP storage freed after forward.
            if storage is None or storage.nbytes() == 0 or storage.data_ptr() in counted:
                continue
            counted.add(storage.data_ptr())
            by_source[source] += storage.nbytes()
            name = str(dtype).removeprefix("torch.")
            by_dtype[name] = by_dtype.get(name, 0) + storage.nbytes()
        return Kept(by_source=by_source, by_dtype=by_dtype)


# ------------------------------------------------------------------ one setup


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _gathered_bytes(model: nn.Module) -> int:
    """Bytes of the parameters that are all-gathered right now (FSDP swaps them in as plain tensors)."""
    return sum(_nbytes(p) for p in model.parameters() if not isinstance(p, DTensor))


def build(setup: Setup, *, model_args: ModelArgs, mesh: DeviceMesh, device: torch.device) -> Transformer:
    world = mesh.size()
    shard = world if setup.shard else 1
    dims = ParallelDims(dp_replicate=1, dp_shard=shard, tp=1, world_size=shard)
    training = Training(
        mixed_precision_param=setup.param_dtype,  # type: ignore[arg-type]
        mixed_precision_reduce="float32",
        enable_cpu_offload=setup.cpu_offload,
    )
    with torch.device("meta"):
        model = Transformer(model_args)
    cfg = JobConfig(training=training, activation_checkpoint=ac_config(setup.ac), compile=Compile(enable=False))
    parallelize_model(model, cfg, dims=dims, mesh=mesh, device=device)
    if setup.shard != isinstance(model, FSDPModule):
        raise AssertionError(f"{setup}: expected FSDP to be {'on' if setup.shard else 'off'}")
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    return model


def measure(
    setup: Setup, *, model_args: ModelArgs, mesh: DeviceMesh, batch: int, seq_len: int, device: torch.device
) -> dict[str, Any]:
    """One AdamW step of `setup`; per-rank bytes of state, activations and gathered units."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build(setup, model_args=model_args, mesh=mesh, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(dist.get_rank())
    inputs = torch.randint(0, model_args.vocab_size, (batch, seq_len), generator=generator).to(device)
    labels = torch.randint(0, model_args.vocab_size, (batch, seq_len), generator=generator).to(device)

    # The gathered bytes each FSDP unit's forward sees (its pre-hook runs after FSDP's all-gather).
    gathered: dict[str, int] = {}
    hooks = [
        module.register_forward_pre_hook(lambda m, a, name=name: gathered.__setitem__(name, _gathered_bytes(model)))
        for name, module in model.named_modules()
        if isinstance(module, FSDPModule) and module is not model
    ]
    start = time.perf_counter()
    census = ActivationCensus(model)
    with census():
        logits = model(inputs)  # (bs, seqlen, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    kept = census.kept()
    logits_bytes = _storage_nbytes(logits)
    for h in hooks:
        h.remove()
    loss.backward()
    grads = sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    optimizer.step()
    seconds = time.perf_counter() - start

    params = sum(_nbytes(p) for p in model.parameters())
    optim = sum(_nbytes(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))
    devices = sorted({str(_local(p).device) for p in model.parameters()})
    state_devices = sorted(
        {str(_local(v).device) for s in optimizer.state.values() for k, v in s.items() if k != "step"}
        | {str(_local(p.grad).device) for p in model.parameters() if p.grad is not None}
    )
    act_total = sum(kept.by_source.values())
    gathered_peak = max(gathered.values(), default=0)
    host_state = params + grads + optim if setup.cpu_offload else 0
    predicted = activation_bytes(
        estimator_job(
            flavor="debugmodel",
            args=model_args,
            ngpu=2,  # the setups' 2 ranks: bf16 parameters are FSDP's (one rank would train under autocast)
            local_batch_size=batch,
            seq_len=seq_len,
            param_dtype=setup.param_dtype,
            ac=setup.ac,
            machine=Machine(cuda=True, rmsnorm="fused" if device.type == "cuda" else "composite"),
        )
    )
    return {
        "setup": dataclasses.asdict(setup),
        "world_size": mesh.size(),
        "fsdp_degree": mesh.size() if setup.shard else 1,
        "params_bytes": params,
        "grads_bytes": grads,
        "optimizer_bytes": optim,
        "activation_bytes": act_total,
        "activation_bytes_by_source": kept.by_source,
        "activation_bytes_by_dtype": kept.by_dtype,
        "predicted_activation_bytes": predicted["total"],
        "logits_bytes": logits_bytes,
        "gathered_unit_peak_bytes": gathered_peak,
        "gathered_by_unit_bytes": gathered,
        "host_state_bytes": host_state,
        "device_total_bytes": params + grads + optim - host_state + act_total + gathered_peak,
        "param_shard_devices": devices,
        "grad_and_optimizer_devices": state_devices,
        "param_dtype_of_shards": sorted({str(_local(p).dtype) for p in model.parameters()}),
        "step_seconds": seconds,
        # A cross-check on GPU machines only: the allocator's own peak for this setup.
        "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


# ------------------------------------------------------------------- reporting

# The staircase `make bench` shows: each setup adds one technique to the one before.
STAIRCASE: dict[str, str] = {
    "no_shard_fp32": "no sharding",
    "fsdp2_fp32": "FSDP({world})",
    "fsdp2_bf16": "+ bf16 params",
    "fsdp2_bf16_ac_op": "+ op SAC",
    "fsdp2_bf16_ac_full": "+ full AC",
    "fsdp2_bf16_ac_full_offload": "+ CPU offload",
}


def rows(results: dict[str, Any]) -> list[Row]:
    """Device MiB per rank along STAIRCASE: one row per added technique."""
    setups = results["setups"]
    labels = [(name, label.format(world=results["world"])) for name, label in STAIRCASE.items()]
    row = functools.partial(
        Row, problem=PROBLEM, metric="device memory per rank: state + saved activations", unit="MiB"
    )
    loss = results["loss_phase"]
    return [
        row(broken=before, broken_value=setups[b]["device_total_bytes"] / MiB,
            fixed=after, fixed_value=setups[a]["device_total_bytes"] / MiB)
        for (b, before), (a, after) in itertools.pairwise(labels)
    ] + [
        Row(problem=PROBLEM, metric=f"loss phase peak, {loss['tokens']:,} tokens x vocab {loss['vocab']:,}", unit="MiB",
            broken="whole logits", broken_value=loss["peak_bytes"]["whole"] / MiB,
            fixed=f"chunks of {loss['chunk_tokens']}", fixed_value=loss["peak_bytes"]["chunked"] / MiB),
    ]  # fmt: skip


def table(results: dict[str, Any]) -> str:
    """MiB per rank; state that CPU offload keeps in host memory is marked 'h' and left out of the total."""
    setups = results["setups"]
    base = setups.get(BASELINE, {}).get("device_total_bytes")
    head = (
        f"{'setup':<27} {'params':>8} {'grads':>8} {'optim':>8} {'acts':>8} {'gathered':>8} "
        f"{'dev total':>9} {'vs base':>7}  shards on"
    )
    title = (
        f"MiB per rank, one step of {results['flavor']} on {results['world']} ranks, "
        f"batch {results['local_batch_size']} x {results['seq_len']} tokens per rank"
    )
    lines = [title, head, "-" * len(head)]
    for name, r in setups.items():
        host = "h" if r["host_state_bytes"] else " "
        params, grads, optim = (
            f"{r[key] / MiB:>7.2f}{host}" for key in ("params_bytes", "grads_bytes", "optimizer_bytes")
        )
        ratio = f"{r['device_total_bytes'] / base:.2f}x" if base else "n/a"
        lines.append(
            f"{name:<27} {params} {grads} {optim} "
            f"{r['activation_bytes'] / MiB:>8.2f} {r['gathered_unit_peak_bytes'] / MiB:>8.2f} "
            f"{r['device_total_bytes'] / MiB:>9.2f} {ratio:>7}  {','.join(r['param_shard_devices'])}"
        )
    loss = results["loss_phase"]
    lines.append(
        f"loss phase (output projection + cross-entropy, forward + backward, fp32), {loss['tokens']:,} tokens, "
        f"dim {loss['dim']}, vocab {loss['vocab']:,}: peak {loss['peak_bytes']['whole'] / MiB:.0f} MiB with the whole "
        f"logits, {loss['peak_bytes']['chunked'] / MiB:.0f} MiB in chunks of {loss['chunk_tokens']} tokens "
        f"({loss['seconds']['whole']:.1f} s vs {loss['seconds']['chunked']:.1f} s)"
    )
    return "\n".join(lines)


# The loss phase at Llama 3's vocabulary: the whole micro-batch's logits vs one chunk at a time (loss.py).
LOSS_PHASE = {"tokens": 2048, "dim": 256, "vocab": 128_256, "chunk_tokens": 512}


def loss_phase(*, tokens: int, dim: int, vocab: int, chunk_tokens: int) -> dict[str, Any]:
    """Peak bytes the output projection + loss hold in forward and backward (tests.instruments.LiveBytes), fp32."""
    torch.manual_seed(0)
    project = nn.Linear(dim, vocab, bias=False)
    h = torch.randn(1, tokens, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    peaks, seconds = {}, {}
    for name, chunk in (("whole", 0), ("chunked", chunk_tokens)):
        start = time.perf_counter()
        with LiveBytes().track() as live:
            loss = chunked_sums(project, h, labels, chunk_tokens=chunk)[0] / labels.numel()
            loss.backward()
        peaks[name], seconds[name] = live.peak, time.perf_counter() - start
    return {"tokens": tokens, "dim": dim, "vocab": vocab, "chunk_tokens": chunk_tokens,
            "logits_bytes": 4 * tokens * vocab, "peak_bytes": peaks, "seconds": seconds}  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    p.add_argument("--flavor", default="debugmodel", choices=sorted(FLAVORS))
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4, help="local batch size (sequences per rank)")
    p.add_argument(
        "--loss-dim", type=int, default=LOSS_PHASE["dim"], help="the loss phase's hidden size (its matmuls' cost)"
    )


def measure_args(args: argparse.Namespace) -> dict[str, Any]:
    """Every setup of `args`, on every rank of this torchrun launch; the busiest rank's bytes."""
    model_args = with_seq_len(FLAVORS[args.flavor], args.seq_len)
    setups: dict[str, dict[str, Any]] = {}
    with harness.process_group() as device:
        world = dist.get_world_size()
        mesh = ParallelDims(dp_replicate=1, dp_shard=world, tp=1, world_size=world).build_mesh(device.type)["dp_shard"]
        for name in args.setups:
            mine = measure(
                SETUPS[name],
                model_args=model_args,
                mesh=mesh,
                batch=args.batch_size,
                seq_len=args.seq_len,
                device=device,
            )
            everyone: list[dict[str, Any]] = [{} for _ in range(world)]
            dist.all_gather_object(everyone, mine)
            # Rank 0's numbers; the busiest rank's where ranks differ (uneven shards).
            row = dict(everyone[0])
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "device_total_bytes"):
                row[key] = max(r[key] for r in everyone)
            row["per_rank_device_total_bytes"] = [r["device_total_bytes"] for r in everyone]
            setups[name] = row
        loss = loss_phase(**(LOSS_PHASE | {"dim": args.loss_dim})) if dist.get_rank() == 0 else {}
    meta = {"flavor": args.flavor, "seq_len": args.seq_len, "local_batch_size": args.batch_size, "world": world}
    return {**meta, "setups": setups, "loss_phase": loss}


def main(argv: list[str] | None = None) -> int:
    return harness.main("memory", argv, doc=__doc__, add_args=add_args, measure=measure_args, table=table, world=2)


if __name__ == "__main__":
    raise SystemExit(main())
