"""Job configuration: TOML file -> nested dataclasses, overridable from the command line.

Each TOML section is a dataclass below and each key a field; the string under a field is
its documentation and becomes `--help`. Section and key names follow torchtitan's TOML
configs where one exists. Precedence: `--section.key=value` on the command line > the TOML
file > the defaults written here.

Every user mistake raises `ConfigError` with one line per problem, naming the key and the
fix; `train.py` prints it once and exits with status 2.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import json
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomllib

from models.llama3 import FLAVORS


class ConfigError(ValueError):
    """A problem with the user's input (config, data, tokenizer, checkpoint, launch).

    `problems` holds one line per mistake; all of them are reported together.
    """

    def __init__(self, *problems: str):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


# ------------------------------------------------------------------------ sections


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: checkpoints, metrics.jsonl, TensorBoard events."""
    description: str = ""
    """Free text describing the run, printed at start-up."""


@dataclass
class Model:
    name: Literal["llama3", "hf_llama"] = "llama3"
    """llama3: this repo's model; hf_llama: the same shapes as a transformers LlamaForCausalLM, trained through the same path."""
    flavor: str = "debugmodel"
    """Model size, a key of models/llama3/model.py FLAVORS: debugmodel, llama3_1b, llama3_3b, llama3_8b, llama3_70b, llama3_405b."""
    tokenizer_path: str = "assets/tokenizer"
    """A tokenizer.json file, a Hugging Face tokenizer folder, or "byte" for the built-in byte-level tokenizer."""
    hf_assets_path: str | None = None
    """A Hugging Face Llama folder whose config.json sets the model shape instead of flavor (fine-tuning HF weights; see scripts/convert_hf.py)."""
    hf_use_cache: bool = False
    """name = hf_llama only, a broken setting for reproducing PROBLEMS.md #2: keep transformers' KV cache on while training."""
    hf_gradient_checkpointing: bool = False
    """name = hf_llama only, a broken setting for reproducing PROBLEMS.md #1: also switch on transformers' own reentrant gradient checkpointing."""


