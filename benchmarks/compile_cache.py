"""The inductor cache and async TP (docs/failures.md #4): who is served whose compiled graph.

    python -m benchmarks.compile_cache --out outputs/bench/compile_cache.json   # ~1 minute on 2 CPU cores

pytorch/torchtitan #1185: a plain-TP run died with "'symm_mem' object has no attribute
'fused_all_gather_matmul'": it had been served an FX graph compiled for async TP, because before
PyTorch 2.8 the FX graph cache key left out private inductor configs such as `_micro_pipeline_tp`
(the async-TP switch; fixed by pytorch/pytorch PR #153672). The recipe keys the cache directory on
every setting that changes generated code (`parallelisms.compile.inductor_cache_dir`), so that two
recipes never share compiled graphs, whatever the PyTorch version. Three parts:

1. Directories. Recipes that differ only in async TP (or TP degree, AC mode) get different
   `inductor_cache_dir`s; equal recipes get the same one, so reruns still start warm.

2. Real compiles on CPU. Each run is a fresh process that compiles (forward and backward) the
   recipe's model shrunk to one small block (debugmodel with dim 64, 1 layer, vocab 256, seq 32)
   with the recipe's own `apply_compile`, and reads inductor's FX graph cache counters. A "recipe"
   is a cache folder and a key here, not a different graph: async TP cannot compile on CPU
   (part 3), and on PyTorch 2.13 the key does include `_micro_pipeline_tp`, so the collision of
   #1185 cannot happen as such. What a pre-2.8 key saw for two recipes differing only in that
   flag is an identical key; an identical compile reproduces exactly that. First plain TP
   compiles cold into its own inductor_cache_dir; the shared folder then starts as a copy of it
   (what one folder for all recipes holds once plain TP has compiled). Then the async-TP recipe:
     shared folder, pre-2.8 key   the same inductor config as plain TP (its key before 2.8):
                                  served plain TP's graphs, the hits of #1185;
     keyed folders, pre-2.8 key   the same compile in the async-TP recipe's own folder: 0 hits,
                                  it compiles its own graphs;
     shared folder, 2.13 key      `_micro_pipeline_tp = True` (on CPU the pass finds no all-gather
                                  to fuse and the code is unchanged): PyTorch >= 2.8 puts it in the
                                  key, 0 hits; the C++ kernels, cached by their source, are reused;
   and plain TP again in its own folder: its own graphs back (warm). The first two async-TP runs
   go side by side (2 cores), as do the last two. Compile time = first step minus a later one;
   timings of a shared 2-core machine are as noisy as it is busy.

3. The refusal. Async TP needs torch.compile, CUDA with NCCL and symmetric memory, and a TP group
   of 2 or more; elsewhere `parallelisms.async_tp.apply_async_tp` raises a one-line ConfigError
   (called here on a 1-rank gloo mesh), and `python train.py --config configs/debug.toml
   --parallelism.enable_async_tensor_parallel --compile.enable` stops in parallelize_model, before
   any allocation, with exit status 2 (tensor_parallel_degree is 1).

What async TP is worth, measured by torchtitan on H100s (reference numbers, NOT measured here;
docs/failures.md #4): Llama 3 70B on 256 H100 (FSDP32 x TP8) bf16 597 -> 652 tokens/s/GPU
(1.09x), float8 tensorwise 810 -> 942 (1.16x), float8 rowwise 1.04x; Llama 3 8B on 64 H100
(FSDP8 x TP8, op SAC) 4378 -> 4809 (1.10x).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from benchmarks import harness
from benchmarks.harness import Row
from errors import ConfigError
from models.llama3 import FLAVORS, Transformer
from parallelisms.async_tp import apply_async_tp
from parallelisms.compile import apply_compile, inductor_cache_dir

PROBLEM = "#4 compile cache"
MODEL_ARGS = dataclasses.replace(
    FLAVORS["debugmodel"], dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32
)
BATCH, SEQ = 2, 32
# The two recipes of #1185 (Llama 3 8B, DP2 x TP4, op SAC), differing only in async TP, keyed as
# parallelize_model keys them (the AC option only for selective AC).
RECIPE = {"tp_degree": 4, "async_tp": False, "ac_mode": "selective", "ac_option": "op", "float8": ""}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain_tp": RECIPE,
    "async_tp": {**RECIPE, "async_tp": True},
    "plain_tp_again": RECIPE,
    "tp_8": {**RECIPE, "tp_degree": 8},
    "ac_full": {**RECIPE, "ac_mode": "full", "ac_option": ""},
}
REFERENCE_GPU = {
    "source": "torchtitan (docs/failures.md #4); not measured here",
    "unit": "tokens/s/GPU",
    "llama3_70b_256xH100_fsdp32_tp8_bf16": {"tp": 597, "async_tp": 652, "speedup": 1.09},
    "llama3_70b_256xH100_fsdp32_tp8_float8_tensorwise": {"tp": 810, "async_tp": 942, "speedup": 1.16},
    "llama3_70b_256xH100_fsdp32_tp8_float8_rowwise": {"speedup": 1.04},
    "llama3_8b_64xH100_fsdp8_tp8_op_sac": {"tp": 4378, "async_tp": 4809, "speedup": 1.10},
}


# ------------------------------------------------------------ 1. directories


def cache_dirs(root: Path) -> dict[str, str]:
    """The inductor cache folder each recipe variant gets under `root`."""
    return {name: str(inductor_cache_dir(recipe, root=root)) for name, recipe in VARIANTS.items()}


# -------------------------------------------------------- 2. real compiles


def compile_once(cache_dir: Path, *, micro_pipeline_tp: bool, kernels: bool = True) -> dict[str, Any]:
    """In this (fresh) process: compile MODEL_ARGS's block into `cache_dir`, two training steps, counters.
    kernels=False: inductor generates no kernels (`fallback_by_default`, in every run alike): the cache's keys and
    hits are the same, the compile times are not a real compile's (the tests' setting)."""
    # Private inductor configs and counters (PyTorch 2.13), used only here. compile_threads is left
    # out of every cache key; one thread compiles in-process instead of starting a worker pool.
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    inductor_config.compile_threads = 1
    # What parallelisms.async_tp.apply_async_tp sets (without the CUDA-only symmetric memory):
    # the flag the FX graph cache key ignored before PyTorch 2.8.
    inductor_config._micro_pipeline_tp = micro_pipeline_tp
    inductor_config.fallback_by_default = not kernels

    torch.manual_seed(0)
    model = Transformer(MODEL_ARGS)
    model.init_weights()
    apply_compile(model, cache_dir=cache_dir)  # the recipe's own: per-block compile into cache_dir
    tokens = torch.randint(0, MODEL_ARGS.vocab_size, (BATCH, SEQ + 1))

    def step() -> float:
        start = time.perf_counter()
        logits = model(tokens[:, :-1])  # (bs, seqlen, vocab)
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        return time.perf_counter() - start

    first = step()
    steady = min(step() for _ in range(3))
    return {
        "cache_dir": str(cache_dir),
        "micro_pipeline_tp": micro_pipeline_tp,
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
        "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
        "first_step_s": first,
        "steady_step_s": steady,
        "compile_s": first - steady,
    }


@dataclasses.dataclass(frozen=True)
class CompileRun:
    name: str
    recipe: str  # a key of VARIANTS
    folder: str  # "keyed": the recipe's own inductor_cache_dir; "shared": one folder for every recipe
    micro_pipeline_tp: bool


# The shared folder starts as a copy of the plain-TP recipe's folder after phase 1 (what one folder
# holds once plain TP has compiled into it). The runs of a phase use different folders and go two
# at a time; phase 2 runs the same compile against both layouts.
PHASES: list[list[CompileRun]] = [
    [CompileRun("keyed/plain_tp", "plain_tp", "keyed", False)],
    [CompileRun("shared/async_tp_pre28_key", "async_tp", "shared", False),
     CompileRun("keyed/async_tp_pre28_key", "async_tp", "keyed", False)],
    [CompileRun("shared/async_tp_2.13_key", "async_tp", "shared", True),
     CompileRun("keyed/plain_tp_again", "plain_tp", "keyed", False)],
]  # fmt: skip
# Caches on, whatever the caller's environment says: they are what is measured.
CACHES_ON = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def run_compiles(root: Path, *, kernels: bool = True) -> dict[str, dict[str, Any]]:
    """Every run of PHASES in a fresh `python -m benchmarks.compile_cache --worker DIR` process."""
    keyed = cache_dirs(root / "keyed")
    runs: dict[str, dict[str, Any]] = {}
    for i, phase in enumerate(PHASES):
        if i == 1:
            shutil.copytree(keyed["plain_tp"], root / "shared")
        procs = {}
        for run in phase:
            folder = root / "shared" if run.folder == "shared" else Path(keyed[run.recipe])
            flags = ["--micro-pipeline-tp"] if run.micro_pipeline_tp else []
            flags += [] if kernels else ["--no-kernels"]
            cmd = ("-m", "benchmarks.compile_cache", "--worker", str(folder), *flags)
            procs[run] = (time.perf_counter(), harness.start_python(*cmd, env=CACHES_ON))
        for run, (start, proc) in procs.items():
            out, err = proc.communicate(timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"compile run {run.name} exited {proc.returncode}:\n{err[-4000:]}")
            result = json.loads(out.strip().splitlines()[-1])
            process_s = time.perf_counter() - start
            runs[run.name] = {"recipe": run.recipe, "dir": run.folder, **result, "process_s": process_s}
    return runs


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    warm = [runs[n]["compile_s"] for n in ("shared/async_tp_pre28_key", "keyed/plain_tp_again")]
    return {
        # FX graphs the async-TP recipe was served from the plain-TP recipe's compile.
        "cross_recipe_hits": {
            "shared_dir_pre28_key": runs["shared/async_tp_pre28_key"]["fxgraph_cache_hit"],
            "shared_dir_2.13_key": runs["shared/async_tp_2.13_key"]["fxgraph_cache_hit"],
            "keyed_dirs": runs["keyed/async_tp_pre28_key"]["fxgraph_cache_hit"],
        },
        "same_recipe_hits_keyed": runs["keyed/plain_tp_again"]["fxgraph_cache_hit"],
        "graphs_per_compile": runs["keyed/plain_tp"]["fxgraph_cache_miss"],  # forward + backward
        "compile_s": {
            "cold": runs["keyed/plain_tp"]["compile_s"],  # alone on the machine (phase 1)
            "cold_beside_another_run": runs["keyed/async_tp_pre28_key"]["compile_s"],
            "warm": sum(warm) / len(warm),
            "new_key_same_kernels": runs["shared/async_tp_2.13_key"]["compile_s"],
        },
    }


# ------------------------------------------------------------- 3. refusal


TRAIN_WITH_ASYNC_TP = [
    "train.py", "--config", "configs/debug.toml", "--parallelism.enable_async_tensor_parallel", "--compile.enable",
]  # fmt: skip


def async_tp_refusals(train: subprocess.Popen[str]) -> dict[str, Any]:
    """apply_async_tp on a 1-rank gloo mesh, and the outcome of `train` (TRAIN_WITH_ASYNC_TP, started earlier)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        try:
            apply_async_tp(mesh, compile_enabled=True)
            message = "accepted"
        except ConfigError as e:
            message = str(e)
    finally:
        dist.destroy_process_group()
    _, err = train.communicate(timeout=120)
    return {
        "apply_async_tp_1rank_gloo": message,
        "train_py": {
            "command": " ".join(["python", *TRAIN_WITH_ASYNC_TP]), "exit_code": train.returncode, "stderr": err.strip(),
        },
    }  # fmt: skip


