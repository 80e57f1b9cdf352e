"""Job configuration: TOML file -> nested dataclasses, overridable from the command line.

Each TOML section is a dataclass below and each key a field; the string under a field is
its documentation and becomes `--help`. Section and key names follow torchtitan's TOML
configs where one exists. Precedence: `--section.key=value` on the command line > the TOML
file > the defaults written here.

Every user mistake raises `ConfigError` (errors.py) with one line per problem, naming the key
and the fix; `train.py` prints it once and exits with status 2. Each rule about the values of
one config lives in `validate` below; rules that need the process group or the model live
next to the fact they check (ParallelDims, apply_tp, the data loader) and run at start-up.

Relative input paths (fields marked `input_path`) are read from the current directory, else
from the repo: a shipped config works from any working directory.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import json
import math
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from errors import ConfigError, warn
from models.llama3 import FLAVORS, ModelArgs

REPO = Path(__file__).resolve().parent
# A field that names a file or folder to read; see resolve_input_paths.
INPUT_PATH = {"input_path": True}


# ------------------------------------------------------------------------ sections


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: checkpoints, metrics.jsonl, TensorBoard events."""
    description: str = ""
    """Free text describing the run, printed by rank 0 at start-up."""


@dataclass
class Model:
    name: Literal["llama3"] = "llama3"
    """Model family (torchtitan's key); this recipe implements llama3."""
    flavor: str = "debugmodel"
    """Model size, a key of models/llama3/model.py FLAVORS: debugmodel, llama3_1b, llama3_3b, llama3_8b, llama3_70b, llama3_405b."""
    tokenizer_path: str = field(default="assets/tokenizer", metadata=INPUT_PATH)
    """A tokenizer.json file, a Hugging Face tokenizer folder, or "byte" for the built-in byte-level tokenizer."""
    hf_assets_path: str | None = field(default=None, metadata=INPUT_PATH)
    """A Hugging Face Llama folder whose config.json sets the model shape instead of flavor (fine-tuning HF weights; see scripts/convert_hf.py)."""
    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """causal: every token sees all earlier tokens of its window; block_causal: only those of its own document (FlexAttention on CUDA)."""


