"""The recipe's CUDA-only paths, checked on values: FlexAttention block-causal, async checkpoints through pinned
memory, profiler traces and CUDA memory snapshots.

    python -m benchmarks.cuda_paths --out outputs/bench/cuda_paths.json            # on a GPU
    python -m benchmarks.cuda_paths --out /tmp/cuda_paths.json --rehearse          # on CPU, a few seconds
    python -m benchmarks.cuda_paths --only flex,profile ...                        # some of the checks

Checks (`--only`, comma-separated; all by default):
  flex        models/attention.py's ScaledDotProductAttention with the FlexAttention BlockMask document_mask builds
              on CUDA (compiled flex_attention) against the same module with the dense additive mask (SDPA), on the
              same q, k, v (grouped-query) and document segments of a packed window, forward and backward, float32
              and bfloat16. Each output and q/k/v gradient is compared with a float64 reference (softmax(q k^T /
              sqrt(d) + mask) v in plain torch ops, its mask built here from the segments): passes when
              max |x - ref| <= tolerance * max(1, max |ref|), tolerance 1e-4 (float32), 3e-2 (bfloat16). Also the
              max |flex - SDPA|, and the ms of a forward + backward of each.
  async_save  checkpoint/manager.py's CheckpointManager, checkpoint.async_mode "async" against "async_with_pinned_mem" (one
              process, a one-rank gloo group as train.py opens without torchrun): the seconds the training loop is
              held by a save (save() returning, plus wait_for_staging() before the next optimizer step), and
              after the save finished, the weights and AdamW state a fresh model loads back are those of the saved
              step exactly (the live ones were changed after the save returned).
  profile     train.py (one rank, a subprocess) with --profiling.enable_profiling and enable_memory_snapshot: the
              trace and snapshot files are where docs/metrics.md says (the paths are read from it), the trace
              parses and holds CUDA kernels (CPU ops on CPU), the snapshot pickle loads and holds the allocator's
              segments (CUDA only).

--rehearse (CPU): every check through the same code at tiny shapes, each CUDA-only call replaced by its CPU
counterpart or skipped with the reason printed: flex runs the same module through eager flex_attention, forward
only (torch refuses its CPU backward; compiling it on CPU takes tens of seconds); async_save saves with "async" and
the pinned side prints why CheckpointManager refuses it; profile runs train.py on CPU and checks the traces, and
that no snapshot was written (the CUDA caching allocator's). Each check's outcome is "passed", "failed" or
"skipped" with its reason; any "failed" makes the command exit 1 (the JSON is still written).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pickle
import re
import shutil
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import StagingOptions

from benchmarks import harness
from benchmarks.harness import Row
from checkpoint import CheckpointManager
from config import REPO

PROBLEM = "CUDA paths"
CHECKS = ("flex", "async_save", "profile")
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # of max |x - float64 reference|, times max(1, max |reference|)
DTYPES = (torch.float32, torch.bfloat16)
PARTS = ("out", "dq", "dk", "dv")

# What each check runs at, on a GPU and in the CPU rehearsal.
SHAPES: dict[str, dict[str, Any]] = {
    "gpu": {"batch": 1, "heads": 32, "kv_heads": 8, "seq_len": 4096, "head_dim": 128, "docs": 7, "iters": 10,
            "ckpt_flavor": "llama3_1b", "ckpt_layers": 2, "profile_steps": 4},
    "rehearsal": {"batch": 1, "heads": 4, "kv_heads": 2, "seq_len": 256, "head_dim": 16, "docs": 3, "iters": 1,
                  "ckpt_flavor": "debugmodel", "ckpt_layers": 2, "profile_steps": 2},
}  # fmt: skip


def _say(message: str) -> None:
    print(f"cuda_paths: {message}", flush=True)


def _skipped(reason: str, **extra: Any) -> dict[str, Any]:
    _say(f"skipped: {reason}")
    return {"status": "skipped", "reason": reason, **extra}


def _timed(fn: Callable[[], Any], *, device: torch.device, iters: int, warmup: int = 1) -> float:
    """Median ms of `fn` over `iters` calls after `warmup`, the device synchronized around each."""
    for _ in range(warmup if device.type == "cuda" else 0):  # CUDA: compiles, autotunes, allocates
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1000 * (time.perf_counter() - begin))
    return statistics.median(times)


def _once(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """fn() and its ms, the device synchronized."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    begin = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, 1000 * (time.perf_counter() - begin)


