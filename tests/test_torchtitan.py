"""torchtitan users at home: its v0.2.2 llama3 TOMLs run here unchanged, from the user's own folder.

tests/torchtitan/*.toml hold the keys and values of torchtitan's four llama3 train configs; the
installed torchtitan package (0.2.2, a dev dependency) is the reference for the key list, the
learning-rate schedule and the defaults.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

import models
from config import SECTIONS, JobConfig, LRScheduler, keys, load_config, section_of
from data.inputs import input_problems
from errors import ConfigError
from models.llama3 import FLAVORS as LLAMA3_FLAVORS
from tests.launch import REPO, python, two_at_a_time
from train import lr_factor

TORCHTITAN = REPO / "tests" / "torchtitan"
NAMES = ["debug_model", "llama3_8b", "llama3_70b", "llama3_405b"]


def torchtitan_keys() -> dict[str, Any]:
    """section.key -> default of every leaf of torchtitan's JobConfig."""
    from torchtitan.config.job_config import JobConfig as TorchtitanJobConfig

    found: dict[str, Any] = {}

    def walk(obj: Any, prefix: str) -> None:
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(hints[f.name]):
                walk(value, f"{prefix}{f.name}.")
            else:
                found[prefix + f.name] = value

    walk(TorchtitanJobConfig(), "")
    return found


def our_keys() -> dict[str, Any]:
    defaults = JobConfig()
    return {
        f"{name}.{f.name}": getattr(section_of(defaults, name), f.name)
        for name, section in SECTIONS.items()
        for f in keys(section)
    }


def test_every_torchtitan_key_is_a_key_here_and_differing_defaults_are_documented() -> None:
    theirs, ours = torchtitan_keys(), our_keys()
    assert len(theirs) > 140  # 149 in 0.2.2
    assert sorted(set(theirs) - set(ours)) == []
    # A default that differs changes what a torchtitan TOML that leaves the key out does: each one
    # must be in docs/configuration.md's "Coming from torchtitan" section, which says why.
    page = (REPO / "docs" / "configuration.md").read_text()
    section = page[page.index("## Coming from torchtitan") :]
    section = section[: section.index("\n## ", 4)] if "\n## " in section[4:] else section
    differing = sorted(key for key in theirs if theirs[key] != ours[key])
    assert differing, "torchtitan's defaults all match: drop the list in docs/configuration.md"
    for key in differing:
        assert f"`{key}`" in section, f"{key}: ours {ours[key]!r}, torchtitan's {theirs[key]!r}, undocumented"


