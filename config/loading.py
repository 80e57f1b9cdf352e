"""The config loaded: a TOML file and `--section.key=value` overrides onto the sections' defaults, every value
coerced to its field's type, the paths resolved, every rule checked in one round (load_config), and the config
written back as TOML and as `--help`. config/__init__.py tells the whole story."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import json
import math
import os
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from config.sections import (
    DATASETS,
    REPO,
    SHIPPED_CORPUS,
    SHIPPED_TOKENIZER,
    JobConfig,
    Model,
    QuantizeLinearFloat8,
    Training,
    Validation,
    _did_you_mean,
    _importable,
    model_args,
)
from config.torchtitan import (
    MOVED,
    refusal,
)
from errors import ConfigError, warn
from models import NAMES, family, with_seq_len

# ---------------------------------------------------------------- the section tree


@functools.cache
def _types(section: type) -> dict[str, Any]:
    """The section's field types, resolved once (get_type_hints re-evaluates every annotation per call)."""
    return typing.get_type_hints(section)


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def sections(root: type = JobConfig, prefix: str = "") -> Iterator[tuple[str, type]]:
    """(dotted name, dataclass) of every section and sub-section, in order."""
    for f in dataclasses.fields(root):
        tp = _types(root)[f.name]
        if _is_section(tp):
            yield prefix + f.name, tp
            yield from sections(tp, prefix + f.name + ".")


SECTIONS: dict[str, type] = dict(sections())


def keys(section: type) -> list[dataclasses.Field]:
    """The fields of a section that are values, not sub-sections: the recipe's first, then those it inherits from
    config/torchtitan.py."""
    own = inspect.get_annotations(section)
    values = [f for f in dataclasses.fields(section) if not _is_section(_types(section)[f.name])]
    return sorted(values, key=lambda f: f.name not in own)


def section_of(cfg: JobConfig, name: str) -> Any:
    obj: Any = cfg
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def field_docs(section: type) -> dict[str, str]:
    """The docstring under each field of a section dataclass and the ones it inherits, read from the source."""
    docs: dict[str, str] = {}
    for cls in reversed([c for c in section.__mro__ if dataclasses.is_dataclass(c)]):
        class_def = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
        assert isinstance(class_def, ast.ClassDef)
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


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(c) for c in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join("none" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_describe(typing.get_args(tp)[0])}"
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
    if origin is list:
        (item,) = typing.get_args(tp)
        if from_cli and not value.strip().startswith("["):  # `a,b,c`: items as the command line gives them
            return [_coerce(v, item, from_cli=True) for v in value.split(",") if v]
        if from_cli:  # or a TOML/JSON array `["a", "b"]`
            value = json.loads(value)
        if not isinstance(value, list):
            raise ValueError
        return [_coerce(v, item, from_cli=False) for v in value]
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


def _set(cfg: JobConfig, dotted: str, value: Any, *, source: str, from_cli: bool) -> str | None:
    """Set section.key = value on cfg; return a problem line instead of raising."""
    section_name, _, key = dotted.rpartition(".")
    if section_name not in SECTIONS:
        top = section_name.split(".")[0]
        hint = _did_you_mean(section_name, SECTIONS) if top not in SECTIONS else ""
        return f"{dotted}: unknown section '{section_name}' in {source}{hint}"
    section = section_of(cfg, section_name)
    types_ = {f.name: _types(type(section))[f.name] for f in keys(type(section))}
    if key not in types_:
        if dotted in MOVED:
            where = f"it is {MOVED[dotted]} now" if MOVED[dotted] else "this recipe has no such setting"
            return f"{dotted}: a key of earlier torchtitan releases; {where}"
        hint = _did_you_mean(key, types_)
        return f"{dotted}: unknown key in {source}{hint}"
    if value is None:  # a flag alone on the command line
        if types_[key] is not bool:
            return f"{dotted}: needs a value (--{dotted}=VALUE, {_describe(types_[key])})"
        value = "true"
    try:
        setattr(section, key, _coerce(value, types_[key], from_cli=from_cli))
    except (ValueError, json.JSONDecodeError):
        return f"{dotted}: expected {_describe(types_[key])}, got {value!r} in {source}"
    return None


