"""Job configuration: TOML file -> nested dataclasses, overridable from the command line.

Each TOML section is a dataclass below and each key a field; the string under a field is its
documentation and becomes `--help`. Sections may nest (`[training.dataloader]`,
`[quantize.linear.float8]`). Section and key names are torchtitan v0.2.2's wherever it has one, with
its meaning, so its TOMLs run unchanged; the torchtitan keys this recipe has no use for live in
config/torchtitan.py (each section here inherits its own), accepted at their default value (which
changes nothing) and refused in one line otherwise, or ignored. Precedence: `--section.key=value` on the command line > the TOML file > the
defaults written here. `--job.config_file FILE` (torchtitan's flag) is `--config FILE`.

Every user mistake raises `ConfigError` (errors.py) with one line per problem, naming the key and
the fix: unknown keys, wrong types and bad values of one command, all in one round. Each section
checks its own values (its `problems` method, next to its keys); `validate` gathers them. Rules that
need the world size live next to the fact they check (ParallelDims, check_tp, pp.py) and join the
same round through load_config's `extra_checks`; those that need the process group or the model run
at start-up.

Relative input paths (fields marked `input_path`) are read from the current directory, else from
the repo: a shipped config works from any working directory, and a torchtitan TOML from the user's
own folder (./assets/hf/..., ./tests/assets/...).

The package: sections.py (the schema), loading.py (reading, resolving, checking, writing back) and torchtitan.py
(torchtitan 0.2.2's keys this recipe accepts and ignores or refuses).
"""

from config.loading import (
    FLAGS,
    SECTIONS,
    dry_run_world,
    env_world_size,
    field_docs,
    find_config,
    float8_settings,
    global_batch_size,
    grad_accum_steps,
    help_text,
    keys,
    load_config,
    load_config_and_keys,
    load_toml,
    model_label,
    parse_overrides,
    resolve,
    resolve_input_paths,
    run_model_args,
    script,
    section_of,
    sections,
    to_toml,
    validate,
    validation_path,
)
from config.sections import (
    BLOCK_AC_MODES,
    DATASETS,
    INPUT_PATH,
    REPO,
    ActivationCheckpoint,
    BlockMode,
    Checkpoint,
    Comm,
    Compile,
    Data,
    Debug,
    Distill,
    Dpo,
    Eval,
    Job,
    JobConfig,
    Lora,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Quantize,
    QuantizeLinear,
    QuantizeLinearFloat8,
    Training,
    Validation,
    compile_backends,
    model_args,
    optional_part,
    selective_ac_every,
)

__all__ = [
    "ActivationCheckpoint",
    "BLOCK_AC_MODES",
    "BlockMode",
    "Checkpoint",
    "Comm",
    "Compile",
    "DATASETS",
    "Data",
    "Debug",
    "Distill",
    "Dpo",
    "Eval",
    "FLAGS",
    "INPUT_PATH",
    "Job",
    "JobConfig",
    "Lora",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Quantize",
    "QuantizeLinear",
    "QuantizeLinearFloat8",
    "REPO",
    "SECTIONS",
    "Training",
    "Validation",
    "compile_backends",
    "dry_run_world",
    "env_world_size",
    "field_docs",
    "find_config",
    "float8_settings",
    "global_batch_size",
    "grad_accum_steps",
    "help_text",
    "keys",
    "load_config",
    "load_config_and_keys",
    "load_toml",
    "model_args",
    "model_label",
    "optional_part",
    "parse_overrides",
    "resolve",
    "resolve_input_paths",
    "run_model_args",
    "script",
    "section_of",
    "sections",
    "selective_ac_every",
    "to_toml",
    "validate",
    "validation_path",
]
