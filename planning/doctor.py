"""The recipe doctor: pitfalls of a job on its machine that no other part of the recipe checks.

    python -m planning.doctor --config configs/llama3_70b.toml --world-size 64 --gpus-per-node 8 --cuda
    python -m planning.doctor --config configs/debug.toml --world-size 2

The config's own rules run when it loads (config/sections.py), the layout's when the job starts
(ParallelDims, apply_tp, apply_async_tp, the data loader). What is left depends on the machine
and on what would merely run badly, and lives here:

    nodes (CUDA)   TP groups that cross nodes; HSDP inside one node; HSDP shard groups that are not
                   one node; FSDP across nodes where HSDP would keep the all-gathers inside a node
                   (docs/failures.md #3); expert-parallel groups whose all-to-alls cross nodes
    precision      bf16 on a CPU without bf16 instructions; bf16 gradient reduction
    toolchain      no C++ compiler for inductor's CPU backend; autotuned kernels under determinism
    async TP       rowwise float8 under async TP, whose all-gathers the fusion pass cannot match
                   (docs/failures.md #4)
    offload        CPU offload on a machine without CUDA (docs/failures.md #5)
    memory         parameters, gradients, optimizer state and activations per rank (planning/estimate_memory.py)
                   against the device memory of a rank; mode "auto"'s choice of activation checkpointing; under
                   expert parallel, how unbalanced a routing the rank has room for (no token is dropped)
    data           a run that would read its corpus many times over; a tokenizer whose vocabulary
                   is far smaller than the model's embedding (most of it never trained)
    evals          in-loop lm-eval tasks (evaluation/downstream.py) whose forwards would take more than a tenth of
                   the run's FLOPs

Severity: an error means the run would fail (stopping it before any allocation), a warning that
it would run slower or with more memory than it needs. train.py calls `check_startup` once; a
fork that deletes this file deletes that call with it.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.device_mesh import DeviceMesh

from config import JobConfig, env_world_size, float8_settings, global_batch_size, load_config, model_args
from data.corpus import corpus_size
from data.inputs import input_problems
from data.tokenizers import build_tokenizer
from errors import ConfigError, is_rank0, warn
from parallelisms.parallel_dims import ParallelDims, layout_checks
from planning.job import Job, Machine

Severity = Literal["error", "warning", "note"]
GiB = 2**30

USAGE = """\
usage: python -m planning.doctor [--config FILE.toml] [--world-size N] [--gpus-per-node N] [--cuda]
                        [--device-memory-gib G] [--section.key=value ...]