# ---------------------------------------------------------------------------------------------- 1. flex


def packed_segments(batch: int, seq_len: int, docs: int, *, seed: int = 0) -> torch.Tensor:
    """(batch, seq_len) document index of each token: `docs` documents of random lengths per row."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        starts = torch.randperm(seq_len - 1, generator=generator)[: docs - 1] + 1
        row = torch.zeros(seq_len, dtype=torch.int32)
        row[starts] = 1
        rows.append(torch.cumsum(row, 0, dtype=torch.int32))
    return torch.stack(rows)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v in plain ops, (bs, seq, heads, d) in, (bs, seq, heads * d) out; the
    document-causal mask built from `segments` here, not by models/attention.py."""
    bs, seq, heads, dim = q.shape
    n_rep = heads // k.shape[2]
    k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / dim**0.5
    positions = torch.arange(seq, device=q.device)
    allowed = (segments[:, :, None] == segments[:, None, :]) & (positions[:, None] >= positions[None, :])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(bs, seq, heads * dim)


@contextlib.contextmanager
def _eager_flex() -> Iterator[None]:
    """models/attention.py's module with eager flex_attention in place of the compiled one (the CPU rehearsal)."""
    from torch.nn.attention.flex_attention import flex_attention

    from models import attention

    saved = attention._compiled_flex
    attention._compiled_flex = flex_attention
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            yield
    finally:
        attention._compiled_flex = saved


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    return None if a is None or b is None else (a.double() - b.double()).abs().max().item()


def _flex_dtype(shape: dict[str, Any], dtype: torch.dtype, device: torch.device, notes: list[str]) -> dict[str, Any]:
    from models.attention import ScaledDotProductAttention, document_mask

    attention = ScaledDotProductAttention()
    b, s, h, kvh, d = (shape[key] for key in ("batch", "seq_len", "heads", "kv_heads", "head_dim"))
    generator = torch.Generator().manual_seed(1)
    inputs64 = [torch.randn(b, s, heads, d, generator=generator, dtype=torch.float64) for heads in (h, kvh, kvh)]
    grad_out = torch.randn(b, s, h * d, generator=generator, dtype=torch.float64).to(device)
    segments = packed_segments(b, s, shape["docs"]).to(device)
    # The reference sees the very values the dtype's inputs hold.
    inputs = [x.to(dtype).to(device) for x in inputs64]

    ref_in = [x.double().requires_grad_() for x in inputs]
    ref_out = reference_attention(*ref_in, segments)
    ref_out.backward(grad_out)
    reference = {"out": ref_out.detach(), **{f"d{n}": x.grad for n, x in zip("qkv", ref_in, strict=True)}}
    del ref_in, ref_out

    dense, dense_ms = _once(lambda: document_mask(segments, dtype=dtype, block_mask=False), device)
    # What document_mask builds on CUDA by default (its first call also warms up torch's vmap machinery).
    blocks, block_ms = _once(lambda: document_mask(segments, block_mask=True), device)

    def run(mask: Any, *, backward: bool) -> dict[str, torch.Tensor | None]:
        leaves = [x.detach().requires_grad_(backward) for x in inputs]
        out = attention(*leaves, mask)
        if backward:
            out.backward(grad_out.to(dtype))
        return {"out": out.detach(), **{f"d{n}": x.grad for n, x in zip("qkv", leaves, strict=True)}}

    sdpa = run(dense, backward=True)
    flex_backward = True
    try:
        flex = run(blocks, backward=True)
    except NotImplementedError as error:  # FlexAttention's CPU backward: torch refuses it
        if device.type == "cuda":
            raise
        flex_backward = False
        note = f"flex backward not run on {device.type}: {error}"
        if note not in notes:
            notes.append(note)
            _say(note)
        flex = run(blocks, backward=False)

    scale = {part: max(1.0, reference[part].abs().max().item()) for part in PARTS}
    flex_err = {part: _max_diff(flex[part], reference[part]) for part in PARTS}
    sdpa_err = {part: _max_diff(sdpa[part], reference[part]) for part in PARTS}
    tolerance = TOLERANCE[str(dtype).removeprefix("torch.")]
    within = {part: err <= tolerance * scale[part] for part, err in flex_err.items() if err is not None}
    compared = set(PARTS) if flex_backward else {"out"}  # a missing gradient is a failure, not a pass
    sdpa_within = {part: err <= tolerance * scale[part] for part, err in sdpa_err.items() if err is not None}

    iters = shape["iters"]
    sdpa_ms = _timed(lambda: run(dense, backward=True), device=device, iters=iters)
    flex_ms = _timed(lambda: run(blocks, backward=flex_backward), device=device, iters=iters)
    sdpa_fwd_ms = _timed(lambda: run(dense, backward=False), device=device, iters=iters)
    return {
        "dtype": str(dtype).removeprefix("torch."), "tolerance": tolerance, "scale": scale,
        "flex_error": flex_err, "sdpa_error": sdpa_err, "flex_vs_sdpa": {p: _max_diff(flex[p], sdpa[p]) for p in PARTS},
        "within": within, "sdpa_within": sdpa_within, "ok": set(within) == compared and all(within.values()),
        "flex_backward": flex_backward,
        "flex_ms": flex_ms, "flex_timed": "forward + backward" if flex_backward else "forward",
        "sdpa_ms": sdpa_ms, "sdpa_forward_ms": sdpa_fwd_ms, "dense_mask_ms": dense_ms, "block_mask_ms": block_ms,
    }  # fmt: skip


