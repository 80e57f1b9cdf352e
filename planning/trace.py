"""What one block of a job's model costs, from the model itself: one forward and backward of a one-block model of the
job's family, parallelized as the run parallelizes it, on fake tensors, every op watched (what it saves for backward,
its widest projection output, its matmuls' inputs, its TP collectives). docs/planning.md, "How the estimator counts"."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import flop_counter

# TorchDispatchMode is the documented way to see every aten op, in a private module (PyTorch 2.13).
from torch.utils._python_dispatch import TorchDispatchMode

from errors import warn
from models import ModelFamily

if TYPE_CHECKING:
    from config import BlockMode
    from planning.job import Job

GiB = 2**30


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
    experts_params: int = 0
    """Of block_params, the routed experts' (the family's experts_module): what expert parallel splits over its ranks
    and FSDP shards over the ranks it leaves; 0 for a dense family."""
    experts_saved: int = 0
    """Of `saved`, what the routed experts keep for backward, their input rows included (tokens x top_k of this rank,
    as the trace routes them): what grows with the rows that routing sends to a rank's experts; 0 for a dense family."""
    backward_flops: int = 0
    """FLOPs of one block's backward on this rank (matmuls and attention, torch.utils.flop_counter's formulas),
    the AC mode's recomputation included."""
    recompute_flops: int = 0
    """What the AC mode adds to a block's backward: the FLOPs of its recomputation (backward_flops minus the
    backward_flops of the trace without AC)."""


_TRACES: dict[tuple, BlockCosts] = {}


def block_costs(job: Job, mode: BlockMode, *, tp_mesh: DeviceMesh | None = None) -> BlockCosts:
    """The costs of `trace_costs` of one micro-batch of `job` through one block under the block AC mode `mode` ("none",
    "op" or "full": parallelisms/ac.py block_modes), `saved` from a trace without AC; cached per shape.

    tp > 1 needs a TP mesh: `tp_mesh` (the run's mesh["tp"] when a process group runs), else a fake
    process group of tp ranks is started for the trace and ended after it."""
    traced = {}
    for m in dict.fromkeys(("none", mode)):
        key = (*_shape(job), m)
        if key not in _TRACES:
            with _tp_mesh(job.dims.tp, tp_mesh) as mesh:
                _TRACES[key] = trace_costs(job, m, tp_mesh=mesh)
        traced[m] = _TRACES[key]
    recompute = traced[mode].backward_flops - traced["none"].backward_flops
    none = traced["none"]
    return dataclasses.replace(
        traced[mode], saved=none.saved, experts_saved=none.experts_saved, recompute_flops=recompute
    )


def _shape(job: Job) -> tuple:
    """What a block's trace depends on: every job of these shares it."""
    t = job.cfg.training
    return (
        job.cfg.model.name,
        job.args,
        job.microbatch_tokens // job.local_seq_len,
        job.local_seq_len,
        t.mixed_precision_param,
        job.dims.tp,
        job.machine.norm,
        job.loss_parallel,
        job.chunk_tokens,
        t.z_loss_weight > 0,
        job.autocast,
        _lora_key(job.lora),
    )


def _lora_key(cfg: Any) -> tuple | None:
    """What of [lora] a block's trace depends on (its adapters' rank, targets and dropout); None without it."""
    return (cfg.r, tuple(cfg.target_modules), cfg.lora_dropout > 0) if cfg is not None else None


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


