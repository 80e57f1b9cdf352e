"""TOML + CLI configuration: every shipped config loads, overrides, and user errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from config import REPO, SECTIONS, JobConfig, field_docs, help_text, keys, load_config, script, to_toml
from data.inputs import input_problems
from errors import ConfigError
from parallelisms.parallel_dims import layout_checks
from tests.conftest import SHIPPED, Launch


def test_every_shipped_config_has_a_launch_row() -> None:
    assert sorted(SHIPPED) == sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.toml"))


def test_every_shipped_config_loads_and_validates(
    shipped_config: tuple[str, Launch, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _, overrides = shipped_config
    monkeypatch.chdir(tmp_path)  # any working directory: the shipped relative paths resolve to the repo's
    cfg = load_config(["--config", path, *overrides])
    assert isinstance(cfg, JobConfig)
    assert cfg.model.tokenizer_path == "byte" or Path(cfg.model.tokenizer_path).exists()
    assert Path(cfg.data.path).exists()


def test_config_names_and_relative_paths_work_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    by_name = load_config(["--config", "debug_tp.toml"])  # what users type: found in configs/
    assert by_name == load_config(["--config", str(REPO / "configs/debug_tp.toml")])
    assert by_name.data.path == str(REPO / "assets/corpus/stories.jsonl")
    # A file of the working directory wins over the repo's.
    (tmp_path / "assets").mkdir()
    mine = tmp_path / "assets" / "mine.jsonl"
    mine.write_text('{"text": "x"}\n')
    assert load_config(["--data.path=assets/mine.jsonl"]).data.path == "assets/mine.jsonl"
    assert "did you mean 'configs/llama3_8b.toml'" in problems(["--config", "llama3_9b.toml"])[0]


def test_every_field_has_a_docstring_and_appears_in_help() -> None:
    text = help_text()
    for name, section in SECTIONS.items():
        docs = field_docs(section)
        for f in keys(section):
            assert docs.get(f.name), f"{name}.{f.name} has no docstring"
            assert f"--{name}.{f.name} " in text


def test_precedence_cli_over_toml_over_defaults(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.5\n")
    cfg = load_config(["--config", str(toml), "--training.steps=5", "--optimizer.lr", "0.25"])
    assert cfg.training.steps == 5  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.optimizer.lr == 0.25
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size  # default


def test_cli_value_forms() -> None:
    cfg = load_config(["--compile.enable", "--debug.deterministic=true", "--checkpoint.initial_load_path=none"])
    assert cfg.compile.enable is True and cfg.debug.deterministic is True
    assert cfg.checkpoint.initial_load_path is None
    cfg = load_config(["--lr_scheduler.decay_ratio", "0.5", "--compile.enable", "false"])
    assert cfg.lr_scheduler.decay_ratio == 0.5 and cfg.compile.enable is False


def test_resolved_config_round_trips_through_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    cfg = load_config(["--config", "configs/debug.toml", "--training.steps=3", '--job.description=a "quoted" run'])
    out = tmp_path / "resolved.toml"
    out.write_text(to_toml(cfg))
    assert load_config(["--config", str(out)]) == cfg


def problems(argv: list[str]) -> list[str]:
    """What training's load_config refuses (the input files' checks included)."""
    with pytest.raises(ConfigError) as info:
        load_config(argv, input_checks=input_problems)
    return info.value.problems


def test_unknown_section_and_key_suggest_the_right_name(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[trainig]\nsteps = 1\n[optimizer]\nlrr = 0.1\n")
    found = problems(["--config", str(toml)])
    assert len(found) == 2
    assert "unknown section 'trainig'" in found[0] and "did you mean 'training'" in found[0]
    assert found[1].startswith("optimizer.lrr: unknown key") and "did you mean 'lr'" in found[1]
    assert "did you mean 'steps'" in problems(["--training.stepz=3"])[0]


def test_wrong_types_are_errors(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text(
        '[training]\nsteps = "ten"\nmax_norm = true\n[debug]\ndeterministic = 1\n[activation_checkpoint]\nmode = "ful"\n'
    )
    found = problems(["--config", str(toml)])
    assert [p.split(":")[0] for p in found] == [
        "training.steps", "training.max_norm", "debug.deterministic", "activation_checkpoint.mode",
    ]  # fmt: skip
    assert "expected int, got 'ten'" in found[0]
    assert "'none' | 'full' | 'selective'" in found[3]
    assert "expected int" in problems(["--training.steps=1.5"])[0]
    assert "expected bool" in problems(["--compile.enable=maybe"])[0]


def test_cross_field_checks_report_all_problems_together() -> None:
    argv = [
        "--training.steps=0", "--optimizer.lr=-1", "--lr_scheduler.min_lr_factor=2", "--training.seq_len=4096",
        "--training.skip_spike_sigma=-6", "--training.skip_spike_window=1", "--training.z_loss_weight=-1",
    ]  # fmt: skip
    found = problems(argv)
    keys = {p.split(":")[0] for p in found}
    assert {"training.steps", "optimizer.lr", "lr_scheduler.min_lr_factor", "training.seq_len",
            "training.skip_spike_sigma", "training.skip_spike_window", "training.z_loss_weight"} <= keys  # fmt: skip
    assert any("exceeds the 2048 tokens debugmodel supports" in p for p in found)


def test_activation_checkpointing_per_block_and_its_budget_are_checked_when_the_config_loads() -> None:
    """mode = "per_block" needs one known mode per block of the flavor; per_block and memory_budget_gib are refused
    where the mode would ignore them (a value that does nothing is no silent no-op)."""
    ac = "--activation_checkpoint."
    assert load_config(
        [f"{ac}mode=per_block", f"{ac}per_block=full,op,none,op,op,none"]
    ).activation_checkpoint.per_block
    assert load_config([f"{ac}mode=auto", f"{ac}memory_budget_gib=20"]).activation_checkpoint.memory_budget_gib == 20
    assert problems([f"{ac}mode=per_block", f"{ac}per_block=full,op,bad"]) == [
        "activation_checkpoint.per_block: 3 entries for a model of 6 blocks; give one per block",
        "activation_checkpoint.per_block: unknown 'bad'; each block is one of none, op, full",
    ]
    assert problems([f"{ac}mode=per_block"]) == [
        'activation_checkpoint.per_block: mode = "per_block" needs one entry per block ("none", "op" or "full")'
    ]
    assert problems([f"{ac}mode=full", f"{ac}per_block=full", f"{ac}memory_budget_gib=-1"]) == [
        'activation_checkpoint.per_block: ignored by mode = "full"; set mode = "per_block" or remove it',
        "activation_checkpoint.memory_budget_gib: -1 is negative; give GiB per GPU, or 0 for 90% of the device's",
    ]
    assert problems([f"{ac}memory_budget_gib=40"]) == [
        'activation_checkpoint.memory_budget_gib: 40 is read by mode = "auto" only (mode is "none"); set mode = '
        '"auto" or remove it'
    ]


def test_float16_is_refused_for_want_of_loss_scaling() -> None:
    (problem,) = problems(["--training.mixed_precision_param=float16"])
    assert problem.startswith("training.mixed_precision_param: float16 needs loss scaling") and "bfloat16" in problem


def test_missing_files_are_named_for_training_and_noted_when_planning() -> None:
    argv = [
        "--data.path=nope.jsonl", "--model.tokenizer_path=nope/", "--checkpoint.initial_load_path=nope",
        "--model.hf_assets_path=/nonexistent",
    ]  # fmt: skip
    found = problems(argv)
    assert [p.split(":")[0] for p in found] == [
        "model.hf_assets_path", "data.path", "model.tokenizer_path", "checkpoint.initial_load_path",
    ]  # fmt: skip
    assert found[0] == (
        "model.hf_assets_path: /nonexistent not found; point it at a Hugging Face folder (config.json, tokenizer "
        "files, *.safetensors)"
    )
    # Planning (--print-config, planning/doctor.py, a dry run) loads the same config; the files are its notes.
    assert input_problems(load_config(argv)) == found
    assert "file missing.toml not found" in problems(["--config", "missing.toml"])[0]
    # Advice names the script so that it runs from anywhere; torchtitan's c4_test is torchtitan's folder.
    (problem,) = problems(["--data.path=data/nope"])
    assert f"python {REPO / 'scripts' / 'prepare_data.py'} --source SOURCE" in problem or Path.cwd() == REPO
    found = problems(["--training.dataset=c4_test", "--config", str(REPO / "tests/torchtitan/debug_model.toml")])
    assert "torchtitan's test corpus, read from ./tests/assets/c4_test in a torchtitan checkout" in found[-1]


def test_settings_that_passed_silently_or_failed_badly() -> None:
    # torchtitan's dataset key given on the command line beats data.path from the TOML (with a warning).
    cfg = load_config(["--config", "configs/debug.toml", "--training.dataset=c4"])
    assert (cfg.data.path, cfg.data.format, cfg.data.name) == ("allenai/c4", "hub", "en")
    with pytest.raises(ConfigError) as info:
        load_config(["--data.path=a.jsonl", "--training.dataset=c4"])
    assert info.value.problems == ["data.path: 'a.jsonl' and training.dataset both name the training data; keep one"]
    # A flag without a value is a boolean's; anything else says so.
    assert problems(["--training.steps"]) == ["training.steps: needs a value (--training.steps=VALUE, int)"]
    assert problems(["--config"]) == ["--config: needs a file name (--config configs/debug.toml)"]
    assert problems(["--confg", "configs/debug.toml"])[0] == "--confg: unexpected argument; did you mean '--config'?"
    # torchtitan's names of earlier releases say where the key lives now.
    assert problems(["--training.seed=3"]) == [
        "training.seed: a key of earlier torchtitan releases; it is debug.seed now"
    ]
    assert problems(["--model.shape_from_hf_config"]) == [
        "model.shape_from_hf_config: takes the shape from model.hf_assets_path's config.json, and "
        "model.hf_assets_path is unset; set it to a Hugging Face folder"
    ]
    # The layout's rules (the world size torchrun gives) join the config's in one round.
    found = problems_with_world(["--training.stepz=3", "--parallelism.data_parallel_shard_degree=2"], world_size=1)
    assert [p.split(":")[0] for p in found] == ["training.stepz", "parallelism"]


def test_a_mixture_names_the_training_data_instead_of_data_path(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Given on the command line, it replaces the TOML's data.path (with a warning), resolved like other inputs.
    monkeypatch.chdir(tmp_path)
    cfg = load_config(["--config", "configs/debug.toml", "--data.mixture=assets/corpus,/nope/code"])
    assert (cfg.data.path, cfg.data.mixture) == (None, [str(REPO / "assets/corpus"), "/nope/code"])
    assert "data.path: overridden by data.mixture from the command line" in capsys.readouterr().err
    assert input_problems(cfg) == [
        f"data.mixture: /nope/code not found; prepare a corpus into it with `python {script('prepare_data.py')} "
        "--source SOURCE --tokenizer assets/tokenizer --output /nope/code --workers N`".replace(
            "assets/tokenizer", cfg.model.tokenizer_path
        )
    ]
    with pytest.raises(ConfigError) as info:
        load_config(["--data.path=a", "--data.mixture=b,c", "--data.mixture_weights=1,2,3"])
    assert info.value.problems == [
        "data.path: 'a' and data.mixture both name the training data; keep one",
        "data.mixture_weights: 3 weights for 2 data.mixture folders; give one weight per folder (or none for equal shares)",
    ]
    with pytest.raises(ConfigError) as info:
        load_config(["--data.mixture=b,c", "--data.mixture_weights=1,0"])
    assert info.value.problems == [
        "data.mixture_weights: every weight must be > 0, got [1.0, 0.0]; leave a folder out instead"
    ]
    with pytest.raises(ConfigError) as info:
        load_config(["--data.mixture_weights=1,2"])
    assert info.value.problems == [
        "data.mixture_weights: weighs the folders of data.mixture, which is empty; set data.mixture or remove the key"
    ]


def problems_with_world(argv: list[str], *, world_size: int) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(argv, extra_checks=layout_checks(world_size))
    return info.value.problems


def test_unexpected_arguments() -> None:
    assert "unexpected argument" in problems(["steps=3"])[0]


def test_compile_backend_is_checked_when_the_config_loads() -> None:
    assert load_config(["--compile.backend=aot_eager"]).compile.backend == "aot_eager"
    (problem,) = problems(["--compile.backend=inductr"])
    assert problem.startswith("compile.backend: unknown backend 'inductr'; use one of ") and "inductor" in problem


def test_messages_name_the_configured_model_family() -> None:
    (problem,) = problems(["--model.name=qwen3", "--model.flavor=debugmodel", "--parallelism.expert_parallel_degree=2"])
    assert "expert parallel, and qwen3 has no experts" in problem
    (problem,) = problems(["--model.name=qwen3", "--model.converters=quantize.grouped_mm.float8"])
    assert "grouped GEMMs for MoE experts" in problem