def check_flex(shape: dict[str, Any], device: torch.device) -> dict[str, Any]:
    notes: list[str] = []
    context = contextlib.nullcontext() if device.type == "cuda" else _eager_flex()
    if device.type != "cuda":
        notes.append(
            "compiled flex_attention is CUDA's path; on CPU its compile takes tens of seconds, so the same module runs "
            "eager flex_attention (the BlockMask is the one document_mask builds on CUDA)"
        )
        _say(notes[-1])
    with context:
        by_dtype = {str(dt).removeprefix("torch."): _flex_dtype(shape, dt, device, notes) for dt in DTYPES}
    shape_keys = ("batch", "heads", "kv_heads", "seq_len", "head_dim", "docs")
    return {
        "status": "passed" if all(r["ok"] for r in by_dtype.values()) else "failed",
        "reason": None, "notes": notes, "shape": {k: shape[k] for k in shape_keys}, "dtypes": by_dtype,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }  # fmt: skip


# ----------------------------------------------------------------------------------------- 2. async_save


@contextlib.contextmanager
def _one_rank_group() -> Iterator[None]:
    """A one-process gloo group (what train.py opens without torchrun) unless one is open; DCP's process-based
    async saver reads its rank and world from it, and its daemon rendezvouses at MASTER_ADDR (127.0.0.1 if unset)."""
    if dist.is_initialized():
        yield
        return
    had_addr = "MASTER_ADDR" in os.environ
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if not had_addr:
            os.environ.pop("MASTER_ADDR", None)


def _checkpoint_model(flavor: str, n_layers: int, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The flavor with n_layers blocks and AdamW with its moments, on device (normal weights: the values are what the
    check compares, not a model to train; init_weights' truncated normals take seconds on CPU)."""
    from models.llama3 import FLAVORS, Transformer

    args = dataclasses.replace(FLAVORS[flavor], n_layers=n_layers)
    with torch.device(device):
        model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    _optimizer_step(model, optimizer, seed=0)  # AdamW's moments exist
    return model, optimizer


def _optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, seed: int) -> None:
    torch.manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every weight and AdamW state tensor, cloned, by name."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optimizer.{names[id(p)]}.{key}"] = value.detach().clone()
    return out


class _Unpinned(CheckpointManager):
    """CheckpointManager staging async_with_pinned_mem's saves into ordinary memory (a CPU has no pinned or shared
    staging to give): the CPU rehearsal of that mode's branch."""

    PINNED = StagingOptions(
        use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False
    )


