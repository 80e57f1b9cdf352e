"""TOML + CLI configuration: every shipped config loads, overrides, and user errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from config import SECTIONS, ConfigError, JobConfig, field_docs, help_text, load_config, to_toml
from tests.launch import REPO

CONFIGS = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.toml"))


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # configs name repo-relative data and tokenizer paths


@pytest.mark.parametrize("path", CONFIGS)
def test_every_shipped_config_loads_and_validates(path: str, tmp_path: Path) -> None:
    overrides = []
    if "hf_assets_path" in (REPO / path).read_text():
        # A fine-tune config names a downloaded HF folder and its converted checkpoint, which
        # CI does not have: stand in a tiny random HF folder (256 positions) and an empty folder.
        from tests.tiny_hf import tiny_hf_folder

        hf = tiny_hf_folder(tmp_path / "hf")
        (tmp_path / "ckpt").mkdir()
        overrides = [
            f"--model.hf_assets_path={hf}", f"--model.tokenizer_path={hf}",
            f"--checkpoint.initial_load_path={tmp_path / 'ckpt'}", "--training.seq_len=256",
        ]  # fmt: skip
    cfg = load_config(["--config", path, *overrides])
    assert isinstance(cfg, JobConfig)


def test_every_field_has_a_docstring_and_appears_in_help() -> None:
    text = help_text()
    for name, section in SECTIONS.items():
        docs = field_docs(section)
        for f in dataclasses.fields(section):
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
    cfg = load_config(["--compile.enable", "--training.deterministic=true", "--checkpoint.initial_load_path=none"])
    assert cfg.compile.enable is True and cfg.training.deterministic is True
    assert cfg.checkpoint.initial_load_path is None
    cfg = load_config(["--lr_scheduler.decay_ratio", "0.5", "--compile.enable", "false"])
    assert cfg.lr_scheduler.decay_ratio == 0.5 and cfg.compile.enable is False


def test_resolved_config_round_trips_through_toml(tmp_path: Path) -> None:
    cfg = load_config(["--config", "configs/debug.toml", "--training.steps=3", '--job.description=a "quoted" run'])
    out = tmp_path / "resolved.toml"
    out.write_text(to_toml(cfg))
    assert load_config(["--config", str(out)]) == cfg


def problems(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(argv)
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
        '[training]\nsteps = "ten"\ndeterministic = 1\nmax_norm = true\n[activation_checkpoint]\nmode = "ful"\n'
    )
    found = problems(["--config", str(toml)])
    assert [p.split(":")[0] for p in found] == [
        "training.steps", "training.deterministic", "training.max_norm", "activation_checkpoint.mode",
    ]  # fmt: skip
    assert "expected int, got 'ten'" in found[0]
    assert "'none' | 'full' | 'selective'" in found[3]
    assert "expected int" in problems(["--training.steps=1.5"])[0]
    assert "expected bool" in problems(["--compile.enable=maybe"])[0]


def test_cross_field_checks_report_all_problems_together() -> None:
    found = problems(
        ["--training.steps=0", "--optimizer.lr=-1", "--lr_scheduler.min_lr_factor=2", "--training.seq_len=4096"]
    )
    keys = {p.split(":")[0] for p in found}
    assert {"training.steps", "optimizer.lr", "lr_scheduler.min_lr_factor", "training.seq_len"} <= keys
    assert any("exceeds the 2048 tokens debugmodel supports" in p for p in found)


def test_missing_files_are_named() -> None:
    found = problems(["--data.path=nope.jsonl", "--model.tokenizer_path=nope/", "--checkpoint.initial_load_path=nope"])
    assert [p.split(":")[0] for p in found] == ["data.path", "model.tokenizer_path", "checkpoint.initial_load_path"]
    assert "file missing.toml not found" in problems(["--config", "missing.toml"])[0]


def test_unexpected_arguments() -> None:
    assert "unexpected argument" in problems(["steps=3"])[0]