def measure(*, cache_root: Path | None = None, kernels: bool = True) -> dict[str, Any]:
    """The three parts of the module docstring; the cache folders go under `cache_root` (default: a temp dir)."""
    with tempfile.TemporaryDirectory(prefix="compile_cache_") as tmp:
        root = cache_root or Path(tmp)
        dirs = cache_dirs(root / "keyed")
        train = harness.start_python(*TRAIN_WITH_ASYNC_TP)  # refused before any allocation; runs beside phase 1
        runs = run_compiles(root, kernels=kernels)
        refusals = async_tp_refusals(train)
    return {
        "model_args": dataclasses.asdict(MODEL_ARGS),
        "batch": BATCH,
        "seq_len": SEQ,
        "recipes": VARIANTS,
        "cache_dirs": {name: Path(path).name for name, path in dirs.items()},
        "runs": runs,
        **summarize(runs),
        "async_tp_refusal": refusals,
        "reference_gpu": REFERENCE_GPU,
    }


# ------------------------------------------------------------------ report


def rows(results: dict[str, Any]) -> list[Row]:
    """Graphs the async-TP recipe is served from plain TP's compile: shared folder vs keyed folders."""
    hits, seconds = results["cross_recipe_hits"], results["compile_s"]
    graphs = functools.partial(
        Row,
        problem=PROBLEM,
        metric="graphs served from the other recipe's compile",
        unit="graphs",
        broken="shared dir, pre-2.8 key",
        broken_value=hits["shared_dir_pre28_key"],
    )
    return [
        graphs(fixed="dir keyed on recipe", fixed_value=hits["keyed_dirs"]),
        graphs(fixed="shared dir, 2.8+ key", fixed_value=hits["shared_dir_2.13_key"]),
        Row(problem=PROBLEM, metric="compile time of a block (cold vs warm cache)", unit="s", broken="cold",
            broken_value=seconds["cold"], fixed="warm, same recipe", fixed_value=seconds["warm"]),
    ]  # fmt: skip


