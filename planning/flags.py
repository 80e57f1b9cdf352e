"""planning/estimate_memory.py's short flags (`--tp 8 --ac full`) as the config keys they set: `FLAGS`, read one way
only, into the run's own loader (`--section.key=value` overrides), so the estimate reads a JobConfig like every other
tool. `job` makes the Job of a config and flags (the command, torchtitan's published setups in
planning/references.py, the tests)."""

from __future__ import annotations

from typing import Any

from config import load_config
from parallelisms.parallel_dims import ParallelDims
from planning.job import GPU, Job, Machine

# The command's short flags -> the config keys they set; its other flags are the machine's (GPUs, allocator,
# overhead, RMSNorm kernel) and the question asked.
FLAGS = {
    "model": "model.name",
    "flavor": "model.flavor",
    "tp": "parallelism.tensor_parallel_degree",
    "replicate": "parallelism.data_parallel_replicate_degree",
    "cp": "parallelism.context_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
    "pp_schedule": "parallelism.pipeline_parallel_schedule",
    "pp_microbatch_size": "parallelism.pipeline_parallel_microbatch_size",
    "pp_layers_per_stage": "parallelism.pipeline_parallel_layers_per_stage",
    "pp_first_stage_less_layers": "parallelism.pipeline_parallel_first_stage_less_layers",
    "pp_last_stage_less_layers": "parallelism.pipeline_parallel_last_stage_less_layers",
    "defer_reduce_scatter": "parallelism.fsdp_defer_reduce_scatter",
    "seq_len": "training.seq_len",
    "local_batch_size": "training.local_batch_size",
    "param_dtype": "training.mixed_precision_param",
    "reduce_dtype": "training.mixed_precision_reduce",
    "cpu_offload": "training.enable_cpu_offload",
    "loss_chunk_tokens": "training.loss_chunk_tokens",
    "optimizer": "optimizer.name",
    "ac": "activation_checkpoint.mode",  # selective-op or selective-<k>: mode selective and its selective_ac_option
}
# Without a --config: a job worth estimating, not the debug model (the rest are the config's defaults).
DEFAULTS = {"flavor": "llama3_8b", "seq_len": 8192, "local_batch_size": 1, "ac": "selective-op"}


def overrides(flags: dict[str, Any]) -> list[str]:
    """Flags and values (by FLAGS' names; None: not given) as the loader's `--section.key=value` overrides. `ac`
    "selective-<option>" sets the mode and its selective_ac_option."""
    flags = {name: value for name, value in flags.items() if value is not None}
    if unknown := sorted(set(flags) - set(FLAGS)):
        raise TypeError(f"no config key for {', '.join(unknown)}; the flags are {', '.join(FLAGS)}")
    keys = {FLAGS[name]: value for name, value in flags.items()}
    if "ac" in flags:
        mode, _, option = str(flags["ac"]).partition("-")
        keys["activation_checkpoint.mode"] = mode
        if option:
            keys["activation_checkpoint.selective_ac_option"] = option
    as_text = {key: str(value).lower() if isinstance(value, bool) else str(value) for key, value in keys.items()}
    return [f"--{key}={value}" for key, value in as_text.items()]


def job(
    ngpu: int = 8,
    *,
    config: str | None = None,
    machine: Machine = GPU,
    args: Any = None,
    grad_accum: int | None = None,
    extra: tuple[str, ...] | list[str] = (),
    **flags: Any,
) -> Job:
    """The Job of a config (a TOML, or DEFAULTS without one) with `flags` set, on `ngpu` ranks of `machine`, through
    the run's own loader: ConfigError names the keys. grad_accum: micro-batches per step, as the
    training.global_batch_size it takes; extra: `--section.key=value` overrides (any key); args: a model shape no
    flavor has."""
    flags = {name: value for name, value in flags.items() if value is not None}
    argv = [*([f"--config={config}"] if config else []), *overrides(flags if config else {**DEFAULTS, **flags})]
    argv += extra
    cfg = load_config(argv)
    result = Job.of(cfg, machine, world_size=ngpu, args=args)  # the layout's problems first, in the run's words
    if grad_accum is None:
        return result
    dp = ParallelDims.from_config(cfg.parallelism, world_size=ngpu).dp
    cfg = load_config([*argv, f"--training.global_batch_size={grad_accum * cfg.training.local_batch_size * dp}"])
    return Job.of(cfg, machine, world_size=ngpu, args=args)
