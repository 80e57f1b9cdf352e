"""The recipe doctor: every known pitfall of a recipe, found before it runs, one line each with the fix.

    python doctor.py --config configs/llama3_70b.toml --world-size 64 --gpus-per-node 8 --cuda
    python doctor.py --config configs/debug.toml --world-size 2 --training.mixed_precision_param=float16

`check_recipe` looks at a resolved `JobConfig`, optionally at the model about to be trained (this
repo's `Transformer` or a transformers `LlamaForCausalLM`, before `parallelize_llama`), and at the
machine: CUDA, NCCL, GPUs per node, environment variables. Severity:

    error    the run would fail, or train silently wrong
    warning  it would run, but slower or with more memory than it needs

What is checked, and which PROBLEMS.md entry each check comes from:

    activation checkpointing  a second checkpointing mechanism (HF gradient checkpointing, blocks
                              already wrapped) (#1); an HF KV cache left on while training (#2);
                              reentrant checkpointing (#2)
    async TP                  needs compile, CUDA + NCCL and a TP group of at least 2 (#4)
    layout                    degrees that do not fill the world; shapes TP cannot split; tied
                              embeddings under TP; a global batch the data-parallel ranks cannot split
    nodes (CUDA only)         TP groups that cross nodes; HSDP inside one node; HSDP shard groups
                              that are not one node; FSDP across nodes where HSDP would keep the
                              all-gathers inside a node (#3)
    precision and memory      float16 without loss scaling; bf16 on a CPU without bf16 instructions;
                              bf16 gradient reduction; master weights below float32; CPU offload
                              without CUDA; pinned offload without CUDA on a sharded model (#5)
    compile                   no C++ compiler for inductor's CPU backend; determinism under compile

Not checked, because the recipe already prevents it: a stale inductor cache serving an async-TP
graph to a plain-TP run on PyTorch < 2.8 (#4). `parallelize_llama` keys the cache directory on every
setting that changes the generated code, below whatever TORCHINDUCTOR_CACHE_DIR the user set
(`parallelisms.compile.inductor_cache_dir`), so a user-set cache folder is safe on any version.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from config import ConfigError, JobConfig, load_config
from models.llama3 import FLAVORS, ModelArgs, Transformer
from models.llama3.hf import model_args_from_hf_config

# CheckpointWrapper (FSDP1-era `checkpoint_wrapper`) lives in a private torch module; parallelisms.ac
# is the one place that imports it, so take it from there.
from parallelisms.ac import CheckpointedModule, CheckpointWrapper
from parallelisms.parallel_dims import ParallelDims

Severity = Literal["error", "warning"]

USAGE = """\
usage: python doctor.py [--config FILE.toml] [--world-size N] [--gpus-per-node N] [--cuda] [--section.key=value ...]