@dataclass
class Training:
    steps: int = 200
    """Number of optimizer steps to train for."""
    local_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; -1 = local_batch_size x data-parallel degree. Larger values use gradient accumulation."""
    seq_len: int = 2048
    """Tokens per sequence."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 42
    """Seed of every random number generator, identical on all ranks."""
    deterministic: bool = False
    """Use deterministic algorithms only (slower), so that reruns give bit-identical losses."""
    mixed_precision_param: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype FSDP gathers parameters in for forward and backward; the sharded master copy stays float32."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype FSDP reduces gradients in."""
    enable_cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (FSDP CPUOffloadPolicy)."""


@dataclass
class Optimizer:
    name: Literal["AdamW"] = "AdamW"
    """Optimizer. AdamW only."""
    lr: float = 8e-4
    """Peak learning rate, reached at the end of warmup."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """AdamW kernel: fused (one kernel, CUDA and CPU), foreach (multi-tensor) or for-loop."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup from near zero to optimizer.lr."""
    decay_ratio: float | None = None
    """Fraction of the steps spent decaying at the end of training; None = decay over all steps after warmup."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay from optimizer.lr to lr x min_lr_factor."""
    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of optimizer.lr."""


@dataclass
class Data:
    path: str = "assets/corpus/stories.jsonl"
    """A local json/jsonl/parquet/txt file or folder, or a Hugging Face hub dataset name (format = "hub")."""
    format: Literal["auto", "json", "parquet", "text", "hub"] = "auto"
    """How to read data.path; auto picks it from the file extension."""
    text_column: str = "text"
    """Column that holds the documents."""
    split: str = "train"
    """Dataset split to train on."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas of the model (HSDP outer dimension, usually the number of nodes)."""
    data_parallel_shard_degree: int = -1
    """Ranks a replica is sharded over with FSDP; -1 = whatever the other degrees leave."""
    tensor_parallel_degree: int = 1
    """Ranks each layer's matrices are split over (tensor + sequence parallel)."""
    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with matmuls (inductor micro-pipeline TP); needs compile, CUDA and NCCL."""
    disable_loss_parallel: bool = False
    """Under TP, gather the full logits for the loss instead of computing cross-entropy on vocabulary shards."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: always (least memory), never (no re-gather in backward, ZeRO-2-like), default (always, except the last unit)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none, full (every block) or selective."""
    selective_ac_option: str = "op"
    """For mode = selective: "op" (save chosen ops' outputs) or an integer k (checkpoint every k-th block)."""
    use_reentrant: bool = False
    """Use the legacy reentrant checkpoint. It skips the recomputed-metadata checks (PROBLEMS.md #2); only for reproducing old setups."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save distributed checkpoints (torch.distributed.checkpoint) and resume from the latest one."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 0
    """Keep only the newest k checkpoints; 0 keeps all."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """async: write checkpoints in a background thread while training goes on."""
    initial_load_path: str | None = None
    """Checkpoint to initialize the model weights from when the run has no checkpoint of its own yet (e.g. a seed checkpoint)."""
    create_seed_checkpoint: bool = False
    """Initialize the model, save it as step 0 and exit. Run on one process; load it in parallel runs with initial_load_path so every layout starts from the same weights."""
    export_safetensors: bool = False
    """After the last step also write the model weights alone, unsharded, to <folder>/step-N/model.safetensors."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log loss, grad norm, lr, tokens/s, MFU and memory every this many steps."""
    enable_tensorboard: bool = False
    """Also write TensorBoard events to <dump_folder>/<save_tb_folder>."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Write a torch.profiler trace per rank of every profile_freq-th step to <dump_folder>/<save_traces_folder>/iteration_N/."""
    save_traces_folder: str = "profile_traces"
    """Profiler trace folder, relative to job.dump_folder (open the JSON files in Perfetto or chrome://tracing)."""
    profile_freq: int = 10
    """Profile (and snapshot memory) every this many steps."""
    enable_memory_snapshot: bool = False
    """CUDA only: record allocator history and dump a snapshot per rank every profile_freq steps and on OOM."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, relative to job.dump_folder (open the pickles at pytorch.org/memory_viz)."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    data: Data = field(default_factory=Data)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(JobConfig)}
# `from __future__ import annotations` leaves field types as strings; resolve them once.
SECTIONS = {name: globals()[cls] if isinstance(cls, str) else cls for name, cls in SECTIONS.items()}


def field_docs(section: type) -> dict[str, str]:
    """The docstring under each field of a section dataclass, read from the source."""
    class_def = ast.parse(textwrap.dedent(inspect.getsource(section))).body[0]
    assert isinstance(class_def, ast.ClassDef)
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(class_def.body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


# ----------------------------------------------------------------- type coercion


def _field_types(section: type) -> dict[str, Any]:
    return typing.get_type_hints(section)


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(c) for c in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join("none" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, *, from_cli: bool) -> Any:
    """Check (TOML) or convert (CLI string) `value` to `tp`; raise ValueError if impossible."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (from_cli and value.lower() in ("none", ""))):
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, from_cli=from_cli)
            except ValueError:
                pass
        raise ValueError
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ValueError
        return value
    if tp is bool:
        if from_cli:
            if value.lower() in ("true", "1", "yes"):
                return True
            if value.lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if not isinstance(value, bool):
            raise ValueError
        return value
    if tp is int:
        if from_cli:
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError
        return value
    if tp is float:
        if from_cli:
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError
        return value
    raise AssertionError(f"unsupported config field type {tp}")