def trace_costs(job: Job, mode: BlockMode, *, tp_mesh: DeviceMesh | None = None) -> BlockCosts:
    """One forward and backward of a one-block model of the job's family on fake tensors (no memory, no compute), on
    this rank's tokens of one micro-batch, parallelized as a run does it (the family's TP plan over `tp_mesh`,
    `apply_ac` in the block AC mode `mode`; the loss.py loss of the job's chunk and z-loss, on vocabulary shards under
    loss parallel), watched op by op: parameters in param_dtype as FSDP's mixed precision gives them, or in float32
    under autocast to it, as one rank trains (parallelisms/fsdp.py autocast; its casts are activations then).

    Saved bytes are storages an op created that are still alive once forward is over (what autograd, a
    checkpoint or selective AC's cache hold), parameters and buffers not counted. So every term is
    whatever the family's modules really keep, SwiGLU or not. The kernels are this machine's (the
    CPU's); one difference matters on CUDA: nn.RMSNorm is a fused kernel there (PyTorch >= 2.8) that
    saves its input and one fp32 scale per row, where the CPU's composite one saves fp32 copies. With
    the machine's RMSNorm "fused" the trace counts each RMSNorm of an uncheckpointed block (and the final one) so.
    """
    from config import ActivationCheckpoint
    from loss import Loss
    from parallelisms import fsdp
    from parallelisms.ac import apply_ac
    from parallelisms.tp import apply_tp, loss_parallel_context

    family, seq_len, rmsnorm, autocast = job.fam, job.local_seq_len, job.machine.norm, job.autocast
    dtype, batch = getattr(torch, job.cfg.training.mixed_precision_param), job.microbatch_tokens // seq_len
    one = dataclasses.replace(job.args, n_layers=1, max_seq_len=seq_len, attn_mask_type="causal")
    with torch.device("meta"):
        model = family.model_cls(one).to(torch.float32 if autocast else dtype)
    model.init_buffers(torch.device("meta"))  # float32 again, as in training: FSDP's mixed precision casts parameters
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, block_plan=family.tp_plan, loss_parallel=job.loss_parallel, seq_len=seq_len)
    if job.lora is not None:  # the adapters as the run places them, the base frozen: autograd saves what they need
        from lora import apply_lora

        apply_lora(model, job.lora, family, base_dtype=dtype)  # the run stores its base so
        # The traced block stands for every block after the first, whose input has a gradient: the frozen embedding's
        # output has none, so it is made to ask for one.
        model.tok_embeddings.register_forward_hook(lambda module, args, out: out.requires_grad_())
    # The one block's mode, in the [activation_checkpoint] section apply_ac reads.
    apply_ac(model, ActivationCheckpoint(mode="per_block", per_block=[mode]), saved_linears=family.sac_saved_linears)
    block = model.layers["0"]
    if rmsnorm == "fused":
        _warn_unfused_norms(family, block)
    tp = tp_mesh.size() if tp_mesh is not None else 1
    experts = block.get_submodule(family.experts_module) if family.experts_module else None
    watch = _Watch(model, block, tp=tp, experts=experts)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        watch.skip |= {_key(_local(t)) for t in [*model.parameters(), *model.buffers()]}
        tokens, labels = (torch.randint(0, one.vocab_size, (batch, seq_len)) for _ in range(2))
        # The step's loss, as train.py computes it: its collectives count with the output projection's.
        with loss_parallel_context(tp_mesh is not None and job.loss_parallel):
            with observe_ops(watch.on_op):
                loss_fn = Loss(job.chunk_tokens, z_loss_weight=1.0 if job.cfg.training.z_loss_weight > 0 else 0.0)
                with fsdp.autocast(dtype if autocast else None, "cpu"):
                    loss = model(tokens, head=functools.partial(loss_fn, model, labels=labels)).total
            watch.phase = "after"
            saved, final_norm = watch.saved(block), watch.saved(model.norm)
            experts_saved = watch.saved(experts) if experts is not None else 0
            if rmsnorm == "fused":
                final_norm += watch.fused_correction(model.norm)
                if mode == "none":
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
        experts_params=_numel(experts) if experts is not None else 0,
        experts_saved=experts_saved,
        backward_flops=watch.backward_flops,
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


# torch.utils.flop_counter's formulas (matmuls, attention, forward and backward), plus the CPU's flash attention, which
# this machine's trace runs and which PyTorch 2.13 has no formula for: the same count as CUDA's (q, k, v come first).
# Looked up at each op, not copied at import, so that formulas registered later count too (a family's custom ops:
# models/qwen3_moe's grouped matmuls).
_AS_CUDA = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        torch.ops.aten._scaled_dot_product_flash_attention_backward
    ),
}


def _flop_formula(packet: Any) -> Any:
    return flop_counter.flop_registry.get(_AS_CUDA.get(packet, packet))


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

    def __init__(self, model: nn.Module, block: nn.Module, *, tp: int, experts: nn.Module | None = None):
        self.phase = "forward"  # forward, block forward, after, backward, block backward
        self.part = "embedding"  # outside the block: before it in forward (after it in backward), or the head
        self.skip: set[int] = set()
        self.created: dict[int, tuple[StorageWeakRef, int]] = {}  # every storage an op made, and its bytes
        self.windows: dict[nn.Module, dict] = {}  # module -> its forward's input, output and the storages it made
        self.linear_outputs: list[int] = []
        self.linear_inputs: dict[int, int] = {}
        self.comm: dict[str, Counter[str]] = defaultdict(Counter)  # part -> kind -> bytes
        self._open: list[nn.Module] = []
        self.backward_flops = 0
        self.block = block
        watched = [block, model.norm, *(m for m in block.modules() if isinstance(m, nn.RMSNorm))]
        watched += [experts] if experts is not None else []
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
            if self.phase == "block backward" and (formula := _flop_formula(op.overloadpacket)) is not None:
                self.backward_flops += formula(*args, **kwargs, out_val=out)
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