Checks a recipe for known pitfalls; prints one line per finding; exit status 1 if any is an
error, 2 if the config itself does not load, 0 otherwise.

  --world-size N     ranks of the job (default: $WORLD_SIZE, else 1)
  --gpus-per-node N  ranks per node (default: $LOCAL_WORLD_SIZE, else the visible CUDA devices)
  --cuda             check for a CUDA + NCCL machine even if this one has none (planning a GPU job)"""


@dataclass(frozen=True)
class Finding:
    severity: Severity
    key: str
    """The config key (section.key) or object (model.<name>) the finding concerns."""
    message: str
    """One line: what is wrong, why, and the fix."""

    def __str__(self) -> str:
        return f"{self.severity}: {self.key}: {self.message}"


@dataclass(frozen=True)
class _Machine:
    cuda: bool
    nccl: bool
    gpus_per_node: int | None
    cpu_has_bf16: bool | None
    environ: Mapping[str, str]


def check_recipe(
    cfg: JobConfig,
    *,
    world_size: int,
    model: nn.Module | None = None,
    cuda_available: bool | None = None,
    nccl_available: bool | None = None,
    gpus_per_node: int | None = None,
    cpu_has_bf16: bool | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[Finding]:
    """Every known pitfall of running `cfg` on `world_size` ranks; errors first, then warnings.

    model: the model about to be trained, before parallelization (our `Transformer`, meta device
        included, or a transformers `LlamaForCausalLM`); None checks the config alone.
    cuda_available, nccl_available: the machine the job runs on; None = this machine.
    gpus_per_node: ranks per node; None = $LOCAL_WORLD_SIZE, else the visible CUDA devices, else
        unknown (node checks skipped).
    cpu_has_bf16: whether the CPU has native bf16 matmul instructions (AVX512-BF16 or AMX); None = probe
        this CPU (unknown off x86: no warning).
    environ: environment variables to read (LOCAL_WORLD_SIZE, CXX, TORCHINDUCTOR_DETERMINISTIC);
        None = os.environ.
    """
    environ = os.environ if environ is None else environ
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if nccl_available is None:
        nccl_available = cuda and dist.is_available() and dist.is_nccl_available()
    if gpus_per_node is None and environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        gpus_per_node = int(environ["LOCAL_WORLD_SIZE"])
    if gpus_per_node is None and cuda_available is None and cuda:  # only when this machine is the target
        gpus_per_node = torch.cuda.device_count() or None
    if cpu_has_bf16 is None and not cuda:
        cpu_has_bf16 = _probe_cpu_bf16()
    machine = _Machine(
        cuda=cuda, nccl=nccl_available, gpus_per_node=gpus_per_node, cpu_has_bf16=cpu_has_bf16, environ=environ
    )

    dims, findings = _layout(cfg, world_size=world_size)
    args, problems = _model_shape(cfg, model)
    findings += problems
    if args is not None:
        findings += _shapes(cfg, args, dims)
    findings += _async_tp(cfg, machine)
    findings += _activation_checkpointing(cfg, model)
    findings += _precision(cfg, model, machine)
    findings += _offload(cfg, model, machine)
    if dims is not None:
        findings += _nodes(dims, machine)
    findings += _compile(cfg, machine)
    return sorted(findings, key=lambda f: f.severity != "error")  # stable: errors first, in check order


def format_findings(findings: list[Finding]) -> str:
    """One line per finding: `error: key: message` / `warning: key: message`."""
    return "\n".join(str(f) for f in findings)


def _error(key: str, message: str) -> Finding:
    return Finding("error", key, message)


def _warning(key: str, message: str) -> Finding:
    return Finding("warning", key, message)


def _from_config_error(e: ConfigError) -> list[Finding]:
    """A ConfigError's `key: message` lines as error findings."""
    return [_error(*problem.split(": ", 1)) if ": " in problem else _error("config", problem) for problem in e.problems]


# ------------------------------------------------------------------------- layout


def _layout(cfg: JobConfig, *, world_size: int) -> tuple[ParallelDims | None, list[Finding]]:
    try:
        return ParallelDims.from_config(cfg.parallelism, world_size=world_size), []
    except ConfigError as e:
        return None, _from_config_error(e)


def _model_shape(cfg: JobConfig, model: nn.Module | None) -> tuple[ModelArgs | None, list[Finding]]:
    """The shape TP must split: from the model when given, else from model.hf_assets_path or model.flavor."""
    if isinstance(model, Transformer):
        return model.args, []
    hf = getattr(model, "config", None)
    if model is not None and hasattr(hf, "num_attention_heads"):
        return ModelArgs(
            dim=hf.hidden_size, n_layers=hf.num_hidden_layers, n_heads=hf.num_attention_heads,
            n_kv_heads=getattr(hf, "num_key_value_heads", None), vocab_size=hf.vocab_size,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        ), []  # fmt: skip
    if cfg.model.hf_assets_path is not None:
        try:
            return model_args_from_hf_config(cfg.model.hf_assets_path), []
        except ConfigError as e:
            return None, [_error("model.hf_assets_path", problem) for problem in e.problems]
    if cfg.model.flavor not in FLAVORS:
        return None, [_error("model.flavor", f"unknown flavor {cfg.model.flavor!r}; choose from {', '.join(FLAVORS)}")]
    return FLAVORS[cfg.model.flavor], []