# --------------------------------------------------------------------- loading


def find_config(name: str) -> Path | None:
    """`--config` as given, else under the repo, else `configs/<name>`: what users type works from anywhere."""
    path = Path(name)
    candidates = [path] if path.is_absolute() else [path, REPO / path, REPO / "configs" / path]
    return next((c for c in candidates if c.is_file()), None)


def _flatten(table: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """TOML tables -> (dotted key, value); a table whose name is a section nests, any other is a value."""
    for key, value in table.items():
        dotted = prefix + key
        if isinstance(value, dict) and (dotted in SECTIONS or not prefix):
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value


def load_toml(cfg: JobConfig, name: str, *, keys: set[str] | None = None) -> list[str]:
    """Apply a TOML file to cfg; return the problems found. keys: gets the dotted keys the file set."""
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
    for dotted, value in _flatten(data):
        if "." not in dotted:
            hint = _did_you_mean(dotted, SECTIONS)
            problems.append(f"{dotted}: expected a [section] in {path}, got a value{hint}")
        elif problem := _set(cfg, dotted, value, source=str(path), from_cli=False):
            problems.append(problem)
        elif keys is not None:
            keys.add(dotted)
    return problems


# The command line's own flags (not section.key), for --help and did-you-mean.
FLAGS = ("--config", "--print-config", "--help")


def parse_overrides(args: list[str]) -> tuple[list[tuple[str, str | None]], list[str]]:
    """`--a.b=v` and `--a.b v` -> [(a.b, v)]; a flag without a value -> (a.b, None), which a boolean reads as
    true and anything else refuses."""
    overrides: list[tuple[str, str | None]] = []
    problems = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if not arg.startswith("--") or ("." not in name and name not in ("--config",)):
            hint = _did_you_mean(name, FLAGS) if arg.startswith("--") else ""
            problems.append(f"{arg}: unexpected argument{hint or '; use --section.key=value (see --help)'}")
            i += 1
            continue
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else None
            if nxt is None or nxt.startswith("--"):
                value = None  # `--compile.enable` alone switches a boolean on
            else:
                value, i = nxt, i + 1
        overrides.append((name[2:].replace("-", "_"), value))
        i += 1
    return overrides, problems


def load_config(
    argv: list[str],
    *,
    input_checks: Callable[[JobConfig], list[str]] | None = None,
    extra_checks: Callable[[JobConfig], list[str]] | None = None,
) -> JobConfig:
    """defaults < `--config FILE` < `--section.key value` overrides; raises ConfigError with every problem
    (load_config_and_keys, without the keys)."""
    return load_config_and_keys(argv, input_checks=input_checks, extra_checks=extra_checks)[0]


def load_config_and_keys(
    argv: list[str],
    *,
    input_checks: Callable[[JobConfig], list[str]] | None = None,
    extra_checks: Callable[[JobConfig], list[str]] | None = None,
) -> tuple[JobConfig, list[str]]:
    """The config (load_config), and the keys the command line set, in its order (train.py's banner says them where
    the TOML's job.description may no longer hold).

    Two kinds of rules this module does not import join the same round. input_checks: the input files the run
    reads (training passes data.inputs.input_problems), not for a dry run (comm.mode = fake_backend), which
    plans a job for other machines; --print-config and planning/doctor.py print them as notes instead. extra_checks: run
    once the model and its sequence length are valid (they may build the model's shape): train.py and planning/doctor.py
    pass the parallel layout's for the ranks of the run (parallel degrees, what TP, CP and PP need of the
    model): parallelisms.parallel_dims.layout_checks(world_size).
    """
    cfg, problems, cli_keys = _read(argv)
    resolve(cfg)
    problems += validate(cfg)  # in the same round: a typo elsewhere does not hide a bad value
    if input_checks is not None and cfg.comm.mode != "fake_backend":
        problems += input_checks(cfg)
    if cfg.comm.mode == "fake_backend":  # a dry run plans the job for the world it is told
        problems += dry_run_world()[2]
    if extra_checks is not None and not any(p.startswith(("model.", "training.seq_len")) for p in problems):
        problems += extra_checks(cfg)
    if problems:
        raise ConfigError(*dict.fromkeys(problems))
    return cfg, cli_keys


def _read(argv: list[str]) -> tuple[JobConfig, list[str], list[str]]:
    """The config the command line asks for, unresolved, the problems of reading it (keys, types) and the keys the
    command line sets."""
    cfg = JobConfig()
    overrides, problems = parse_overrides(argv)
    files = [value for name, value in overrides if name in ("config", "job.config_file")]
    overrides = [(name, value) for name, value in overrides if name not in ("config", "job.config_file")]
    if len(files) > 1:
        problems.append(f"--config: one file only, got {', '.join(str(f) for f in files)}")
    elif files and files[0] is None:
        problems.append("--config: needs a file name (--config configs/debug.toml)")
    toml_keys: set[str] = set()
    if files and files[0] is not None:
        problems += load_toml(cfg, files[0], keys=toml_keys)
    for dotted, value in overrides:
        if problem := _set(cfg, dotted, value, source="the command line", from_cli=True):
            problems.append(problem)
    problems += _training_data_source(cfg, toml_keys=toml_keys, cli_keys={name for name, _ in overrides})
    return cfg, problems, [name for name, _ in overrides]


def env_world_size() -> int | None:
    """$WORLD_SIZE, the ranks of this job (torchrun sets it; a dry run is told it), read here and nowhere else: None
    when unset, a ConfigError when it is not a number of ranks."""
    world = os.environ.get("WORLD_SIZE", "")
    if world and not (world.isdigit() and int(world) >= 1):
        raise ConfigError(
            f"WORLD_SIZE: {world!r} is not a number of ranks; set the job's (e.g. WORLD_SIZE=64) or unset it"
        )
    return int(world) if world else None


def dry_run_world() -> tuple[int, int, list[str]]:
    """What a dry run (comm.mode = fake_backend) simulates: $WORLD_SIZE ranks, $LOCAL_WORLD_SIZE (default 8) per
    node; and the problems with those variables."""
    per_node, problems = os.environ.get("LOCAL_WORLD_SIZE", "8"), []
    try:
        world = env_world_size()
    except ConfigError as e:
        world, problems = None, [f"comm.mode: fake_backend simulates rank 0 of WORLD_SIZE ranks, but {e.problems[0]}"]
    if world is None and not problems:
        problems.append(
            "comm.mode: fake_backend simulates rank 0 of WORLD_SIZE ranks, but WORLD_SIZE is 'unset'; run e.g. "
            "WORLD_SIZE=64 python train.py --config ... --comm.mode=fake_backend (not under torchrun)"
        )
    if not (per_node.isdigit() and int(per_node) >= 1):
        problems.append(
            f"comm.mode: fake_backend plans nodes of LOCAL_WORLD_SIZE GPUs, but LOCAL_WORLD_SIZE is {per_node!r}; set "
            "it to the GPUs per node (e.g. 8) or leave it unset"
        )
    return int(world) if not problems else 0, int(per_node) if not problems else 0, problems


def _training_data_source(cfg: JobConfig, *, toml_keys: set[str], cli_keys: set[str]) -> list[str]:
    """data.path, data.mixture (this recipe's keys) and training.dataset / dataset_path (torchtitan's) name the
    training data: the one given at the higher precedence wins (command line over TOML), with a warning; two at
    the same level are a conflict."""
    sources = {
        "data.path": {"data.path"}, "data.mixture": {"data.mixture"},
        "training.dataset": {"training.dataset", "training.dataset_path"},
    }  # fmt: skip
    named_data = set().union(*sources.values())
    given = {k for k in (toml_keys | cli_keys) & named_data if _value(cfg, k) not in (None, [])}
    for level in (cli_keys & given, toml_keys & given):
        named = [name for name, names in sources.items() if names & level]
        if len(named) > 1:
            return [f"{named[0]}: {_value(cfg, named[0])!r} and {named[1]} both name the training data; keep one"]
        if named:
            for name, names in sources.items():
                if name != named[0] and names & given:
                    warn(f"{name}: overridden by {named[0]} from the command line")
                    for dotted in names:
                        section, key = dotted.split(".")
                        setattr(section_of(cfg, section), key, getattr(section_of(JobConfig(), section), key))
            return []
    return []


def _value(cfg: JobConfig, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(section_of(cfg, section), key)


# ------------------------------------------------------------------- resolving


def resolve(cfg: JobConfig) -> None:
    """Settings that follow from others, written in: afterwards every field holds what the run uses."""
    m, t, d = cfg.model, cfg.training, cfg.data
    if m.name in NAMES:
        m.name = _family_of_torchtitan_flavor(m.name, m.flavor)
        m.flavor = family(m.name).flavor_aliases.get(m.flavor, m.flavor)
    if m.tokenizer_path is None:
        m.tokenizer_path = m.hf_assets_path or SHIPPED_TOKENIZER
    if d.path is None and not d.mixture:
        if t.dataset_path is not None:
            d.path = t.dataset_path
        elif t.dataset is not None and t.dataset in DATASETS:
            d.path, hub_name, d.split = DATASETS[t.dataset]
            if hub_name is not None:
                d.format, d.name = "hub", hub_name
        elif t.dataset is None:
            d.path = SHIPPED_CORPUS
    if cfg.debug.seed is None:
        cfg.debug.seed = 42
    cfg.model.converters = ["quantize.linear.float8" if c == "float8" else c for c in cfg.model.converters]
    resolve_input_paths(cfg)


def _family_of_torchtitan_flavor(name: str, flavor: str) -> str:
    """The family of `flavor` under [model] name `name`: torchtitan 0.2.2 files its Qwen3 MoE flavors (30B-A3B, ...)
    under name = "qwen3", which are this recipe's qwen3_moe (its flavor_aliases name them); otherwise `name`."""
    own = family(name)
    if flavor in own.flavors or flavor in own.flavor_aliases:
        return name
    return next((other for other in NAMES if flavor in family(other).flavor_aliases), name)


def resolve_input_paths(cfg: JobConfig) -> None:
    """A relative input path missing from the current directory but present in the repo means the repo's."""
    for name, section in SECTIONS.items():
        obj = section_of(cfg, name)
        for f in keys(section):
            value = getattr(obj, f.name)
            if f.metadata.get("input_path") and isinstance(value, str):
                setattr(obj, f.name, _in_repo(value))
            elif f.metadata.get("input_path") and isinstance(value, list):
                setattr(obj, f.name, [_in_repo(v) for v in value])


def _in_repo(path: str) -> str:
    if Path(path).exists() or Path(path).is_absolute() or not (REPO / path).exists():
        return path
    return str(REPO / path)


def global_batch_size(t: Training, *, dp: int) -> int:
    """Sequences per optimizer step: training.global_batch_size, or with -1 local_batch_size on each of the dp ranks."""
    return t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dp


def grad_accum_steps(global_batch: int, *, local_batch: int, dp: int) -> int:
    """Micro-batches per optimizer step: the global batch over local_batch_size on each of the dp ranks."""
    per_micro = local_batch * dp
    if global_batch % per_micro:
        raise ConfigError(
            f"training.global_batch_size: {global_batch} is not a multiple of local_batch_size {local_batch} x "
            f"data-parallel degree {dp}; use a multiple of {per_micro} or -1"
        )
    return global_batch // per_micro


def run_model_args(cfg: JobConfig) -> Any:
    """The model a run builds: the config's shape (`model_args`), a RoPE table covering the longest
    sequence trained or validated on, and the config's attention mask. train.py and the dry run both use it."""
    longest = max(cfg.training.seq_len, cfg.validation.seq_len if cfg.validation.enable else 0)
    return dataclasses.replace(with_seq_len(model_args(cfg.model), longest), attn_mask_type=cfg.model.attn_mask_type)


def float8_settings(cfg: JobConfig) -> QuantizeLinearFloat8 | None:
    """The float8 linears' settings when [model] converters has them (the one converter validate accepts)."""
    return cfg.quantize.linear.float8 if "quantize.linear.float8" in cfg.model.converters else None


def model_label(cfg: JobConfig) -> str:
    """How start-up names the model: the flavor, or the Hugging Face folder that gives the shape."""
    m = cfg.model
    return f"{m.name} {Path(m.hf_assets_path).name if m.shape_from_hf_config and m.hf_assets_path else m.flavor}"


def validation_path(cfg: Validation) -> str | None:
    """Where the held-out data is: dataset_path, else the local folder torchtitan's name stands for."""
    if cfg.dataset_path is not None:
        return cfg.dataset_path
    path, hub_name, _ = DATASETS.get(cfg.dataset, (None, None, None))
    return path if hub_name is None else None


# ------------------------------------------------------------------- validating


def validate(cfg: JobConfig) -> list[str]:
    """The checks that need no process group, section by section; every problem, not just the first."""
    m, t = cfg.model, cfg.training
    return [
        *_default_only(cfg),
        *m.problems(seq_len=t.seq_len, validation_seq_len=cfg.validation.seq_len if cfg.validation.enable else None),
        *(family(m.name).config_problems(cfg) if m.name in NAMES else []),  # what the family cannot train yet
        *_moe_problems(cfg),
        *_dense_problems(cfg),
        *t.problems(),
        *cfg.optimizer.problems(),
        *cfg.lr_scheduler.problems(training_steps=t.steps),
        *cfg.parallelism.problems(),
        *cfg.comm.problems(),
        *cfg.activation_checkpoint.problems(n_layers=_flavor_layers(m)),
        *cfg.compile.problems(),
        *cfg.quantize.problems(
            converters=m.converters, compiled_model=cfg.compile.enable and "model" in cfg.compile.components
        ),
        *cfg.checkpoint.problems(hf_assets_path=m.hf_assets_path),
        *cfg.metrics.problems(),
        *_missing_parts(cfg),
        *cfg.profiling.problems(),
        *cfg.data.problems(training_dataset=t.dataset, attn_mask_type=m.attn_mask_type),
        *cfg.validation.problems(training=t, pp=cfg.parallelism.pipeline_parallel_degree),
        *cfg.eval.problems(pp=cfg.parallelism.pipeline_parallel_degree),
        *cfg.dpo.problems(
            chat=cfg.data.chat,
            attn_mask_type=cfg.model.attn_mask_type,
            mixture=bool(cfg.data.mixture),
            pp=cfg.parallelism.pipeline_parallel_degree,
            cp=cfg.parallelism.context_parallel_degree,
            z_loss_weight=t.z_loss_weight,
        ),
        *cfg.distill.problems(pp=cfg.parallelism.pipeline_parallel_degree, dpo=cfg.dpo.enable),
        *cfg.lora.problems(
            optimizer=cfg.optimizer.name,
            seed_checkpoint=cfg.checkpoint.create_seed_checkpoint,
            last_save_in_hf=cfg.checkpoint.last_save_in_hf,
        ),
    ]


def _dense_problems(cfg: JobConfig) -> list[str]:
    """What a model without experts refuses: expert parallel (its degree's other rules need the world size,
    parallelisms/parallel_dims.py layout_problems)."""
    name, ep = cfg.model.name, cfg.parallelism.expert_parallel_degree
    if ep == 1 or name not in NAMES or family(name).experts_module:
        return []
    moe = ", ".join(n for n in NAMES if family(n).experts_module)
    return [
        f"parallelism.expert_parallel_degree: {ep} asks for expert parallel, and {name} has no experts (a mixture of "
        f"experts: model.name = {moe}); remove the key or set it to 1"
    ]


def _moe_problems(cfg: JobConfig) -> list[str]:
    """[model.moe]'s rules, for a family that exists (the model rules name the others); a family's flavors are all
    mixtures of experts or none."""
    m = cfg.model
    if m.name not in NAMES:
        return []
    experts = bool(family(m.name).experts_module)
    return m.moe.problems(model=m.name, experts=experts, last_save_in_hf=cfg.checkpoint.last_save_in_hf)


def _flavor_layers(m: Model) -> int | None:
    """The blocks of the flavor the config names; None for a Hugging Face shape or a name the model rules refuse."""
    if m.shape_from_hf_config or m.name not in NAMES or m.flavor not in family(m.name).flavors:
        return None
    return family(m.name).flavors[m.flavor].n_layers


def _missing_parts(cfg: JobConfig) -> list[str]:
    """Optional parts a fork may have deleted (docs/development.md, "Removing a part"): a setting that asks for one is refused."""
    return [
        f"{key}: needs {module.replace('.', '/')}.py, which this checkout does not have; turn it off"
        for asks, module, key in (
            ("quantize.linear.float8" in cfg.model.converters, "parallelisms.float8", "model.converters"),
            (cfg.validation.enable, "evaluation.validation", "validation.enable"),
            (cfg.comm.mode == "fake_backend", "planning.dry_run", "comm.mode"),
        )
        if asks and not _importable(module)
    ]


def _default_only(cfg: JobConfig) -> list[str]:
    """Keys taken at their default only, set to something else: a torchtitan key asking for what this recipe does
    not do (config.torchtitan.refusal), or a key of an optional part this copy of the recipe lacks (`optional_part`)."""
    problems, defaults = [], JobConfig()
    model = cfg.model.name if cfg.model.name in NAMES else "this model"
    for name, section in SECTIONS.items():
        for f in keys(section):
            value, default = getattr(section_of(cfg, name), f.name), getattr(section_of(defaults, name), f.name)
            if problem := refusal(f"{name}.{f.name}", f, value, default, model=model):
                problems.append(problem)
            elif "part" in f.metadata and value != default and not (REPO / f.metadata["part"]).exists():
                problems.append(
                    f"{name}.{f.name}: {value!r} asks for {f.metadata['part']}, which this copy of the recipe does "
                    f"not have; remove the key or set it to {default!r}"
                )
    return problems


def script(name: str) -> str:
    """How to name scripts/<name> in a command: relative in the repo's folder, else its absolute path."""
    path = REPO / "scripts" / name
    return str(path.relative_to(REPO)) if Path.cwd().resolve() == REPO else str(path)


# ------------------------------------------------------------------ presentation


def help_text() -> str:
    lines = [
        "usage: train.py [--config FILE.toml] [--section.key=value ...] [--print-config] [--help]",
        "",
        "--config (or --job.config_file): a TOML file; a name such as llama3_8b.toml is also looked up in configs/.",
        "--print-config: print the resolved config and derived numbers, then exit.",
        "",
        "Precedence: command line > TOML file > defaults. Options:",
    ]
    defaults = JobConfig()
    for name, section in SECTIONS.items():
        fields = keys(section)
        if not fields:
            continue
        lines.append(f"\n[{name}]")
        docs = field_docs(section)
        for f in fields:
            default = getattr(section_of(defaults, name), f.name)
            lines.append(f"  --{name}.{f.name} ({_describe(_types(section)[f.name])}, default {default!r})")
            lines.append(f"      {docs.get(f.name, '')}")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (str, list)):
        return json.dumps(value)
    return str(value)


def to_toml(cfg: JobConfig, *, notes: dict[str, str] | None = None) -> str:
    """The resolved config as TOML (unset optional values are left out, as TOML has no null). notes: a comment after
    the value of a key ("section.key")."""
    out = []
    for name, section in SECTIONS.items():
        fields = keys(section)
        if not fields:
            continue
        out.append(f"[{name}]")
        obj = section_of(cfg, name)
        for f in fields:
            value = getattr(obj, f.name)
            line = f"# {f.name} = (unset)" if value is None else f"{f.name} = {_toml_value(value)}"
            note = (notes or {}).get(f"{name}.{f.name}")
            out.append(f"{line}  # {note}" if note else line)
        out.append("")
    return "\n".join(out)
