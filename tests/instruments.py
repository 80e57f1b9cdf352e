"""Counters of what really ran (module calls, aten ops, collectives, host reads, live bytes), which the tests
and `make bench` use to count recomputation, communication and memory instead of assuming them. Nothing
in the training code imports this module; `observe_ops`, which the estimator's trace uses too, lives in
planning/estimate_memory.py."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import traceback
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from planning.trace import observe_ops

__all__ = [
    "Collective", "CollectiveLog", "LiveBytes", "count_calls", "count_host_reads", "count_ops", "mesh_group_dims",
    "observe_ops",
]  # fmt: skip


@contextlib.contextmanager
def count_calls(root: nn.Module, module_type: type[nn.Module] | tuple[type[nn.Module], ...]) -> Iterator[Counter[str]]:
    """Count forward calls, by name, of each submodule of `root` that is a `module_type`.

    Forward hooks also fire when activation checkpointing recomputes a block, so per step the
    attention count is 1 per block without AC, 2 with AC and 3 when two checkpoints are nested
    and either is reentrant (docs/failures.md #1). Eager mode only: inside a compiled region the
    hooks are traced once, not run per call.
    """
    counts: Counter[str] = Counter()
    handles = [
        module.register_forward_hook(functools.partial(_count_hook, counts, name))
        for name, module in root.named_modules()
        if isinstance(module, module_type)
    ]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def _count_hook(counts: Counter[str], name: str, *_: Any) -> None:
    counts[name] += 1


@contextlib.contextmanager
def count_ops() -> Iterator[Counter[torch._ops.OpOverload]]:
    """Count, per op overload, the ops that actually run inside the block.

    Wrap `loss.backward()` to see what was recomputed: under selective op AC the saved ops come
    from the cache and are not counted.
    """
    counts: Counter[torch._ops.OpOverload] = Counter()
    with observe_ops(lambda op, *_: counts.update([op])):
        yield counts


# Collectives, as the dispatcher runs them (observe_ops): FSDP2 calls c10d directly, DTensor lowers itself
# to functional collectives, pipeline stages send and receive. The payload S of each: the gathered output of
# an all-gather, the input of a reduce-scatter, the all-reduced tensor, the tensor sent.
c10d = torch.ops.c10d
funcol = torch.ops._c10d_functional
# op packet -> (kind, name of the argument holding the full-size payload S, multiply by group size)
_COLLECTIVES: dict[Any, tuple[str, str, bool]] = {
    c10d._allgather_base_: ("all_gather", "output_tensor", False),
    c10d.allgather_into_tensor_coalesced_: ("all_gather", "outputs", False),
    c10d.allgather_: ("all_gather", "output_tensors", False),
    c10d._reduce_scatter_base_: ("reduce_scatter", "input_tensor", False),
    c10d.reduce_scatter_tensor_coalesced_: ("reduce_scatter", "inputs", False),
    c10d.reduce_scatter_: ("reduce_scatter", "input_tensors", False),
    c10d.allreduce_: ("all_reduce", "tensors", False),
    c10d.allreduce_coalesced_: ("all_reduce", "tensors", False),
    funcol.all_reduce: ("all_reduce", "input", False),
    funcol.all_reduce_: ("all_reduce", "input", False),
    funcol.all_reduce_coalesced: ("all_reduce", "inputs", False),
    funcol.all_reduce_coalesced_: ("all_reduce", "inputs", False),
    funcol.all_gather_into_tensor: ("all_gather", "input", True),
    funcol.all_gather_into_tensor_out: ("all_gather", "input", True),
    funcol.all_gather_into_tensor_coalesced: ("all_gather", "inputs", True),
    funcol.reduce_scatter_tensor: ("reduce_scatter", "input", False),
    funcol.reduce_scatter_tensor_coalesced: ("reduce_scatter", "inputs", False),
    c10d.send: ("send", "tensors", False),  # pipeline stages: point to point
    c10d.recv_: ("recv", "tensors", False),
}
_GROUP_ARGS = ("process_group", "group_name")


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # all_gather | reduce_scatter | all_reduce | send | recv | other:<name>
    dim: str  # mesh dimension of the group ("dp_shard", "dp_replicate", ...) or "other"
    ranks: tuple[int, ...]  # the group's global ranks, in group-rank order
    payload_bytes: int  # S: gathered output / reduce-scatter input / all-reduced tensor / tensor sent

    @property
    def sent_per_rank(self) -> int:
        """Bytes each rank of the group sends (= bytes on each directed ring link); for a send, the sender's; for an
        all_to_all, this rank's to the others (its payload)."""
        n = len(self.ranks)
        if self.op in ("send", "all_to_all"):
            return self.payload_bytes
        if self.op == "all_reduce":
            return 2 * (n - 1) * self.payload_bytes // n
        if self.op in ("all_gather", "reduce_scatter"):
            return (n - 1) * self.payload_bytes // n
        return 0

    def crossing_links(self, ranks_per_node: int) -> int:
        """Directed links of the rank-ordered ring whose two ends sit on different nodes."""
        if len(self.ranks) == 1:
            return 0
        ring = zip(self.ranks, self.ranks[1:] + self.ranks[:1], strict=True)
        return sum(a // ranks_per_node != b // ranks_per_node for a, b in ring)


def mesh_group_dims(mesh: Any) -> dict[tuple[int, ...], str]:
    """The ranks of this rank's group in each dimension of a DeviceMesh -> that dimension's name; a flattened
    dimension (FSDP's "dp_shard_cp" under context parallel) names its group where no dimension of the mesh has
    the same ranks."""
    flattened = getattr(mesh._get_root_mesh(), "_flatten_mapping", {})  # (private, PyTorch 2.13)
    groups = {tuple(dist.get_process_group_ranks(m.get_group())): name for name, m in flattened.items()}
    # Groups over several dimensions made by hand (Muon's over FSDP x TP, muon.py): "dp_shard_tp".
    coordinate, names = mesh.get_coordinate(), mesh.mesh_dim_names
    for size in range(2, len(names) + 1):
        for dims in itertools.combinations(range(len(names)), size):
            index = tuple(slice(None) if i in dims else c for i, c in enumerate(coordinate))
            ranks = tuple(sorted(mesh.mesh[index].flatten().tolist()))
            groups.setdefault(ranks, "_".join(names[i] for i in dims))
    return groups | {tuple(dist.get_process_group_ranks(mesh.get_group(d))): d for d in mesh.mesh_dim_names}


def _process_group(arg: Any) -> ProcessGroup:
    # c10d ops receive the group boxed as a TorchScript object, functional collectives its name
    # (or the group itself). Both ways back to the ProcessGroup are private torch APIs (2.13).
    if isinstance(arg, ProcessGroup):
        return arg
    if isinstance(arg, str):
        return dist.distributed_c10d._resolve_process_group(arg)
    return ProcessGroup.unbox(arg)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(_nbytes(v) for v in value)  # lists (of lists) of tensors


def _sent_to_others(bound: dict[str, Any], group: ProcessGroup) -> int:
    """An all_to_all_single's bytes from this rank to the others: its input but the split it keeps."""
    sent = bound["input"]
    splits = bound.get("input_split_sizes") or [sent.shape[0] // group.size()] * group.size()
    row = sent[0].numel() * sent.element_size() if sent.shape[0] else 0
    return (sum(splits) - splits[group.rank()]) * row


class CollectiveLog:
    """An `observe_ops` callback: records every collective with its group and payload size.

    group_dims: `mesh_group_dims(mesh)`, to name each group's mesh dimension."""

    def __init__(self, group_dims: dict[tuple[int, ...], str]):
        # A group's ranks -> the mesh dimension they make up (DTensor and the pipeline may use other group
        # objects over the same ranks).
        self.group_dims = group_dims
        self.records: list[Collective] = []

    def __call__(self, op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        # A collective is a c10d op with a process group; wait_tensor and friends have none.
        if op.namespace not in ("c10d", "_c10d_functional"):
            return
        # strict=False: trailing arguments with defaults may be left out of `args`.
        bound = {a.name: v for a, v in zip(op._schema.arguments, args, strict=False)} | kwargs
        group = next((bound[name] for name in _GROUP_ARGS if bound.get(name) is not None), None)
        if group is not None:
            self.records.append(self._record(op, bound, _process_group(group)))

    def _record(self, op: torch._ops.OpOverload, bound: dict[str, Any], group: ProcessGroup) -> Collective:
        ranks = tuple(dist.get_process_group_ranks(group))
        dim = self.group_dims.get(ranks, "other")
        if op._overloadpacket in (c10d.alltoall_base_, funcol.all_to_all_single):
            return Collective("all_to_all", dim, ranks, _sent_to_others(bound, group))
        if op._overloadpacket not in _COLLECTIVES:
            return Collective(f"other:{op._opname}", dim, ranks, 0)
        kind, payload_arg, times_group = _COLLECTIVES[op._overloadpacket]
        payload = _nbytes(bound[payload_arg]) * (len(ranks) if times_group else 1)
        return Collective(kind, dim, ranks, payload)


# What reads a tensor's value into Python: on a GPU each one waits for the device (a host sync).
_HOST_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu,
    torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
}  # fmt: skip


class _HostReads(TorchFunctionMode):
    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.found = device, Counter[str]()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _HOST_READS and isinstance(args[0], torch.Tensor) and args[0].device.type == self.device.type:
            self._record(func.__name__)
        return func(*args, **(kwargs or {}))

    @torch.compiler.disable
    def _record(self, name: str) -> None:
        torch_root = str(Path(torch.__file__).parent)
        outside = (f for f in reversed(traceback.extract_stack()) if f.filename != __file__)
        caller = next(f for f in outside if not f.filename.startswith(torch_root))  # the recipe's line
        self.found[f"{name} at {Path(caller.filename).name}:{caller.lineno}"] += 1


@contextlib.contextmanager
def count_host_reads(device: torch.device) -> Iterator[Counter[str]]:
    """Count, by call site, the reads of `device` tensors into Python (`.item()`, `.tolist()`, `bool()`,
    `.cpu()`, ...) inside the block: on a GPU each is a host sync, the CPU waiting for the device.

    A step that logs nothing should read nothing (train.train_step returns device tensors). On a CPU
    device every tensor counts; host-side tensors that never touch a GPU (the stop request's flags
    on a gloo group) are read outside train_step.
    """
    mode = _HostReads(device)
    with mode:
        yield mode.found


class LiveBytes:
    """Bytes of the tensors created inside `track()` that are still alive, and their peak.

    Every op output's storage is remembered through a weak reference; after each op the storages
    still alive are summed, each at its size then: FSDP frees a gathered parameter by resizing its
    storage to 0 bytes and grows it again to gather it, the storage object living on. The peak is thus
    what the ops of the block held at once on top of what existed before it (inputs, parameters),
    temporaries and autograd's saved tensors included.
    Eager mode, one thread (CPU backward runs on the caller's thread): what the tests and
    `make bench` use to weigh the loss on machines without a CUDA allocator to ask.
    """

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        # Keyed by the Python storage object, unique per live storage (an address is not: a resized storage moves).
        self.live: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.peak = 0
        # Tensors from before the block, which in-place ops return as their outputs: not counted.
        self.existing = {t.untyped_storage().data_ptr() for t in existing}

    def _on_op(self, op: torch._ops.OpOverload, args: Any, kwargs: Any, out: Any) -> None:
        for t in torch.utils._pytree.tree_leaves(out):
            # Wrappers without storage of their own (DTensor, a functional collective's AsyncCollectiveTensor): the
            # tensor they wrap is an op's output, counted there.
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor | AsyncCollectiveTensor):
                storage = t.untyped_storage()
                if storage.data_ptr() in self.existing:
                    continue
                known = self.live.get(id(storage))
                if known is None or known() is not storage:  # an id of a dead object given out again
                    self.live[id(storage)] = weakref.ref(storage)
        self.live = {key: ref for key, ref in self.live.items() if ref() is not None}
        self.peak = max(self.peak, sum(ref().nbytes() for ref in self.live.values()))  # type: ignore[union-attr]

    @contextlib.contextmanager
    def track(self) -> Iterator[LiveBytes]:
        with observe_ops(self._on_op):
            yield self