def _save_mode(mode: str, trained: tuple[Any, Any], fresh: tuple[Any, Any], folder: Path) -> dict[str, Any]:
    """Save `trained` twice with async_mode `mode` (the second timed), load the second save into `fresh`."""
    from config import Checkpoint
    from errors import ConfigError

    cfg = Checkpoint(enable=True, async_mode=mode, keep_latest_k=1)  # type: ignore[arg-type]
    dump = folder / mode
    model, optimizer = trained
    counterpart = None
    try:
        manager = CheckpointManager(cfg, dump_folder=str(dump), model=model, optimizer=optimizer, stateful={})
    except ConfigError as error:  # async_with_pinned_mem without CUDA: its branch, pinned and shared memory off
        counterpart = (
            f"{error}; rehearsed instead: CheckpointManager's {mode} branch (staged in a background thread, uploaded "
            "by DCP's checkpoint process) with a stager that pins no memory and shares none"
        )
        _say(f"async_save: {counterpart}")
        plain = dataclasses.replace(cfg, async_mode="async")  # built so (__init__ refuses the mode without CUDA),
        manager = _Unpinned(plain, dump_folder=str(dump), model=model, optimizer=optimizer, stateful={})
        manager.cfg = cfg  # then saving in the mode's branch
    held: list[dict[str, float]] = []
    expected: dict[str, torch.Tensor] = {}
    for step in (1, 2):  # step 1: the first save (the pinned saver starts its process); step 2 is timed
        if step == 2:
            manager.close()  # step 1's upload done, as a save interval later in training
            expected = _state(model, optimizer)
        begin = time.perf_counter()
        manager.save(step)
        returned = time.perf_counter() - begin
        manager.wait_for_staging()  # what train.py does before the next optimizer step
        held.append({"save": returned, "staged": time.perf_counter() - begin})
        _optimizer_step(model, optimizer, seed=step)  # the live weights move on while the save writes
    begin = time.perf_counter()
    manager.close()  # the upload's end
    finish = time.perf_counter() - begin
    changed = sum(not torch.equal(t, expected[n]) for n, t in _state(model, optimizer).items())

    fresh_model, fresh_optimizer = fresh
    _optimizer_step(fresh_model, fresh_optimizer, seed=99)  # whatever it held before is not what it loads
    loader = CheckpointManager(
        Checkpoint(enable=True), dump_folder=str(dump), model=fresh_model, optimizer=fresh_optimizer, stateful={}
    )
    loader.load()
    resumed = loader.resume_step()
    loaded = _state(fresh_model, fresh_optimizer)
    unequal = sorted(n for n, t in expected.items() if n not in loaded or not torch.equal(loaded[n], t))
    size = sum(f.stat().st_size for f in (dump / cfg.folder / "step-2").iterdir())
    shutil.rmtree(dump, ignore_errors=True)
    problems = [f"loaded step {resumed}, not 2"] if resumed != 2 else []
    problems += [f"{len(unequal)} tensors load back unequal, e.g. {unequal[:3]}"] if unequal else []
    problems += [] if changed else ["the live state did not change after the save (nothing to tell apart)"]
    return {
        "status": "failed" if problems else "passed", "reason": "; ".join(problems) or None, "cpu_counterpart": counterpart,
        "first_save_held_s": held[0]["staged"], "save_returned_s": held[1]["save"], "held_s": held[1]["staged"],
        "close_s": finish, "tensors": len(expected), "unequal": len(unequal), "changed_after_save": changed,
        "checkpoint_bytes": size, "resumed_step": resumed,
    }  # fmt: skip


@contextlib.contextmanager
def _stop_checkpoint_process(executor: Any, *, unless: Any) -> Iterator[None]:
    """End the checkpoint process DCP started for the pinned saves (it would outlive the group it joined)."""
    try:
        yield
    finally:
        process = executor._CHECKPOINT_PROCESS
        if process is not None and process is not unless:
            executor._CHECKPOINT_PROCESS = None
            process.__del__()  # asks it to stop, then terminates it after 5 s