@dataclass
class Training:
    steps: int = 10000
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
    """Dtype FSDP gathers parameters in for forward and backward; the sharded master copy stays float32. float16 is refused: it needs loss scaling."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype FSDP reduces gradients in."""
    enable_cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (FSDP CPUOffloadPolicy)."""
    skip_nonfinite_steps: int = 0
    """Steps with a non-finite loss or gradient norm to tolerate: their update is skipped (weights and optimizer state unchanged). One more stops the run, naming the step and the last checkpoint; 0 stops at the first."""


@dataclass
class Optimizer:
    name: Literal["AdamW"] = "AdamW"
    """Optimizer (torchtitan's key); AdamW is the one implemented."""
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
    path: str = field(default="assets/corpus/stories.jsonl", metadata=INPUT_PATH)
    """A folder prepared by scripts/prepare_data.py, or raw json/jsonl(.gz)/parquet/txt files (a file or folder, up to 256 MiB: prepared into cache_folder at start-up)."""
    format: Literal["auto", "json", "parquet", "text", "hub"] = "auto"
    """How to read raw data.path; auto picks it from the file extensions. hub: a Hugging Face dataset name, prepared with scripts/prepare_data.py."""
    text_column: str = "text"
    """Column that holds the documents."""
    split: str = "train"
    """Dataset split (hub datasets)."""
    name: str | None = None
    """Dataset configuration of a hub dataset (e.g. sample-10BT of HuggingFaceFW/fineweb-edu)."""
    shuffle: bool = False
    """Read the windows of seq_len + 1 tokens in a pseudo-random order (training.seed, new each epoch) instead of corpus order."""
    cache_folder: str = "~/.cache/llama3-recipe/tokens"
    """Where raw data.path is prepared at start-up, one folder per (files, tokenizer)."""
    ignore_resume_mismatch: bool = False
    """Resume a checkpoint trained on other data, tokenizer, seq_len, global batch or shuffle order anyway (from its sample count)."""


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
    """Use the legacy reentrant checkpoint. It skips the recomputed-metadata checks (docs/failures.md #2); only for reproducing old setups."""


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
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """async: write checkpoints in a background thread while training goes on; async_with_pinned_mem (CUDA): also stage them through pinned host memory in a background process."""
    initial_load_path: str | None = field(default=None, metadata=INPUT_PATH)
    """Checkpoint to initialize the model weights from when the run has no checkpoint of its own yet (e.g. a seed checkpoint)."""
    create_seed_checkpoint: bool = False
    """Initialize the model, save it as step 0 and exit. Run on one process; load it in parallel runs with initial_load_path so every layout starts from the same weights."""
    export_safetensors: bool = False
    """After the last step also write the model weights alone, unsharded, to <folder>/step-N/model.safetensors."""


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Timeout of collectives until the first step is done (process-group set-up, tokenization, loading a checkpoint)."""
    train_timeout_seconds: int = 100
    """Timeout of collectives from the second step on: a rank that stops answering fails the job after this long instead of hanging it."""


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
    comm: Comm = field(default_factory=Comm)
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
    return "finite float" if tp is float else getattr(tp, "__name__", str(tp))


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
        if not from_cli and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError
        if not math.isfinite(number := float(value)):  # nan/inf: no setting of this recipe means them
            raise ValueError
        return number
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


def find_config(name: str) -> Path | None:
    """`--config` as given, else under the repo, else `configs/<name>`: what users type works from anywhere."""
    path = Path(name)
    candidates = [path] if path.is_absolute() else [path, REPO / path, REPO / "configs" / path]
    return next((c for c in candidates if c.is_file()), None)


def load_toml(cfg: JobConfig, name: str) -> list[str]:
    """Apply a TOML file to cfg; return the problems found."""
    path = find_config(name)
    if path is None:
        shipped = [str(p.relative_to(REPO)) for p in sorted((REPO / "configs").rglob("*.toml"))]
        hint = _did_you_mean(name, shipped) or _did_you_mean(f"configs/{Path(name).name}", shipped)
        return [f"--config: file {name} not found (also looked in {REPO / 'configs'}){hint or '; see configs/'}"]
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        return [
            f"--config: {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); save it as UTF-8"
        ]
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
    config_name: str | None = None
    i = 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            config_name, i = argv[i + 1], i + 2
        elif argv[i].startswith("--config="):
            config_name, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    if config_name is not None:
        problems += load_toml(cfg, config_name)
    overrides, bad = parse_overrides(rest)
    problems += bad
    for dotted, value in overrides:
        if problem := _set(cfg, dotted, value, source="the command line", from_cli=True):
            problems.append(problem)
    if not problems:
        resolve_input_paths(cfg)
        problems = validate(cfg)
    if problems:
        raise ConfigError(*problems)
    return cfg


def resolve_input_paths(cfg: JobConfig) -> None:
    """A relative input path missing from the current directory but present in the repo means the repo's."""
    for section_name in SECTIONS:
        section = getattr(cfg, section_name)
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if not (f.metadata.get("input_path") and isinstance(value, str)) or Path(value).exists():
                continue
            if not Path(value).is_absolute() and (REPO / value).exists():
                setattr(section, f.name, str(REPO / value))


def model_args(cfg: Model) -> ModelArgs:
    """The model shape this config names: hf_assets_path's config.json when set, else the flavor."""
    if cfg.hf_assets_path is None:
        return FLAVORS[cfg.flavor]
    # Imported here: reading HF configs is interop, which a flavor-only run never needs.
    from models.llama3.hf import model_args_from_hf_config

    return model_args_from_hf_config(cfg.hf_assets_path)


def validate(cfg: JobConfig) -> list[str]:
    """Cross-field checks that need no process group; every problem, not just the first."""
    p: list[str] = []
    t, m, o, s = cfg.training, cfg.model, cfg.optimizer, cfg.lr_scheduler
    p += _check_model(m, seq_len=t.seq_len)
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
    if t.mixed_precision_param == "float16":
        p.append(
            "training.mixed_precision_param: float16 needs loss scaling to keep small gradients from underflowing "
            "to zero, which this recipe does not implement; use bfloat16 (same memory, float32's exponent range)"
        )
    if t.skip_nonfinite_steps < 0:
        p.append(f"training.skip_nonfinite_steps: must be >= 0, got {t.skip_nonfinite_steps}")
    if o.lr <= 0:
        p.append(f"optimizer.lr: must be > 0, got {o.lr}")
    if o.eps <= 0:
        p.append(f"optimizer.eps: must be > 0 (it keeps AdamW's division away from zero), got {o.eps}")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        p.append(f"optimizer.beta1/beta2: must lie in [0, 1), got {o.beta1}, {o.beta2}")
    if s.warmup_steps < 0:
        p.append(f"lr_scheduler.warmup_steps: must be >= 0, got {s.warmup_steps}")
    elif s.warmup_steps >= t.steps > 1:
        warn(
            f"lr_scheduler.warmup_steps = {s.warmup_steps} is not below training.steps = {t.steps}: the run ends "
            f"before the learning rate reaches optimizer.lr = {o.lr:g}"
        )
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
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option != "op" and selective_ac_every(ac.selective_ac_option) is None:
        p.append(
            f"activation_checkpoint.selective_ac_option: expected 'op' or a positive integer k, got {ac.selective_ac_option!r}"
        )
    ck = cfg.checkpoint
    if ck.interval < 1:
        p.append(f"checkpoint.interval: must be >= 1, got {ck.interval}")
    if ck.keep_latest_k < 0:
        p.append(f"checkpoint.keep_latest_k: must be >= 0 (0 keeps all), got {ck.keep_latest_k}")
    for key in ("init_timeout_seconds", "train_timeout_seconds"):
        if getattr(cfg.comm, key) < 1:
            p.append(f"comm.{key}: must be >= 1, got {getattr(cfg.comm, key)}")
    if cfg.metrics.log_freq < 1:
        p.append(f"metrics.log_freq: must be >= 1, got {cfg.metrics.log_freq}")
    if cfg.profiling.profile_freq < 1:
        p.append(f"profiling.profile_freq: must be >= 1, got {cfg.profiling.profile_freq}")
    if cfg.data.format != "hub" and not Path(cfg.data.path).exists():
        p.append(_missing_data(cfg.data.path, tokenizer=m.tokenizer_path))
    if m.tokenizer_path != "byte" and not Path(m.tokenizer_path).exists():
        p.append(_missing_tokenizer(m))
    if ck.initial_load_path is not None and not Path(ck.initial_load_path).is_dir():
        p.append(
            f"checkpoint.initial_load_path: {ck.initial_load_path} is not a folder; point it at a checkpoint step folder (contains .metadata)"
        )
    return p  # fmt: skip


def _missing_data(path: str, *, tokenizer: str) -> str:
    if Path(path).suffix:
        return f"data.path: {path} not found; point it at a json/jsonl/parquet/txt file or folder, or a prepared folder"
    return (
        f"data.path: {path} not found; prepare a corpus into it with `python scripts/prepare_data.py --source SOURCE "
        f"--tokenizer {tokenizer} --output {path} --workers N` (a recipe's header names its SOURCE)"
    )


def _missing_tokenizer(m: Model) -> str:
    from models.llama3.hf import PUBLISHED  # interop: only for this message

    # A folder named after a published repo (assets/hf/Llama-3.1-8B) comes from it; else the flavor's repo.
    by_name = [repo for repo in PUBLISHED.values() if repo.split("/")[1] == Path(m.tokenizer_path).name]
    repo = by_name[0] if by_name else PUBLISHED.get(m.flavor) if m.hf_assets_path is None else None
    fetch = (
        f"; download it with `hf download {repo} --include 'tokenizer*' --local-dir {m.tokenizer_path}`" if repo else ""
    )
    return f"model.tokenizer_path: {m.tokenizer_path} not found{fetch or ''}" + (
        "" if fetch else '; point it at a tokenizer.json or tokenizer folder, or use "byte"'
    )


def selective_ac_every(option: str) -> int | None:
    """k of `selective_ac_option = "k"` (checkpoint every k-th block), None when it is not a positive integer."""
    return int(option) if option.isdigit() and int(option) >= 1 else None


def _check_model(m: Model, *, seq_len: int) -> list[str]:
    """The flavor or HF folder exists and supports seq_len."""
    if m.hf_assets_path is None and m.flavor not in FLAVORS:
        hint = _did_you_mean(m.flavor, FLAVORS)
        return [f"model.flavor: unknown flavor '{m.flavor}'{hint} (choose from {', '.join(FLAVORS)})"]
    if m.hf_assets_path is not None and not (Path(m.hf_assets_path) / "config.json").is_file():
        return [
            f"model.hf_assets_path: {m.hf_assets_path} has no config.json; point it at a downloaded Hugging Face Llama folder"
        ]
    try:
        args = model_args(m)
    except ConfigError as e:
        return [f"model.hf_assets_path: {problem}" for problem in e.problems]
    if m.hf_assets_path is not None and m.flavor != Model.flavor:
        warn(f"model.flavor = {m.flavor!r} is ignored: model.hf_assets_path sets the model shape")
    if seq_len > args.max_seq_len:
        source = m.flavor if m.hf_assets_path is None else f"{m.hf_assets_path} (max_position_embeddings)"
        return [f"training.seq_len: {seq_len} exceeds the {args.max_seq_len} tokens {source} supports; lower it"]
    return []


# ------------------------------------------------------------------ presentation


def help_text() -> str:
    lines = [
        "usage: train.py [--config FILE.toml] [--section.key=value ...] [--print-config] [--help]",
        "",
        "--config: a TOML file; a name such as llama3_8b.toml is also looked up in configs/.",
        "--print-config: print the resolved config and derived numbers, then exit.",
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