def _shapes(cfg: JobConfig, args: ModelArgs, dims: ParallelDims | None) -> list[Finding]:
    t, tp = cfg.training, cfg.parallelism.tensor_parallel_degree
    findings = []
    # The TP checks need only the TP degree: report them even when the degrees do not fill the world.
    try:
        ParallelDims(dp_replicate=1, dp_shard=1, tp=tp, world_size=tp).check_model(args, seq_len=t.seq_len)
    except ConfigError as e:
        findings += _from_config_error(e)
    if tp > 1 and args.tie_word_embeddings:
        findings.append(
            _error(
                "parallelism.tensor_parallel_degree",
                f"{tp} with a model that ties its output projection to the embedding, which the TP plan does not "
                "shard (apply_tp refuses it); use tensor_parallel_degree = 1 or an untied flavor (e.g. llama3_8b)",
            )
        )
    if dims is not None and t.global_batch_size != -1 and t.global_batch_size % (t.local_batch_size * dims.dp):
        per_micro = t.local_batch_size * dims.dp
        findings.append(
            _error(
                "training.global_batch_size",
                f"{t.global_batch_size} is not a multiple of local_batch_size {t.local_batch_size} x data-parallel "
                f"degree {dims.dp}; use a multiple of {per_micro} or -1",
            )
        )
    return findings


# ---------------------------------------------------------------------- async TP


def _async_tp(cfg: JobConfig, machine: _Machine) -> list[Finding]:
    """PROBLEMS.md #4. Worded like parallelisms.tp.maybe_enable_async_tp, which refuses the same at start-up."""
    if not cfg.parallelism.enable_async_tensor_parallel:
        return []
    missing = []
    if not cfg.compile.enable:
        missing.append("compile.enable is false")
    if not (machine.cuda and machine.nccl):
        device, backend = ("cuda" if machine.cuda else "cpu"), ("nccl" if machine.nccl else "gloo")
        missing.append(f"the TP group runs on {device} with {backend}")
    if cfg.parallelism.tensor_parallel_degree < 2:
        missing.append(f"tensor_parallel_degree is {cfg.parallelism.tensor_parallel_degree}")
    if not missing:
        return []
    return [
        _error(
            "parallelism.enable_async_tensor_parallel",
            "async TP needs compile.enable = true, CUDA with NCCL and tensor_parallel_degree > 1, "
            f"but {', '.join(missing)}; set it to false",
        )
    ]


# ----------------------------------------------------- activation checkpointing


def _activation_checkpointing(cfg: JobConfig, model: nn.Module | None) -> list[Finding]:
    ac = cfg.activation_checkpoint
    findings = []
    if ac.mode != "none" and ac.use_reentrant:
        if ac.mode == "selective" and ac.selective_ac_option == "op":
            findings.append(
                _error(
                    "activation_checkpoint.use_reentrant",
                    "selective op AC works with non-reentrant checkpointing only (apply_ac refuses it); "
                    "set use_reentrant = false",
                )
            )
        else:
            findings.append(
                _warning(
                    "activation_checkpoint.use_reentrant",
                    "reentrant checkpointing skips the check that recomputed tensors match the forward ones, so a "
                    "stateful forward gives silently wrong gradients instead of a CheckpointError (PROBLEMS.md #2); "
                    "set use_reentrant = false",
                )
            )
    if model is None:
        return findings

    hf_checkpointed = [
        (name, module)
        for name, module in model.named_modules()
        if getattr(module, "gradient_checkpointing", False) is True  # gradient_checkpointing_enable() sets it
    ]
    wrapped = [
        name for name, module in model.named_modules() if isinstance(module, (CheckpointedModule, CheckpointWrapper))
    ]
    if hf_checkpointed and ac.mode != "none":
        findings.append(
            _error(
                "model.gradient_checkpointing",
                f"Hugging Face gradient checkpointing is on ({_names([n for n, _ in hf_checkpointed])}) and "
                f"activation_checkpoint.mode = {ac.mode!r} checkpoints the blocks again, so every layer is recomputed "
                "once more per backward (PROBLEMS.md #1); call model.gradient_checkpointing_disable() "
                "(activation_checkpointing_disable() in transformers 5) and keep activation_checkpoint.mode as the "
                "only checkpointing",
            )
        )
    elif hf_checkpointed and any(_hf_reentrant(module) for _, module in hf_checkpointed):
        findings.append(
            _warning(
                "model.gradient_checkpointing",
                "Hugging Face gradient checkpointing is on with use_reentrant=True, which skips the recomputed-"
                "metadata checks (PROBLEMS.md #2); call model.gradient_checkpointing_disable() and set "
                "activation_checkpoint.mode = 'full' instead (non-reentrant, applied once by parallelize_llama)",
            )
        )
    if wrapped and ac.mode != "none":
        findings.append(
            _error(
                f"model.{wrapped[0]}" if wrapped[0] else "model",
                f"blocks already activation-checkpointed ({_names(wrapped)}), and activation_checkpoint.mode = "
                f"{ac.mode!r} would checkpoint them again, recomputing every block twice per backward (PROBLEMS.md "
                "#1); pass an unwrapped model and let parallelize_llama apply activation checkpointing once",
            )
        )

    # A Hugging Face model switches its KV cache off only under its own gradient checkpointing.
    if getattr(getattr(model, "config", None), "use_cache", False) is True:
        if ac.mode != "none":
            findings.append(
                _error(
                    "model.config.use_cache",
                    "True while activation checkpointing is on: the recompute appends to the KV cache a second time, "
                    "so keys and values double in length (CheckpointError: recomputed values have different "
                    "metadata, PROBLEMS.md #2); set model.config.use_cache = False for training",
                )
            )
        elif not hf_checkpointed:
            findings.append(
                _warning(
                    "model.config.use_cache",
                    "True in a training forward: every step builds a KV cache nothing reads (memory, state in the "
                    "forward, and a CheckpointError as soon as checkpointing is on, PROBLEMS.md #2); set "
                    "model.config.use_cache = False for training",
                )
            )
    return findings