@pytest.mark.parametrize("name", NAMES)
def test_fixture_holds_torchtitans_keys(name: str) -> None:
    """The fixtures use torchtitan's keys only (no key of ours slipped in), with values of its types."""
    import tomllib

    theirs = torchtitan_keys()
    data = tomllib.loads((TORCHTITAN / f"{name}.toml").read_text())

    def leaves(table: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
        out = []
        for key, value in table.items():
            out += leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [(prefix + key, value)]
        return out

    for key, value in leaves(data):
        assert key in theirs, key
        default = theirs[key]
        assert default is None or isinstance(value, type(default)) or isinstance(default, float), (key, value)


@pytest.fixture
def user_folder(tmp_path: Path, llama3_stand_ins: tuple[Path, Path]) -> Path:
    return make_user_folder(tmp_path, llama3_stand_ins)


@pytest.fixture(scope="module")
def printed_configs(
    tmp_path_factory: pytest.TempPathFactory, llama3_stand_ins: tuple[Path, Path]
) -> dict[str, subprocess.CompletedProcess[str]]:
    """`python path/to/train.py --config their.toml --print-config` for each of their TOMLs, from their folder,
    no PYTHONPATH (two at a time)."""
    folder = make_user_folder(tmp_path_factory.mktemp("user"), llama3_stand_ins)
    procs = two_at_a_time(
        *(
            lambda name=name: python(
                str(REPO / "train.py"), "--config", f"{name}.toml", "--print-config", cwd=folder, env={"PYTHONPATH": ""}
            )
            for name in NAMES
        )
    )
    return dict(zip(NAMES, procs, strict=True))


def make_user_folder(tmp_path: Path, llama3_stand_ins: tuple[Path, Path]) -> Path:
    """A torchtitan user's working folder: ./assets/hf/Llama-3.1-*/ (tokenizers only: the Llama 3
    stand-in), ./tests/assets/tokenizer (the debug tokenizer, here ours) and ./tests/assets/c4_test."""
    tokenizer, _ = llama3_stand_ins
    for size in ("8B", "70B", "405B"):
        folder = tmp_path / "assets" / "hf" / f"Llama-3.1-{size}"
        folder.mkdir(parents=True)
        (folder / "tokenizer.json").symlink_to(tokenizer)
    shutil.copytree(REPO / "assets" / "tokenizer", tmp_path / "tests" / "assets" / "tokenizer")
    c4_test = tmp_path / "tests" / "assets" / "c4_test"
    c4_test.mkdir()
    shutil.copy(REPO / "assets" / "corpus" / "stories_validation.jsonl", c4_test / "data.json")
    for name in NAMES:
        shutil.copy(TORCHTITAN / f"{name}.toml", tmp_path / f"{name}.toml")
    return tmp_path


def _shape(a: Any, kv_heads: int) -> tuple:
    return (
        a.dim,
        a.n_layers,
        a.n_heads,
        kv_heads,
        a.vocab_size,
        a.multiple_of,
        a.ffn_dim_multiplier,
        float(a.rope_theta),
        a.norm_eps,
    )


def test_every_flavor_has_torchtitans_shape() -> None:
    """torchtitan's debug_model.toml trains the same model here as in torchtitan (benchmarks/vs_torchtitan.py
    compares their speed on it): every llama3 flavor of torchtitan 0.2.2, by its name or ours."""
    from torchtitan.models.llama3 import llama3_args

    aliases = models.family("llama3").flavor_aliases
    compared = []
    for name, theirs in llama3_args.items():
        ours = LLAMA3_FLAVORS.get(aliases.get(name, name))
        if ours is not None:  # (the others are attention variants, flex and varlen, of the same shapes)
            assert _shape(ours, ours.n_kv_heads) == _shape(theirs, theirs.n_kv_heads or theirs.n_heads), name
            compared.append(name)
    assert compared == ["debugmodel", "8B", "70B", "405B"]


@pytest.mark.parametrize(
    ("name", "parameters", "flavor"),
    [
        ("debug_model", "6,163,712", "debugmodel"),
        ("llama3_8b", "8,030,261,248", "llama3_8b"),
        ("llama3_70b", "70,553,706,496", "llama3_70b"),
        ("llama3_405b", "405,853,388,800", "llama3_405b"),
    ],
)
def test_torchtitan_toml_prints_its_config_unchanged(
    printed_configs: dict[str, subprocess.CompletedProcess[str]], name: str, parameters: str, flavor: str
) -> None:
    """`python path/to/train.py --config their.toml --print-config`, from their folder, no PYTHONPATH."""
    proc = printed_configs[name]
    assert proc.returncode == 0, proc.stderr
    assert f'flavor = "{flavor}"' in proc.stdout and f"# parameters: {parameters} " in proc.stdout
    tokenizer = "./tests/assets/tokenizer" if name == "debug_model" else f"./assets/hf/Llama-3.1-{name[7:].upper()}"
    assert f'tokenizer_path = "{tokenizer}"' in proc.stdout  # from hf_assets_path, in their folder
    if name == "debug_model":
        assert 'path = "tests/assets/c4_test"' in proc.stdout
    else:  # c4 is a hub dataset: prepared once with scripts/prepare_data.py (the start-up error says how)
        assert 'path = "allenai/c4"' in proc.stdout and 'format = "hub"' in proc.stdout
    if name == "llama3_405b":
        assert 'converters = ["quantize.linear.float8"]' in proc.stdout  # torchtitan's alias "float8"


@pytest.mark.parametrize(
    "schedule",
    [
        LRScheduler(warmup_steps=2, decay_ratio=0.8),
        LRScheduler(warmup_steps=200),
        LRScheduler(warmup_steps=5, decay_type="cosine", min_lr_factor=0.1),
        LRScheduler(warmup_steps=3, decay_ratio=0.5, decay_type="sqrt", total_steps=40),
        LRScheduler(warmup_steps=0, decay_type="linear"),
        LRScheduler(warmup_steps=30, decay_ratio=0.9),  # warmup + decay exceed the steps: clamped
    ],
    ids=str,
)
def test_lr_schedule_is_torchtitans_step_for_step(schedule: LRScheduler) -> None:
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config.job_config import LRScheduler as TorchtitanLRScheduler
    from torchtitan.config.job_config import Optimizer as TorchtitanOptimizer

    steps = 25
    model = torch.nn.Linear(2, 2)
    optimizers = build_optimizers([model], TorchtitanOptimizer(lr=1.0, implementation="for-loop"), None)
    theirs = build_lr_schedulers(optimizers, TorchtitanLRScheduler(**dataclasses.asdict(schedule)), steps)
    for step in range(steps):
        assert optimizers.optimizers[0].param_groups[0]["lr"] == pytest.approx(
            lr_factor(step, schedule, training_steps=steps), abs=1e-12
        ), step
        theirs.step()


def problems(argv: list[str]) -> list[str]:
    """What training's load_config refuses (the input files' checks included)."""
    with pytest.raises(ConfigError) as info:
        load_config(argv, input_checks=input_problems)
    return info.value.problems


def test_a_key_asking_for_what_this_recipe_does_not_do_is_refused_and_a_neutral_value_accepted() -> None:
    cfg = load_config(["--parallelism.expert_tensor_parallel_degree=1", "--memory_estimation.enable=false"])
    assert cfg.parallelism.expert_tensor_parallel_degree == 1
    (problem,) = problems(["--parallelism.expert_tensor_parallel_degree=2"])
    assert problem == (
        "parallelism.expert_tensor_parallel_degree: 2 asks for expert tensor parallel (each expert split over TP "
        "ranks), which this recipe does not do; remove the key or set it to 1"
    )
    (problem,) = problems(["--model.converters=quantize.linear.mx"])
    assert problem.startswith("model.converters: 'quantize.linear.mx' asks for MX (microscaling) linears")


def test_all_problems_come_in_one_round(tmp_path: Path) -> None:
    """Unknown keys, wrong types and bad values together, as torchtitan users met them in two rounds."""
    toml = tmp_path / "c.toml"
    toml.write_text(
        '[training]\nsteps = 0\nseq_len = "long"\n[parallelism]\nexpert_parallel_degree = 2\n[metricz]\nx = 1\n'
    )
    found = problems(["--config", str(toml), "--optimizer.lr=-1"])
    assert [p.split(":")[0] for p in found] == [
        "training.seq_len", "metricz.x", "parallelism.expert_parallel_degree", "training.steps", "optimizer.lr",
    ], found  # fmt: skip


def test_did_you_mean_names_close_keys_only() -> None:
    assert "did you mean 'enable_wandb'" in problems(["--metrics.enable_wandbb"])[0]
    assert "did you mean 'total_steps'" in problems(["--lr_scheduler.total_step=3"])[0]
    assert "did you mean 'initial_load_in_hf'" in problems(["--checkpoint.initial_load_in_hff"])[0]
    # Far from every key: no suggestion rather than a wrong one.
    (problem,) = problems(["--parallelism.pipeline_degree=2"])
    assert problem == "parallelism.pipeline_degree: unknown key in the command line"


def test_flavors_and_datasets_by_torchtitans_names() -> None:
    assert load_config(["--model.flavor=8B", "--training.seq_len=64"]).model.flavor == "llama3_8b"
    (problem,) = problems(["--model.flavor=9B"])
    assert problem.startswith("model.flavor: unknown llama3 flavor '9B'") and "8B, 70B, 405B" in problem
    # torchtitan files its Qwen3 MoE flavors under [model] name = "qwen3": here they are the qwen3_moe family's.
    for flavor, ours in (("30B-A3B", "qwen3_moe_30b_a3b"), ("debugmodel_moe", "debugmodel")):
        m = load_config(["--model.name=qwen3", f"--model.flavor={flavor}", "--memory_estimation.enable=false"]).model
        assert (m.name, m.flavor) == ("qwen3_moe", ours)
    assert load_config(["--model.name=qwen3", "--model.flavor=debugmodel"]).model.name == "qwen3"
    cfg = load_config(["--training.dataset=c4"])
    assert (cfg.data.path, cfg.data.format, cfg.data.name, cfg.data.split) == ("allenai/c4", "hub", "en", "train")
    (problem,) = problems(["--training.dataset=c4_test"])  # torchtitan's test folder, not in this folder
    assert problem.startswith("data.path: tests/assets/c4_test not found")
    (problem,) = problems(["--training.dataset=wikitext"])
    assert problem.startswith("training.dataset: unknown dataset 'wikitext' (c4, c4_test, or set")
    data = str(REPO / "assets/corpus/stories.jsonl")
    assert load_config(["--training.dataset=c4", f"--training.dataset_path={data}"]).data.path == data


def test_wandb_without_credentials_stops_in_one_line(tmp_path: Path) -> None:
    from tests.conftest import TINY

    env = {
        "WANDB_MODE": "online",
        "WANDB_API_KEY": "",
        "WANDB_SILENT": "true",
        "HOME": str(tmp_path),
        "NETRC": str(tmp_path / "none"),
    }
    proc = python(
        "train.py", *TINY, "--training.steps=1", f"--job.dump_folder={tmp_path}", "--metrics.enable_wandb", env=env
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: metrics.enable_wandb: wandb could not start a run" in proc.stderr and "Traceback" not in proc.stderr


def test_gc_runs_every_gc_freq_steps_on_every_rank_and_only_then(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from train import GarbageCollection

    collected: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation))
    was_enabled = gc.isenabled()
    schedule = GarbageCollection(every=3)
    try:
        assert not gc.isenabled()  # no collection at a random moment of a step
        steps = []
        for step in range(1, 8):
            before = len(collected)
            schedule.before_step(step)
            steps += [step] * (len(collected) - before)
        assert steps == [3, 6] and collected == [1, 1, 1]  # one at start-up, then every 3 steps
    finally:
        schedule.close()
        assert gc.isenabled()
        if not was_enabled:
            gc.disable()


def test_compile_components_choose_what_is_compiled() -> None:
    from config import Compile, JobConfig, Parallelism, Training
    from loss import build_loss_fn, summed_losses
    from models.llama3 import FLAVORS, Transformer
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.parallelize import parallelize_model

    assert build_loss_fn(Compile(enable=True, components=["model"])).summed is summed_losses
    compiled = build_loss_fn(Compile(enable=True, components=["loss"], backend="eager")).summed
    assert compiled is not summed_losses
    logits, labels = torch.randn(2, 8, 32), torch.randint(0, 32, (2, 8))
    assert torch.equal(compiled(logits, labels, z=False)[0], summed_losses(logits, labels, z=False)[0])

    def blocks_compiled(components: list[str]) -> bool:
        with torch.device("meta"):
            model = Transformer(FLAVORS["debugmodel"])
        dims = ParallelDims.from_config(Parallelism(), world_size=1)
        cfg = JobConfig(
            training=Training(mixed_precision_param="float32"), compile=Compile(enable=True, components=components)
        )
        parallelize_model(model, cfg, dims=dims, mesh=None, device=torch.device("cpu"))
        return all(block._compiled_call_impl is not None for block in model.layers.values())

    assert blocks_compiled(["model", "loss"]) and not blocks_compiled(["loss"])


def test_profiler_records_profiler_active_steps_after_profiler_warmup(tmp_path: Path) -> None:
    from config import Profiling
    from profiling import maybe_profile

    cfg = Profiling(enable_profiling=True, profile_freq=4, profiler_warmup=1, profiler_active=2)
    with maybe_profile(cfg, dump_folder=tmp_path, rank=0, start_step=0) as profiler:
        for _ in range(8):
            torch.mm(torch.randn(16, 16), torch.randn(16, 16))
            profiler.step()
    assert sorted(p.name for p in (tmp_path / "profile_traces").iterdir()) == ["iteration_4", "iteration_8"]
    trace = json.loads((tmp_path / "profile_traces" / "iteration_8" / "rank0_trace.json").read_text())
    recorded = sorted({e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")})
    assert recorded == ["ProfilerStep#6", "ProfilerStep#7"]  # steps 7 and 8, counted from 0