def table(results: dict[str, Any]) -> str:
    dirs, runs = results["cache_dirs"], results["runs"]
    lines = ["1. inductor_cache_dir per recipe (DP2 x TP4, op SAC, except where named):"]
    lines += [f"   {name:<15} {folder}" for name, folder in dirs.items()]
    head = f"{'run (a fresh process each)':<27} {'cache folder':<24} {'fx hits':>7} {'misses':>6} {'aot hits':>8} {'compile s':>9}"
    lines += [
        "",
        f"2. compile of one block, forward + backward, CPU, torch {torch.__version__}; the shared folder",
        f"   starts as a copy of plain_tp's ({dirs['plain_tp']}) after its first run:",
        head,
        "-" * len(head),
    ]
    for name, r in runs.items():
        folder = "shared" if r["dir"] == "shared" else Path(r["cache_dir"]).name
        lines.append(
            f"{name:<27} {folder:<24} {r['fxgraph_cache_hit']:>7} {r['fxgraph_cache_miss']:>6} "
            f"{r['autograd_cache_hit']:>8} {r['compile_s']:>9.2f}"
        )
    hits, secs = results["cross_recipe_hits"], results["compile_s"]
    refusal = results["async_tp_refusal"]
    lines += [
        f"FX graphs the async-TP recipe got from plain TP's compile (of {results['graphs_per_compile']}): "
        f"shared folder + pre-2.8 key {hits['shared_dir_pre28_key']}, shared folder + 2.13 key "
        f"{hits['shared_dir_2.13_key']}, keyed folders {hits['keyed_dirs']}",
        f"compile s: cold {secs['cold']:.1f} (beside another run {secs['cold_beside_another_run']:.1f}), "
        f"warm {secs['warm']:.1f} ({secs['cold'] / secs['warm']:.1f}x faster), "
        f"new key with cached kernels {secs['new_key_same_kernels']:.1f}",
        f"3. async TP here: {refusal['apply_async_tp_1rank_gloo']}",
        f"   {refusal['train_py']['command']}: exit {refusal['train_py']['exit_code']}",
    ]
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-root", type=Path, default=None, help="where the cache folders go (default: a temp dir)")
    p.add_argument(
        "--no-kernels",
        action="store_true",
        help="compile without generating kernels: the same cache hits, not the times",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # internal, from run_compiles: `--worker DIR [--micro-pipeline-tp] [--no-kernels]`
        flags = argv[2:]
        result = compile_once(
            Path(argv[1]), micro_pipeline_tp="--micro-pipeline-tp" in flags, kernels="--no-kernels" not in flags
        )
        print(json.dumps(result), flush=True)
        return 0
    return harness.main(
        "compile_cache",
        argv,
        doc=__doc__,
        add_args=add_args,
        measure=lambda args: measure(cache_root=args.cache_root, kernels=not args.no_kernels),
        table=table,
    )


if __name__ == "__main__":
    raise SystemExit(main())