def _names(names: list[str]) -> str:
    """`model.a, model.b and 3 more`: module names as the user's code spells them."""
    shown = ", ".join(f"model.{name}" if name else "model" for name in names[:2])
    return f"{shown} and {len(names) - 2} more" if len(names) > 2 else shown


def _hf_reentrant(module: nn.Module) -> bool:
    """Whether transformers' checkpoint function of `module` is reentrant (transformers 4.x's default)."""
    func = getattr(module, "_gradient_checkpointing_func", None)
    return isinstance(func, functools.partial) and func.keywords.get("use_reentrant") is True


# ------------------------------------------------------------ precision, memory


def _precision(cfg: JobConfig, model: nn.Module | None, machine: _Machine) -> list[Finding]:
    t = cfg.training
    findings = []
    if t.mixed_precision_param == "float16":
        findings.append(
            _error(
                "training.mixed_precision_param",
                "float16 needs loss scaling (a gradient scaler) to keep small gradients from underflowing to zero, "
                "which this recipe does not implement; use bfloat16 (the same memory, float32's exponent range)",
            )
        )
    elif t.mixed_precision_param == "bfloat16" and not machine.cuda and machine.cpu_has_bf16 is False:
        findings.append(
            _warning(
                "training.mixed_precision_param",
                "bfloat16 on a CPU without native bf16 instructions (AVX512-BF16 or AMX): its matmuls are emulated "
                "(the debug model: ~40x slower per step than float32 with AVX2 kernels); use float32 on this CPU",
            )
        )
    if t.mixed_precision_reduce == "bfloat16":
        findings.append(
            _warning(
                "training.mixed_precision_reduce",
                "bfloat16 gradient reduction sums the data-parallel gradients with 8 mantissa bits, losing the small "
                "contributions that float32 keeps, to halve the reduce-scatter volume (PROBLEMS.md #5); use "
                "float32 unless the step is bound by that communication",
            )
        )
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} if model is not None else set()
    if torch.float16 in dtypes or torch.bfloat16 in dtypes:
        low = "float16" if torch.float16 in dtypes else "bfloat16"
        make = _error if low == "float16" else _warning
        findings.append(
            make(
                "model.parameters",
                f"the model holds {low} parameters, which become FSDP's sharded master copy: AdamW's small updates "
                "round away in them (and float16 gradients underflow without loss scaling); load the model in "
                "float32, training.mixed_precision_param sets the compute dtype (PROBLEMS.md #5)",
            )
        )
    return findings


def _probe_cpu_bf16() -> bool | None:
    """Whether this x86 CPU has native bf16 matmul instructions; None off x86 or without the probes."""
    # torch.cpu's ISA probes are private (no public API as of PyTorch 2.13); this is their one use here.
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if platform.machine().lower() not in ("x86_64", "amd64") or not all(probes):
        return None
    return any(probe() for probe in probes)