def check_async_save(shape: dict[str, Any], device: torch.device, folder: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint import _async_process_executor as executor

    modes = {}
    trained, fresh = (_checkpoint_model(shape["ckpt_flavor"], shape["ckpt_layers"], device) for _ in range(2))
    daemon_before = executor._CHECKPOINT_PROCESS  # private (PyTorch 2.13): DCP's checkpoint process, one per process
    with _one_rank_group(), _stop_checkpoint_process(executor, unless=daemon_before):
        for mode in ("async", "async_with_pinned_mem"):
            modes[mode] = _save_mode(mode, trained, fresh, folder)
            m = modes[mode]
            if m["status"] != "skipped":
                _say(
                    f"async_save {mode}: loop held {m['held_s']:.3f} s (save() returned after {m['save_returned_s']:.3f} "
                    f"s), loaded back: {m['tensors'] - m['unequal']}/{m['tensors']} tensors equal"
                )
    statuses = {m["status"] for m in modes.values()}
    status = "failed" if "failed" in statuses else "passed" if "passed" in statuses else "skipped"
    parameters = sum(p.numel() for p in trained[0].parameters())
    reason = "; ".join(f"{mode}: {m['reason']}" for mode, m in modes.items() if m["reason"]) or None
    return {"status": status, "reason": reason, "flavor": shape["ckpt_flavor"], "n_layers": shape["ckpt_layers"],
            "parameters": parameters, "modes": modes}  # fmt: skip


# -------------------------------------------------------------------------------------------- 3. profile


def documented_paths(doc: Path = REPO / "docs" / "metrics.md") -> dict[str, str]:
    """The trace and memory snapshot paths docs/metrics.md gives, relative to <dump_folder>."""
    text = doc.read_text()
    found = {}
    for kind, suffix in (("trace", r"_trace\.json"), ("memory_snapshot", r"_memory_snapshot\.pickle")):
        match = re.search(rf"`<dump_folder>/([^`]*{suffix})`", text)
        if match is None:
            raise ValueError(f"{doc}: no `<dump_folder>/...{suffix.replace(chr(92), '')}` path")
        found[kind] = match.group(1)
    return found


def _expand(pattern: str, *, step: int, rank: int = 0) -> str:
    return pattern.replace("<step>", str(step)).replace("<r>", str(rank))


def check_profile(shape: dict[str, Any], cuda: bool, folder: Path) -> dict[str, Any]:
    steps, freq = shape["profile_steps"], shape["profile_steps"] // 2
    dump = folder / "profile_run"
    argv = [
        "train.py", "--config", "configs/debug.toml", f"--job.dump_folder={dump}", f"--training.steps={steps}",
        "--training.seq_len=64", "--training.local_batch_size=2", "--validation.enable=false", "--eval.enable=false",
        "--checkpoint.enable=false", "--metrics.log_freq=1", "--lr_scheduler.warmup_steps=1",
        "--profiling.enable_profiling", f"--profiling.profile_freq={freq}", "--profiling.profiler_active=1",
        "--profiling.profiler_warmup=0", "--profiling.enable_memory_snapshot",
    ]  # fmt: skip
    env = None if cuda else {"CUDA_VISIBLE_DEVICES": ""}
    begin = time.perf_counter()
    proc = harness.run_python(*argv, nproc=1, capture=True, timeout=600, env=env)
    seconds = time.perf_counter() - begin
    if proc.returncode != 0:
        return {"status": "failed", "reason": f"train.py exited {proc.returncode}: {proc.stderr[-2000:]}",
                "seconds": seconds}  # fmt: skip
    paths = documented_paths()
    profiled = list(range(freq, steps + 1, freq))
    traces = {}
    problems = []
    for step in profiled:
        path = dump / _expand(paths["trace"], step=step)
        if not path.is_file():
            problems.append(f"no trace at {path} (docs/metrics.md's path)")
            continue
        events = json.loads(path.read_text())["traceEvents"]
        kernels = sum(e.get("cat") == "kernel" for e in events)
        cpu_ops = sum(e.get("cat") == "cpu_op" and str(e.get("name", "")).startswith("aten::") for e in events)
        steps_marked = sum(str(e.get("name", "")).startswith("ProfilerStep#") for e in events)
        traces[str(step)] = {"path": str(path.relative_to(dump)), "events": len(events), "kernels": kernels,
                             "aten_cpu_ops": cpu_ops, "profiler_steps": steps_marked}  # fmt: skip
        if (kernels if cuda else cpu_ops) == 0 or steps_marked == 0:
            problems.append(f"{path}: {kernels} kernels, {cpu_ops} aten CPU ops, {steps_marked} ProfilerStep marks")
    snapshots: dict[str, Any] = {}
    snapshot_reason = None
    for step in profiled:
        path = dump / _expand(paths["memory_snapshot"], step=step)
        if not cuda:
            if path.exists():
                problems.append(f"{path}: a memory snapshot on CPU")
            continue
        if not path.is_file():
            problems.append(f"no memory snapshot at {path} (docs/metrics.md's path)")
            continue
        with path.open("rb") as f:
            snapshot = pickle.load(f)  # written by this run, just now
        segments = len(snapshot.get("segments", []))
        entries = sum(len(trace) for trace in snapshot.get("device_traces", []))
        snapshots[str(step)] = {"path": str(path.relative_to(dump)), "segments": segments, "trace_entries": entries}
        if segments == 0 or entries == 0:
            problems.append(f"{path}: {segments} segments, {entries} allocator events")
    if not cuda:
        warned = "profiling.enable_memory_snapshot is ignored" in proc.stderr
        snapshot_reason = "memory snapshots are CUDA-only (the CUDA caching allocator's); train.py " + (
            "warned and wrote none" if warned else "did not warn"
        )
        _say(f"profile: snapshot skipped: {snapshot_reason}")
        if not warned:
            problems.append("train.py did not warn that enable_memory_snapshot is ignored on CPU")
    shutil.rmtree(dump, ignore_errors=True)
    return {
        "status": "failed" if problems else "passed", "reason": "; ".join(problems) or None, "seconds": seconds,
        "documented": paths, "steps": steps, "profile_freq": freq, "traces": traces, "snapshots": snapshots,
        "snapshot_skipped": snapshot_reason,
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------- command


_FAILED: list[str] = []


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available() and not args.rehearse
    if not cuda and not args.rehearse:
        raise SystemExit(
            "cuda_paths: this machine has no CUDA device; `--rehearse` runs the checks at tiny shapes on CPU"
        )
    mode = "gpu" if cuda else "rehearsal"
    shape = {**SHAPES[mode], **{k: v for k, v in vars(args).items() if k in SHAPES[mode] and v is not None}}
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    only = CHECKS if args.only is None else tuple(args.only)
    checks: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="cuda_paths_", dir=args.folder) as tmp:
        for name in only:
            _say(f"{name} ({mode}) ...")
            begin = time.perf_counter()
            try:
                if name == "flex":
                    checks[name] = check_flex(shape, device)
                elif name == "async_save":
                    checks[name] = check_async_save(shape, device, Path(tmp))
                else:
                    checks[name] = check_profile(shape, cuda, Path(tmp))
            except Exception as error:  # one broken path must not hide the others' results
                traceback.print_exc()
                checks[name] = {"status": "failed", "reason": f"{type(error).__name__}: {error}"}
            checks[name]["wall_s"] = time.perf_counter() - begin
            if cuda:
                torch.cuda.empty_cache()  # the next check's memory
            _say(f"{name}: {checks[name]['status']} ({checks[name]['wall_s']:.1f} s)")
    _FAILED[:] = [name for name, c in checks.items() if c["status"] == "failed"]
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return {"mode": mode, "device": name, "shape": shape, "checks": checks}


def rows(results: dict[str, Any]) -> list[Row]:
    out = []
    checks, where = results["checks"], "" if results["mode"] == "gpu" else " (CPU rehearsal)"
    flex = checks.get("flex", {})
    for dtype, r in flex.get("dtypes", {}).items():
        out.append(Row(problem=PROBLEM, metric=f"attention {r['flex_timed']} ms, {dtype}{where}", unit="ms",
                       broken="dense SDPA", broken_value=r["sdpa_ms"] if r["flex_backward"] else r["sdpa_forward_ms"],
                       fixed="flex block-causal", fixed_value=r["flex_ms"]))  # fmt: skip
    for dtype, r in flex.get("dtypes", {}).items():
        worst = max(PARTS, key=lambda p: -1 if r["flex_error"][p] is None else r["flex_error"][p] / r["scale"][p])
        out.append(Row(problem=PROBLEM, metric=f"max |x - float64 ref| / scale, {dtype} ({worst}){where}", unit="",
                       broken="dense SDPA", broken_value=r["sdpa_error"][worst] / r["scale"][worst],
                       fixed="flex block-causal", fixed_value=r["flex_error"][worst] / r["scale"][worst]))  # fmt: skip
    modes = checks.get("async_save", {}).get("modes", {})
    plain, pinned = modes.get("async", {}), modes.get("async_with_pinned_mem", {})
    if plain.get("status") == "passed" and pinned.get("status") == "passed":
        fixed = "async_with_pinned_mem" if pinned["cpu_counterpart"] is None else "its CPU counterpart (not pinned)"
        for key, what in (("save_returned_s", "save() call"), ("held_s", "save() + wait_for_staging()")):
            out.append(Row(problem=PROBLEM, metric=f"checkpoint save: training loop held by {what}{where}", unit="s",
                           broken="async", broken_value=plain[key], fixed=fixed, fixed_value=pinned[key]))  # fmt: skip
    return out


def table(results: dict[str, Any]) -> str:
    lines = [f"CUDA paths, {results['mode']} on {results['device']}"]
    for name, c in results["checks"].items():
        lines.append(f"{name}: {c['status']}" + (f" ({c['reason']})" if c.get("reason") else ""))
        for note in c.get("notes", []):
            lines.append(f"  note: {note}")
        for dtype, r in c.get("dtypes", {}).items():
            errors = ", ".join(
                f"{p} {r['flex_error'][p]:.2e}/{r['sdpa_error'][p]:.2e}"
                for p in PARTS
                if r["flex_error"][p] is not None
            )
            lines.append(
                f"  {dtype}: max |x - ref| flex/SDPA: {errors} (tolerance {r['tolerance']:g} x max(1, |ref|)); "
                f"{r['flex_timed']}: flex {r['flex_ms']:.2f} ms, SDPA {r['sdpa_ms']:.2f} ms fwd+bwd, "
                f"{r['sdpa_forward_ms']:.2f} ms fwd"
            )
        for mode, m in c.get("modes", {}).items():
            if m["status"] == "skipped":
                lines.append(f"  {mode}: skipped: {m['reason']}")
            else:
                lines.append(
                    f"  {mode}{' (CPU counterpart)' if m['cpu_counterpart'] else ''}: {m['status']}, a save of "
                    f"{m['checkpoint_bytes'] / 2**20:,.0f} MiB: save() returned after {m['save_returned_s']:.3f} s, "
                    f"staged after {m['held_s']:.3f} s (first save {m['first_save_held_s']:.3f} s), "
                    f"{m['tensors'] - m['unequal']}/{m['tensors']} tensors loaded back equal"
                    + (f": {m['reason']}" if m["reason"] else "")
                )
        for step, t in c.get("traces", {}).items():
            lines.append(f"  trace step {step}: {t['path']}, {t['kernels']} kernels, {t['aten_cpu_ops']} aten ops")
        for step, s in c.get("snapshots", {}).items():
            lines.append(f"  snapshot step {step}: {s['path']}, {s['segments']} segments")
        if c.get("snapshot_skipped"):
            lines.append(f"  memory snapshot: skipped: {c['snapshot_skipped']}")
    return "\n".join(lines)


def _checks(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if unknown := sorted(set(names) - set(CHECKS)):
        raise argparse.ArgumentTypeError(f"unknown check {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    return names


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rehearse", action="store_true", help="CPU: every check at tiny shapes, CUDA-only calls replaced")
    p.add_argument("--only", type=_checks, default=None, help=f"comma-separated checks of {', '.join(CHECKS)}")
    p.add_argument("--folder", type=Path, default=None, help="where checkpoints and runs go (default: the temp dir)")
    for key, value in SHAPES["gpu"].items():
        rehearsal = SHAPES["rehearsal"][key]
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None,
                       help=f"default {value} on GPU, {rehearsal} in the rehearsal")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    _FAILED.clear()
    code = harness.main("cuda_paths", argv, doc=__doc__ or "", add_args=add_args, measure=measure, table=table)
    if code == 0 and _FAILED:
        print(f"cuda_paths: failed: {', '.join(_FAILED)}", flush=True)
        return 1
    return code


if __name__ == "__main__":
    raise SystemExit(main())