def _did_you_mean(name: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _set(cfg: JobConfig, dotted: str, value: Any, *, source: str, from_cli: bool) -> str | None:
    """Set section.key = value on cfg; return a problem line instead of raising."""
    section_name, _, key = dotted.partition(".")
    if section_name not in SECTIONS or not key:
        hint = _did_you_mean(section_name, SECTIONS)
        return f"{dotted}: unknown section '{section_name}' in {source}{hint}"
    section = getattr(cfg, section_name)
    types_ = _field_types(type(section))
    if key not in types_:
        hint = _did_you_mean(key, types_)
        return f"{dotted}: unknown key in {source}{hint}"
    try:
        setattr(section, key, _coerce(value, types_[key], from_cli=from_cli))
    except ValueError:
        return f"{dotted}: expected {_describe(types_[key])}, got {value!r} in {source}"
    return None


# --------------------------------------------------------------------- loading


def load_toml(cfg: JobConfig, path: Path) -> list[str]:
    """Apply a TOML file to cfg; return the problems found."""
    if not path.is_file():
        return [f"--config: file {path} not found; pass an existing file such as configs/debug.toml"]
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        return [f"--config: {path} is not valid TOML ({e})"]
    problems = []
    for section_name, table in data.items():
        if not isinstance(table, dict):
            hint = _did_you_mean(section_name, SECTIONS)
            problems.append(f"{section_name}: expected a [section] in {path}, got a value{hint}")
            continue
        for key, value in table.items():
            if problem := _set(cfg, f"{section_name}.{key}", value, source=str(path), from_cli=False):
                problems.append(problem)
    return problems


def parse_overrides(args: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """`--a.b=v` and `--a.b v` -> [(a.b, v)]; a bare boolean flag means true."""
    overrides, problems = [], []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            problems.append(f"{arg}: unexpected argument; use --section.key=value (see --help)")
            i += 1
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else None
            if nxt is None or nxt.startswith("--"):
                value = "true"  # `--compile.enable` alone switches a boolean on
            else:
                value, i = nxt, i + 1
        overrides.append((name.replace("-", "_"), value))
        i += 1
    return overrides, problems


def load_config(argv: list[str]) -> JobConfig:
    """defaults < `--config FILE` < `--section.key value` overrides; raises ConfigError."""
    cfg = JobConfig()
    problems: list[str] = []
    rest: list[str] = []
    config_path: Path | None = None
    i = 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            config_path, i = Path(argv[i + 1]), i + 2
        elif argv[i].startswith("--config="):
            config_path, i = Path(argv[i].split("=", 1)[1]), i + 1
        else:
            rest.append(argv[i])
            i += 1
    if config_path is not None:
        problems += load_toml(cfg, config_path)
    overrides, bad = parse_overrides(rest)
    problems += bad
    for dotted, value in overrides:
        if problem := _set(cfg, dotted, value, source="the command line", from_cli=True):
            problems.append(problem)
    if not problems:
        problems = validate(cfg)
    if problems:
        raise ConfigError(*problems)
    return cfg


def validate(cfg: JobConfig) -> list[str]:
    """Cross-field checks that need no process group; every problem, not just the first."""
    p: list[str] = []
    t, m, o, s = cfg.training, cfg.model, cfg.optimizer, cfg.lr_scheduler
    if m.hf_assets_path is not None:
        p += _check_hf_assets(m.hf_assets_path, seq_len=t.seq_len)
    elif m.flavor not in FLAVORS:
        p.append(
            f"model.flavor: unknown flavor '{m.flavor}'{_did_you_mean(m.flavor, FLAVORS)} (choose from {', '.join(FLAVORS)})"
        )
    elif t.seq_len > FLAVORS[m.flavor].max_seq_len:
        p.append(
            f"training.seq_len: {t.seq_len} exceeds the {FLAVORS[m.flavor].max_seq_len} tokens {m.flavor} supports; lower it"
        )
    for key in ("steps", "local_batch_size"):
        if getattr(t, key) < 1:
            p.append(f"training.{key}: must be >= 1, got {getattr(t, key)}")
    if t.seq_len < 2:
        p.append(f"training.seq_len: must be >= 2, got {t.seq_len}")
    if t.global_batch_size != -1 and t.global_batch_size < t.local_batch_size:
        p.append(
            f"training.global_batch_size: {t.global_batch_size} is below local_batch_size {t.local_batch_size}; use -1 or a multiple of local_batch_size x data-parallel degree"
        )
    if t.max_norm < 0:
        p.append(f"training.max_norm: must be >= 0 (0 disables clipping), got {t.max_norm}")
    if o.lr <= 0:
        p.append(f"optimizer.lr: must be > 0, got {o.lr}")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        p.append(f"optimizer.beta1/beta2: must lie in [0, 1), got {o.beta1}, {o.beta2}")
    if s.warmup_steps < 0:
        p.append(f"lr_scheduler.warmup_steps: must be >= 0, got {s.warmup_steps}")
    if s.decay_ratio is not None and not 0 < s.decay_ratio <= 1:
        p.append(f"lr_scheduler.decay_ratio: must lie in (0, 1] or be unset, got {s.decay_ratio}")
    if not 0 <= s.min_lr_factor <= 1:
        p.append(f"lr_scheduler.min_lr_factor: must lie in [0, 1], got {s.min_lr_factor}")
    par = cfg.parallelism
    if par.data_parallel_replicate_degree < 1:
        p.append(f"parallelism.data_parallel_replicate_degree: must be >= 1, got {par.data_parallel_replicate_degree}")
    if par.data_parallel_shard_degree == 0 or par.data_parallel_shard_degree < -1:
        p.append(f"parallelism.data_parallel_shard_degree: must be -1 or >= 1, got {par.data_parallel_shard_degree}")
    if par.tensor_parallel_degree < 1:
        p.append(f"parallelism.tensor_parallel_degree: must be >= 1, got {par.tensor_parallel_degree}")
    if par.enable_async_tensor_parallel and not (cfg.compile.enable and par.tensor_parallel_degree > 1):
        p.append(
            "parallelism.enable_async_tensor_parallel: async TP needs compile.enable = true and "
            f"tensor_parallel_degree > 1 (got compile.enable = {str(cfg.compile.enable).lower()}, "
            f"tensor_parallel_degree = {par.tensor_parallel_degree}); set it to false or enable both"
        )
    ac = cfg.activation_checkpoint
    if (
        ac.mode == "selective"
        and ac.selective_ac_option != "op"
        and not (ac.selective_ac_option.isdigit() and int(ac.selective_ac_option) >= 1)
    ):
        p.append(
            f"activation_checkpoint.selective_ac_option: expected 'op' or a positive integer k, got {ac.selective_ac_option!r}"
        )
    ck = cfg.checkpoint
    if ck.interval < 1:
        p.append(f"checkpoint.interval: must be >= 1, got {ck.interval}")
    if ck.keep_latest_k < 0:
        p.append(f"checkpoint.keep_latest_k: must be >= 0 (0 keeps all), got {ck.keep_latest_k}")
    if cfg.metrics.log_freq < 1:
        p.append(f"metrics.log_freq: must be >= 1, got {cfg.metrics.log_freq}")
    if cfg.profiling.profile_freq < 1:
        p.append(f"profiling.profile_freq: must be >= 1, got {cfg.profiling.profile_freq}")
    if cfg.data.format != "hub" and not Path(cfg.data.path).exists():
        p.append(
            f'data.path: {cfg.data.path} not found; point it at a local json/jsonl/parquet/txt file, or set data.format = "hub" for a hub dataset'
        )
    if m.tokenizer_path != "byte" and not Path(m.tokenizer_path).exists():
        p.append(
            f'model.tokenizer_path: {m.tokenizer_path} not found; point it at a tokenizer.json or tokenizer folder, or use "byte"'
        )
    if ck.initial_load_path is not None and not Path(ck.initial_load_path).is_dir():
        p.append(
            f"checkpoint.initial_load_path: {ck.initial_load_path} is not a folder; point it at a checkpoint step folder (contains .metadata)"
        )
    return p  # fmt: skip


def _check_hf_assets(path: str, *, seq_len: int) -> list[str]:
    if not (Path(path) / "config.json").is_file():
        return [f"model.hf_assets_path: {path} has no config.json; point it at a downloaded Hugging Face Llama folder"]
    # Imported here: models.llama3.hf raises this module's ConfigError, so a top-level import would be circular.
    from models.llama3.hf import model_args_from_hf_config

    try:
        args = model_args_from_hf_config(path)
    except ConfigError as e:
        return [f"model.hf_assets_path: {problem}" for problem in e.problems]
    if seq_len > args.max_seq_len:
        return [
            f"training.seq_len: {seq_len} exceeds the {args.max_seq_len} tokens (max_position_embeddings) of {path}; lower it"
        ]
    return []


# ------------------------------------------------------------------ presentation


def help_text() -> str:
    lines = [
        "usage: train.py [--config FILE.toml] [--section.key=value ...] [--print-config] [--check] [--help]",
        "",
        "--print-config: print the resolved config and derived numbers, then exit.",
        "--check: run the recipe doctor (doctor.py): report known pitfalls, exit 1 if one is an error.",
        "",
        "Precedence: command line > TOML file > defaults. Options:",
    ]
    defaults = JobConfig()
    for name, section in SECTIONS.items():
        lines.append(f"\n[{name}]")
        docs = field_docs(section)
        for f in dataclasses.fields(section):
            default = getattr(getattr(defaults, name), f.name)
            lines.append(f"  --{name}.{f.name} ({_describe(_field_types(section)[f.name])}, default {default!r})")
            lines.append(f"      {docs.get(f.name, '')}")
    return "\n".join(lines)


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML (unset optional values are left out, as TOML has no null)."""
    out = []
    for name, values in cfg.to_dict().items():
        out.append(f"[{name}]")
        for key, value in values.items():
            if value is None:
                out.append(f"# {key} = (unset)")
            elif isinstance(value, bool):
                out.append(f"{key} = {str(value).lower()}")
            elif isinstance(value, str):
                out.append(f"{key} = {json.dumps(value)}")
            else:
                out.append(f"{key} = {value}")
        out.append("")
    return "\n".join(out)