def _offload(cfg: JobConfig, model: nn.Module | None, machine: _Machine) -> list[Finding]:
    if machine.cuda:
        return []
    findings = []
    if cfg.training.enable_cpu_offload:
        findings.append(
            _warning(
                "training.enable_cpu_offload",
                "on a CPU-only machine parameters, gradients and optimizer state already live in host memory: "
                "offloading saves nothing and adds copies (PROBLEMS.md #5); set it to false",
            )
        )
    pinned = [name for name, pin in _fsdp_offload_pin_memory(model) if pin]
    if pinned:
        findings.append(
            _error(
                f"model.{pinned[0]}" if pinned[0] else "model",
                f"FSDP units sharded with CPUOffloadPolicy(pin_memory=True) ({_names(pinned)}), but pinned memory "
                "needs CUDA: "
                "allocating the parameters fails ('Cannot access accelerator device when none is available', "
                "PROBLEMS.md #5); use CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) as apply_fsdp does",
            )
        )
    return findings


def _fsdp_offload_pin_memory(model: nn.Module | None) -> list[tuple[str, bool]]:
    """(name, pin_memory) of each FSDP2 unit of `model` that offloads to the CPU.

    FSDP2 keeps a unit's offload policy in private state (`_get_fsdp_state()._fsdp_param_group`, PyTorch
    2.6-2.13); this is the one place that reads it. A unit sharded on the meta device only fails when its
    parameters are allocated (`to_empty`), so a pinned policy on a CPU-only machine is still visible here.
    """
    if model is None:
        return []
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        get_state = getattr(module, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if get_state is not None else None
        policy = getattr(group, "offload_policy", None)
        if policy is not None and hasattr(policy, "pin_memory"):  # CPUOffloadPolicy; the base OffloadPolicy has none
            found.append((name, bool(policy.pin_memory)))
    return found


# ------------------------------------------------------------------------- nodes


def _nodes(dims: ParallelDims, machine: _Machine) -> list[Finding]:
    """PROBLEMS.md #3: keep TP and FSDP's all-gathers/reduce-scatters inside a node.

    Checked on CUDA only: CPU ranks of the debug recipes pretend to be nodes on one host. torchrun
    numbers the ranks of a node consecutively and the mesh is (dp_replicate, dp_shard, tp) with tp
    innermost, so a TP group is `tp` consecutive ranks and a shard group `dp_shard x tp` of them.
    """
    n, world = machine.gpus_per_node, dims.world_size
    if not machine.cuda or n is None or n < 1:
        return []
    findings = []
    if dims.tp > n or n % dims.tp:
        findings.append(
            _warning(
                "parallelism.tensor_parallel_degree",
                f"TP groups of {dims.tp} ranks cross the nodes of {n} GPUs, so every layer's all-gathers and "
                f"reduce-scatters go over the inter-node link; use a divisor of {n} and FSDP/HSDP across nodes",
            )
        )
        return findings  # the data-parallel advice below assumes TP groups inside a node
    nodes, per_node_shard = world // n, n // dims.tp
    if dims.hsdp_enabled and world <= n:
        findings.append(
            _warning(
                "parallelism.data_parallel_replicate_degree",
                f"{dims.dp_replicate} > 1, but the whole job ({world} ranks) fits on one node of {n} GPUs: HSDP "
                f"only pays off across nodes (PROBLEMS.md #3); inside one it keeps {dims.dp_replicate} copies of "
                "every shard and adds a gradient all-reduce; set it to 1 (FSDP over all data-parallel ranks)",
            )
        )
    elif dims.hsdp_enabled and world % n == 0 and dims.dp_shard * dims.tp != n:
        where = (
            "span nodes, so all-gathers and reduce-scatters cross the inter-node link"
            if dims.dp_shard * dims.tp > n
            else "are smaller than a node, so the replicas inside a node hold duplicate shards"
        )
        findings.append(
            _warning(
                "parallelism.data_parallel_shard_degree",
                f"HSDP shard groups of data_parallel_shard_degree {dims.dp_shard} x tensor_parallel_degree "
                f"{dims.tp} = {dims.dp_shard * dims.tp} ranks {where}; make a shard group one node of {n} GPUs: "
                f"data_parallel_replicate_degree = {nodes}, data_parallel_shard_degree = {per_node_shard} "
                "(PROBLEMS.md #3)",
            )
        )
    elif not dims.hsdp_enabled and world > n and world % n == 0 and dims.dp_shard > per_node_shard > 1:
        findings.append(
            _warning(
                "parallelism.data_parallel_replicate_degree",
                f"FSDP shards over {dims.dp_shard} ranks on {nodes} nodes, so every all-gather and reduce-scatter "
                f"crosses the inter-node link; if the model fits sharded over one node, use HSDP: "
                f"data_parallel_replicate_degree = {nodes}, data_parallel_shard_degree = {per_node_shard} (only "
                "the gradient all-reduce then crosses nodes, PROBLEMS.md #3)",
            )
        )
    return findings


# ----------------------------------------------------------------------- compile


def _compile(cfg: JobConfig, machine: _Machine) -> list[Finding]:
    if not cfg.compile.enable:
        return []
    findings = []
    # Inductor's CPU backend builds C++ (torch._inductor.config.cpp.cxx: $CXX, else g++); without a
    # compiler the first step fails after tokenization and model set-up.
    cxx = machine.environ.get("CXX", "g++")
    if not machine.cuda and shutil.which(cxx) is None:
        findings.append(
            _error(
                "compile.enable",
                f"inductor's CPU backend needs a C++ compiler and {cxx!r} is not on PATH; install g++ (or point "
                "$CXX at one) or set compile.enable = false",
            )
        )
    # use_deterministic_algorithms steers inductor's lowerings, but not which Triton configuration on-device
    # benchmarking picks for a kernel (a different reduction order between runs); inductor's own
    # deterministic mode (torch._inductor.config.deterministic) skips that benchmarking.
    if cfg.training.deterministic and machine.cuda and machine.environ.get("TORCHINDUCTOR_DETERMINISTIC") != "1":
        findings.append(
            _warning(
                "training.deterministic",
                "compiled kernels are autotuned by benchmarking on the device, which can pick a different "
                "reduction order in another run, so losses are not bit-identical; also set "
                "TORCHINDUCTOR_DETERMINISTIC=1 (slower) or compile.enable = false",
            )
        )
    return findings


# -------------------------------------------------------------------- entry points


def run_startup_checks(
    cfg: JobConfig, *, world_size: int, rank: int, device: torch.device, model: nn.Module | None = None
) -> None:
    """train.py's start-up check: rank 0 prints the warnings; errors stop every rank as one ConfigError."""
    findings = check_recipe(
        cfg, world_size=world_size, model=model, cuda_available=device.type == "cuda",
        nccl_available=dist.is_initialized() and dist.get_backend() == "nccl",
    )  # fmt: skip
    if rank == 0:
        for finding in findings:
            if finding.severity == "warning":
                print(finding, file=sys.stderr, flush=True)
    errors = [f"{f.key}: {f.message}" for f in findings if f.severity == "error"]
    if errors:
        raise ConfigError(*errors)


def main(argv: list[str]) -> int:
    """`python doctor.py --config X [--world-size N] [--gpus-per-node N] [--cuda] [overrides]`; see USAGE."""
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    rank0 = int(os.environ.get("RANK", "0")) == 0
    options: dict[str, str] = {}
    rest: list[str] = []
    problems: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name == "--cuda":
            options["cuda"] = "true"
        elif name in ("--world-size", "--gpus-per-node"):
            if not eq:
                value, i = (argv[i + 1] if i + 1 < len(argv) else ""), i + 1
            if not value.isdigit() or int(value) < 1:
                problems.append(f"{name}: expected a positive integer, got {value!r}")
            options[name] = value
        else:
            rest.append(argv[i])
        i += 1
    try:
        if problems:
            raise ConfigError(*problems)
        cfg = load_config(rest)
    except ConfigError as e:
        if rank0:
            for problem in e.problems:
                print(f"error: {problem}", file=sys.stderr)
        return 2
    findings = check_recipe(
        cfg,
        world_size=int(options.get("--world-size") or os.environ.get("WORLD_SIZE", "1")),
        cuda_available=True if "cuda" in options else None,
        nccl_available=True if "cuda" in options else None,
        gpus_per_node=int(options["--gpus-per-node"]) if "--gpus-per-node" in options else None,
    )
    if rank0:
        print(format_findings(findings) or "no known pitfalls found")
    return 1 if any(f.severity == "error" for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