Checks a job for known pitfalls on its machine; prints one line per finding on stdout (notes name
input files this machine lacks, which the job's machines need); exit status 1 if any finding is
an error, 2 if the config itself does not load (one line per problem on stderr), 0 otherwise.

  --world-size N         ranks of the job (default: $WORLD_SIZE, else 1)
  --gpus-per-node N      ranks per node (default: $LOCAL_WORLD_SIZE, else the visible CUDA devices)
  --cuda                 plan for a CUDA + NCCL machine even if this one has none
  --device-memory-gib G  memory of one GPU (default: this GPU's; with --cuda and none here, 80)"""


@dataclass(frozen=True)
class Finding:
    severity: Severity
    key: str
    """The config key (section.key) the finding concerns."""
    message: str
    """One line: what is wrong, why, and the fix."""

    def __str__(self) -> str:
        return f"{self.severity}: {self.key}: {self.message}"


def check_recipe(
    cfg: JobConfig, *, world_size: int, machine: Machine, tp_mesh: DeviceMesh | None = None
) -> list[Finding]:
    """Every finding for `cfg` on `world_size` ranks of `machine`; errors first, then warnings.

    tp_mesh: the run's mesh["tp"] when a process group runs and TP is on (the memory estimate traces a
    TP-split block over it); without a process group the estimate starts a fake one."""
    try:
        dims = ParallelDims.from_config(cfg.parallelism, world_size=world_size)
    except ConfigError as e:  # the run's own rule, reported by the pre-flight
        return [Finding("error", *problem.split(": ", 1)) for problem in e.problems]
    findings = _nodes(dims, machine) + _expert_parallel_nodes(dims, machine)
    findings += _precision(cfg, machine) + _toolchain(cfg, machine) + _async_tp(cfg)
    findings += _offload(cfg, machine)
    findings += _memory(cfg, dims, machine, tp_mesh=tp_mesh) + _data(cfg, dims) + _evals(cfg, dims)
    return sorted(findings, key=lambda f: f.severity != "error")  # stable: errors first, in check order


def check_startup(cfg: JobConfig, *, world_size: int, device: torch.device, mesh: DeviceMesh | None = None) -> None:
    """train.py's call: rank 0 prints the warnings; errors stop every rank as one ConfigError. mesh: the run's,
    when a process group runs (see check_recipe's tp_mesh)."""
    machine = Machine.this(cuda=device.type == "cuda")
    tp_mesh = mesh["tp"] if mesh is not None else None
    findings = check_recipe(cfg, world_size=world_size, machine=machine, tp_mesh=tp_mesh)
    for f in findings:
        if f.severity == "warning":
            warn(f"{f.key}: {f.message}")
    errors = [f"{f.key}: {f.message}" for f in findings if f.severity == "error"]
    if errors:
        raise ConfigError(*errors)


def add_plan_report(
    lines: list[str], cfg: JobConfig, *, world_size: int, gpus_per_node: int, device_memory_gib: float
) -> bool:
    """The dry run's section (planning/dry_run.py): the findings for CUDA nodes of `gpus_per_node` GPUs of
    `device_memory_gib` each, appended to `lines`; whether any is an error."""
    machine = Machine(cuda=True, gpus_per_node=gpus_per_node, device_memory_gib=device_memory_gib)
    findings = check_recipe(cfg, world_size=world_size, machine=machine)
    lines += ["", f"doctor (CUDA, {gpus_per_node} GPUs per node, {device_memory_gib:.0f} GiB each):"]
    lines += [f"  {line}" for line in report(findings)]
    return any(f.severity == "error" for f in findings)


def report(findings: list[Finding]) -> list[str]:
    """The findings, one line each, and then, when none is a warning or an error, that there is no pitfall: notes
    (what the job will choose, an input this machine lacks) are none."""
    lines = [str(f) for f in findings]
    return lines if any(f.severity != "note" for f in findings) else [*lines, "no known pitfalls found"]


# ------------------------------------------------------------------------- nodes


def _nodes(dims: ParallelDims, machine: Machine) -> list[Finding]:
    """docs/failures.md #3: keep TP and FSDP's all-gathers/reduce-scatters inside a node.

    Checked on CUDA only: CPU ranks of the debug recipes pretend to be nodes on one host. torchrun
    numbers the ranks of a node consecutively and the mesh is (dp_replicate, dp_shard, cp, tp) with tp
    innermost, so a TP group is `tp` consecutive ranks, a CP group's ranks lie within `cp x tp` of them, and
    a shard group is `dp_shard x cp x tp` of them.
    """
    n, world = machine.gpus_per_node, dims.world_size
    if not machine.cuda or n is None or n < 1:
        return []
    if dims.tp > n or n % dims.tp:
        return [
            Finding(
                "warning",
                "parallelism.tensor_parallel_degree",
                f"TP groups of {dims.tp} ranks cross the nodes of {n} GPUs, so every layer's all-gathers and "
                f"reduce-scatters go over the inter-node link; use a divisor of {n} and FSDP/HSDP across nodes",
            )
        ]
    inner = dims.cp * dims.tp
    if dims.cp_enabled and (inner > n or n % inner):
        return [
            Finding(
                "warning",
                "parallelism.context_parallel_degree",
                f"CP groups of context_parallel_degree {dims.cp} x tensor_parallel_degree {dims.tp} = {inner} ranks "
                f"do not fit the nodes of {n} GPUs, so every layer's all-gather of keys and values crosses the "
                f"inter-node link; make cp x tp a divisor of {n}",
            )
        ]
    nodes, per_node_shard = world // n, n // inner
    if dims.hsdp_enabled and world <= n:
        message = (
            f"{dims.dp_replicate} > 1, but the whole job ({world} ranks) fits on one node of {n} GPUs: HSDP only "
            f"pays off across nodes; inside one it keeps {dims.dp_replicate} copies of every shard and adds a "
            "gradient all-reduce; set it to 1 (FSDP over all data-parallel ranks)"
        )
        return [Finding("warning", "parallelism.data_parallel_replicate_degree", message)]
    if dims.hsdp_enabled and world % n == 0 and dims.dp_shard * inner != n:
        where = (
            "span nodes, so all-gathers and reduce-scatters cross the inter-node link"
            if dims.dp_shard * inner > n
            else "are smaller than a node, so the replicas inside a node hold duplicate shards"
        )
        cp = f" x context_parallel_degree {dims.cp}" if dims.cp_enabled else ""
        message = (
            f"HSDP shard groups of data_parallel_shard_degree {dims.dp_shard}{cp} x tensor_parallel_degree {dims.tp} "
            f"= {dims.dp_shard * inner} ranks {where}; make a shard group one node of {n} GPUs: "
            f"data_parallel_replicate_degree = {nodes}, data_parallel_shard_degree = {per_node_shard}"
        )
        return [Finding("warning", "parallelism.data_parallel_shard_degree", message)]
    if not dims.hsdp_enabled and world > n and world % n == 0 and dims.dp_shard > per_node_shard > 1:
        message = (
            f"FSDP shards over {dims.dp_shard} ranks on {nodes} nodes, so every all-gather and reduce-scatter "
            "crosses the inter-node link; if the model fits sharded over one node, use HSDP: "
            f"data_parallel_replicate_degree = {nodes}, data_parallel_shard_degree = {per_node_shard} (only the "
            "gradient all-reduce then crosses nodes)"
        )
        return [Finding("warning", "parallelism.data_parallel_replicate_degree", message)]
    return []


def _expert_parallel_nodes(dims: ParallelDims, machine: Machine) -> list[Finding]:
    """Expert parallel's all-to-alls inside a node. Its groups are `ep` consecutive ranks (ParallelDims.expert_meshes:
    ep innermost of a replica's dp_shard x cp x tp ranks, which are consecutive), so one crosses nodes where ep does
    not divide the node. Checked on CUDA only, as `_nodes`."""
    n, ep = machine.gpus_per_node, dims.ep
    if not machine.cuda or n is None or n < 1 or ep == 1 or (ep <= n and n % ep == 0):
        return []
    message = (
        f"expert-parallel groups of {ep} ranks cross the nodes of {n} GPUs, so every MoE block's all-to-alls (its "
        f"tokens to their experts and back, forward and backward) go over the inter-node link; use a divisor of {n} "
        "(FSDP shards each rank's experts over the ranks left)"
    )
    return [Finding("warning", "parallelism.expert_parallel_degree", message)]


# --------------------------------------------------------------------- precision


def _precision(cfg: JobConfig, machine: Machine) -> list[Finding]:
    t = cfg.training
    findings = []
    if t.mixed_precision_param == "bfloat16" and not machine.cuda and machine.cpu_has_bf16 is False:
        findings.append(
            Finding(
                "warning",
                "training.mixed_precision_param",
                "bfloat16 on a CPU without native bf16 instructions (AVX512-BF16 or AMX): its matmuls are emulated "
                "(the debug model: ~40x slower per step than float32 with AVX2 kernels); use float32 on this CPU",
            )
        )
    if t.mixed_precision_reduce == "bfloat16":
        findings.append(
            Finding(
                "warning",
                "training.mixed_precision_reduce",
                "bfloat16 gradient reduction sums the data-parallel gradients with 8 mantissa bits, losing the small "
                "contributions that float32 keeps, to halve the reduce-scatter volume; use float32 unless the step "
                "is bound by that communication",
            )
        )
    return findings


# --------------------------------------------------------------------- toolchain


def _toolchain(cfg: JobConfig, machine: Machine) -> list[Finding]:
    if not cfg.compile.enable or cfg.compile.backend != "inductor":
        return []
    environ = machine.environ or {}
    findings = []
    # Inductor's CPU backend builds C++ (torch._inductor.config.cpp.cxx: $CXX, else g++); without a
    # compiler the first step fails after tokenization and model set-up.
    cxx = environ.get("CXX", "g++")
    if not machine.cuda and shutil.which(cxx) is None:
        findings.append(
            Finding(
                "error",
                "compile.enable",
                f"inductor's CPU backend needs a C++ compiler and {cxx!r} is not on PATH; install g++ (or point "
                "$CXX at one) or set compile.enable = false",
            )
        )
    # use_deterministic_algorithms steers inductor's lowerings, but not which Triton configuration on-device
    # benchmarking picks for a kernel (a different reduction order between runs); inductor's own
    # deterministic mode (torch._inductor.config.deterministic) skips that benchmarking.
    if cfg.debug.deterministic and machine.cuda and environ.get("TORCHINDUCTOR_DETERMINISTIC") != "1":
        findings.append(
            Finding(
                "warning",
                "debug.deterministic",
                "compiled kernels are autotuned by benchmarking on the device, which can pick a different "
                "reduction order in another run, so losses are not bit-identical; also set "
                "TORCHINDUCTOR_DETERMINISTIC=1 (slower) or compile.enable = false",
            )
        )
    return findings


# ---------------------------------------------------------------------- async TP


def _async_tp(cfg: JobConfig) -> list[Finding]:
    """docs/failures.md #4: the TP collectives async TP runs but cannot fuse. What it needs to run at all (compile,
    CUDA with NCCL, a TP group) is parallelisms/async_tp.py's rule, checked when the job starts and by the dry run;
    which collectives PyTorch's pass fuses on this recipe's blocks is counted by benchmarks/async_tp_fusion.py."""
    float8 = float8_settings(cfg)
    rowwise = float8 is not None and float8.recipe_name not in (None, "tensorwise")
    if cfg.parallelism.enable_async_tensor_parallel and rowwise:
        message = (
            "under async TP the all-gathers before rowwise float8 matmuls are not fused with them (rowwise TP "
            "gathers high-precision activations and casts them after; pytorch/pytorch#149990, open for PyTorch "
            "2.13), so only the matmul + reduce-scatters overlap; use recipe_name = 'tensorwise', whose gathers fuse"
        )
        return [Finding("warning", "quantize.linear.float8.recipe_name", message)]
    return []


# ------------------------------------------------------------------ offload, memory


def _offload(cfg: JobConfig, machine: Machine) -> list[Finding]:
    if machine.cuda or not cfg.training.enable_cpu_offload:
        return []
    message = (
        "on a CPU-only machine parameters, gradients and optimizer state already live in host memory: "
        "offloading saves nothing and adds copies (docs/failures.md #5); set it to false"
    )
    return [Finding("warning", "training.enable_cpu_offload", message)]


def _memory(cfg: JobConfig, dims: ParallelDims, machine: Machine, *, tp_mesh: DeviceMesh | None) -> list[Finding]:
    """The estimate of planning/estimate_memory.py for this job against the memory one rank can use."""
    # Imported here: the estimator (its fake-tensor trace of a block) loads only when this check runs.
    from planning.memory import estimate, resolve_auto_ac

    findings = []
    if cfg.activation_checkpoint.mode == "auto":  # what train.py will choose on this machine, said
        try:
            cfg, choice = resolve_auto_ac(cfg, world_size=dims.world_size, machine=machine, tp_mesh=tp_mesh)
        except ConfigError as e:  # no budget without CUDA, or a job that fits with no choice: both numbers said
            return [Finding("error", *problem.split(": ", 1)) for problem in e.problems]
        assert choice is not None
        findings.append(Finding("note", "activation_checkpoint.mode", f"auto: {choice.describe()}"))
    if machine.device_memory_gib is None:
        return findings
    try:
        job = Job.of(cfg, machine, world_size=dims.world_size)
    except ConfigError:  # a shape TP or PP cannot split: the run refuses it at start-up, with its own message
        return findings
    e = estimate(job, tp_mesh=tp_mesh)
    need = e["total"] / GiB
    if job.defers_reduce_scatter:  # what the setting costs, said whether or not it fits
        findings.append(
            Finding(
                "note",
                "parallelism.fsdp_defer_reduce_scatter",
                f"{job.grad_accum} micro-batches reduce-scatter once per step, for {e['accumulators'] / GiB:.1f} GiB "
                f"per rank of unsharded {cfg.training.mixed_precision_reduce} gradients held through the step (about {need:.1f} GiB in "
                "all); set it to false to reduce-scatter per micro-batch in the memory of the shards",
            )
        )
    if machine.cuda:
        have, what = machine.device_memory_gib, f"one GPU's {machine.device_memory_gib:.0f} GiB"
    else:  # the ranks of this host share its memory
        ranks = min(dims.world_size, machine.gpus_per_node or dims.world_size)
        have = machine.device_memory_gib / ranks
        what = f"{have:.1f} GiB ({machine.device_memory_gib:.1f} GiB of host memory shared by {ranks} rank(s))"
    if need <= have:
        return findings + _routing_skew(job, need=need, have=have, what=what, tp_mesh=tp_mesh)
    return findings + [
        Finding(
            "error",
            "memory",
            f"the job needs about {need:.1f} GiB per rank (parameters, gradients, optimizer state, activations; "
            f"python -m planning.estimate_memory breaks it down) but a rank has {what}; use more ranks, activation "
            "checkpointing, a smaller local_batch_size or seq_len, or a smaller flavor",
        )
    ]


def _routing_skew(job: Job, *, need: float, have: float, what: str, tp_mesh: DeviceMesh | None) -> list[Finding]:
    """Under expert parallel no token is dropped (no capacity factor, parallelisms/ep.py): the rows a rank's experts
    receive, and the buffers that hold them, follow the routing. Balanced routing fits (`need` GiB of `have`); the
    worst routing sends all of the ep group's tokens x top_k to one rank's experts in every block. Where that does not
    fit: how many times the balanced rows the rank has room for, found on the estimate (Job.ep_load)."""
    from planning.memory import estimate  # (as _memory: the estimator loads only when this check runs)

    ep = job.dims.ep
    if ep == 1:
        return []
    total = lambda load: estimate(dataclasses.replace(job, ep_load=load), tp_mesh=tp_mesh)["total"] / GiB  # noqa: E731
    worst = total(float(ep))
    if worst <= have:
        return []
    fits, over = 1.0, float(ep)  # the estimate grows with the load: bisect to a tenth of the balanced rows
    while over - fits > 0.1:
        mid = (fits + over) / 2
        fits, over = (mid, over) if total(mid) <= have else (fits, mid)
    message = (
        f"no token is dropped (no capacity factor), so a rank holds what routing sends its experts: about {need:.1f} "
        f"GiB balanced, {worst:.1f} GiB with all {ep} ranks' tokens x top_k on its experts, and a rank has "
        f"{what}: room for {fits:.1f}x the balanced rows (the log's moe load, max/mean tokens per expert, must stay "
        "below it); keep model.moe.router_aux_loss_coef or load_balance_coeff on, or use full AC or a smaller "
        "local_batch_size"
    )
    return [Finding("warning", "parallelism.expert_parallel_degree", message)]


# ------------------------------------------------------------------------- data

# A run that reads its corpus more often than this is memorizing it rather than learning from it.
MAX_EPOCHS = 4


def _data(cfg: JobConfig, dims: ParallelDims) -> list[Finding]:
    d = cfg.data
    weights = d.mixture_weights or [1.0] * len(d.mixture)
    # (key, data, share of the samples): data.path, or each folder of a mixture.
    sources = [
        ("data.mixture", dataclasses.replace(d, path=path), w / sum(weights))
        for path, w in zip(d.mixture, weights, strict=True)
    ] or [("data.path", d, 1.0)]
    try:
        tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        sizes = [corpus_size(data, tokenizer) for _, data, _ in sources]
    except ConfigError:  # the run names these problems itself when it opens the files
        return []
    findings = []
    model_vocab = model_args(cfg.model).vocab_size
    if tokenizer.vocab_size < model_vocab // 2:
        findings.append(
            Finding(
                "warning",
                "model.tokenizer_path",
                f"the tokenizer has {tokenizer.vocab_size:,} tokens and the model embeds {model_vocab:,}: "
                f"{1 - tokenizer.vocab_size / model_vocab:.0%} of the embedding and output rows are never trained; use "
                "the model's own tokenizer (its Hugging Face folder's)",
            )
        )
    t = cfg.training
    global_batch = global_batch_size(t, dp=dims.dp)
    for (key, data, share), (corpus_tokens, exact) in zip(sources, sizes, strict=True):
        needed = int(share * t.steps * global_batch) * (t.seq_len + 1)
        if corpus_tokens and needed > MAX_EPOCHS * corpus_tokens:
            size = f"{corpus_tokens:,}" if exact else f"about {corpus_tokens:,} (estimated from its size)"
            what = f"{share:.0%} of {t.steps:,} steps" if d.mixture else f"{t.steps:,} steps"
            findings.append(
                Finding(
                    "warning",
                    key,
                    f"the run reads {needed:,} tokens ({what} x {global_batch} x {t.seq_len + 1}) from {data.path}, "
                    f"a corpus of {size}: {needed / corpus_tokens:,.0f} epochs; point {key} at more data or train "
                    "fewer steps",
                )
            )
    return findings


# -------------------------------------------------------------------- entry point


def _evals(cfg: JobConfig, dims: ParallelDims) -> list[Finding]:
    """In-loop lm-eval tasks (downstream.py) that would take more than MAX_SHARE of the run's compute."""
    if not cfg.eval.enable:
        return []
    from evaluation.downstream import MAX_SHARE, compute_share

    try:
        share, evals, requests = compute_share(cfg, dp=dims.dp)
    except ConfigError:  # a task that cannot run: refused at start-up in its own words
        return []
    if share <= MAX_SHARE:
        return []
    return [Finding("warning", "eval.interval", (
        f"{evals} evals of {requests:,} requests each would take {share:.0%} of the run's FLOPs (more of its time: "
        f"an eval's forwards are short and its batches small); raise eval.interval (now {cfg.eval.interval}) or "
        "set eval.limit"))]  # fmt: skip


def main(argv: list[str]) -> int:
    """`python -m planning.doctor --config X [--world-size N] [--gpus-per-node N] [--cuda] [overrides]`; see USAGE."""
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    options: dict[str, str] = {}
    rest: list[str] = []
    problems: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name == "--cuda":
            options["cuda"] = "true"
        elif name in ("--world-size", "--gpus-per-node", "--device-memory-gib"):
            if not eq:
                value, i = (argv[i + 1] if i + 1 < len(argv) else ""), i + 1
            number = value.replace(".", "", 1) if name == "--device-memory-gib" else value
            if not number.isdigit() or float(value) <= 0:
                kind = "number" if name == "--device-memory-gib" else "integer"
                problems.append(f"{name}: expected a positive {kind}, got {value!r}")
            options[name] = value
        else:
            rest.append(argv[i])
        i += 1
    world = options.get("--world-size", "")
    if not world:
        try:
            world = str(env_world_size() or 1)
        except ConfigError as e:
            problems.append(f"{e.problems[0]}, or pass --world-size N")
    try:
        cfg = load_config(rest, extra_checks=layout_checks(int(world)) if world.isdigit() else None)
    except ConfigError as e:
        problems += e.problems
    if problems:
        if is_rank0():
            for problem in problems:
                print(f"error: {problem}", file=sys.stderr)
        return 2
    memory = float(options["--device-memory-gib"]) if "--device-memory-gib" in options else None
    machine = Machine.this(cuda=True if "cuda" in options else None, device_memory_gib=memory)
    if "--gpus-per-node" in options:
        machine = dataclasses.replace(machine, gpus_per_node=int(options["--gpus-per-node"]))
    findings = check_recipe(cfg, world_size=int(world), machine=machine)
    findings += [Finding("note", *problem.split(": ", 1)) for problem in input_problems(cfg)]
    if is_rank0():
        print("\n".join(report(findings)))
    return 1 if any(f.severity == "error" for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
