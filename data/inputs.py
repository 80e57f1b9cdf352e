"""The input files a run reads and this machine lacks (data, held-out data, tokenizer, Hugging Face folder, initial
checkpoint), each as one line naming the key and how to get the file. train.py refuses to start without them
(load_config's input_checks); --print-config, planning/doctor.py and the dry run plan jobs for machines that have them
and print these as notes."""

from __future__ import annotations

import os
from pathlib import Path

from config import DATASETS, REPO, JobConfig, Model, Validation, script, validation_path
from data.sources import is_hub_name
from models import NAMES, family


def input_problems(cfg: JobConfig) -> list[str]:
    """The input files a run reads and this machine lacks: data, held-out data, tokenizer, Hugging Face
    folder, initial checkpoint. Training refuses to start without them (load_config); --print-config,
    planning/doctor.py and the dry run plan jobs for machines that have them, and print these as notes."""
    m, ck, p = cfg.model, cfg.checkpoint, []
    if m.hf_assets_path is not None and not Path(m.hf_assets_path).is_dir():
        p.append(
            f"model.hf_assets_path: {m.hf_assets_path} not found; point it at a Hugging Face folder (config.json, "
            "tokenizer files, *.safetensors)"
        )
    # A dataset name ("owner/name") may be in the local Hugging Face cache: opening it tells (data/sources.py).
    if cfg.data.path is not None and cfg.data.format != "hub" and not _local_or_named(cfg.data.path):
        p.append(_missing_data(cfg))
    p += [
        f"data.mixture: {path} not found; prepare a corpus into it with `python {script('prepare_data.py')} --source "
        f"SOURCE --tokenizer {m.tokenizer_path or ''} --output {path} --workers N`"
        for path in cfg.data.mixture
        if not _local_or_named(path)
    ]
    p += _missing_validation(cfg.validation)
    tokenizer_missing = m.tokenizer_path != "byte" and not Path(m.tokenizer_path or "").exists()
    if tokenizer_missing and m.tokenizer_path != m.hf_assets_path:  # a missing hf_assets_path is named above
        p.append(_missing_tokenizer(m))
    if ck.initial_load_path is not None and not Path(ck.initial_load_path).is_dir():
        p.append(
            f"checkpoint.initial_load_path: {ck.initial_load_path} is not a folder; point it at a checkpoint step folder (contains .metadata) or a Hugging Face folder (initial_load_in_hf)"
        )
    if cfg.distill.enable and cfg.distill.teacher_path and not Path(cfg.distill.teacher_path).is_dir():
        p.append(
            f"distill.teacher_path: {cfg.distill.teacher_path} is not a folder; point it at a checkpoint step folder "
            "(contains .metadata) or a Hugging Face folder (config.json, *.safetensors)"
        )
    if cfg.lora.enable and cfg.lora.adapter_path and not Path(cfg.lora.adapter_path, "adapter_config.json").is_file():
        p.append(
            f"lora.adapter_path: {cfg.lora.adapter_path} has no adapter_config.json; point it at a PEFT adapter folder "
            "(adapter_config.json, adapter_model.safetensors), or unset it to start the adapters afresh"
        )
    return p


def _missing_validation(v: Validation) -> list[str]:
    if not v.enable:
        return []
    path = validation_path(v)
    if path is None:
        hub = DATASETS.get(v.dataset)
        source = f"--source {hub[0]} --format hub --name {hub[1]} --split {hub[2]}" if hub else "--source SOURCE"
        return [
            f"validation.dataset: {v.dataset!r} is not local; prepare it with `python {script('prepare_data.py')} "
            f"{source} --tokenizer TOKENIZER --output OUT` and set validation.dataset_path = OUT"
        ]
    if not _local_or_named(path):
        return [
            f"validation.dataset_path: {path} not found; point it at a prepared folder or raw json/jsonl/parquet/txt files"
        ]
    return []


def _local_or_named(path: str) -> bool:
    """A local path, or a dataset name ("owner/name") the local Hugging Face cache may hold, which data/sources.py
    looks up when it opens the data. A cheap look, without importing `datasets`: a folder of that owner in the
    datasets cache, or the name's snapshot folder in the hub cache (data/fineweb-edu is a missing local folder)."""
    if Path(path).exists():
        return True
    if not is_hub_name(path):
        return False
    home = Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser()
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser()
    hub_cache = Path(os.environ.get("HF_HUB_CACHE", home / "hub")).expanduser()
    owner, name = path.split("/")
    return (hub_cache / f"datasets--{owner}--{name}").is_dir() or any(datasets_cache.glob(f"{owner}___*"))


def _missing_data(cfg: JobConfig) -> str:
    path = cfg.data.path
    if cfg.training.dataset == "c4_test" and path == DATASETS["c4_test"][0]:
        return (
            f"data.path: {path} not found: training.dataset = 'c4_test' is torchtitan's test corpus, read from "
            "./tests/assets/c4_test in a torchtitan checkout; run from that folder, or set training.dataset_path "
            "(or data.path) to your data"
        )
    if Path(path).suffix:
        return f"data.path: {path} not found; point it at a json/jsonl/parquet/txt file or folder, or a prepared folder"
    if made := _recipe_making(path, flavor=cfg.model.flavor):
        recipe, commands = made
        return f"data.path: {path} not found; {recipe}'s header makes it: " + ", then ".join(f"`{c}`" for c in commands)
    named = ""
    # Or the name of a Hugging Face dataset this machine has no copy of; not when its "owner" is a local folder
    # (data/foo is a prepared corpus not made yet, not the dataset "foo" of the user "data").
    if is_hub_name(path) and not Path(path).parent.is_dir():
        named = (
            f"; if it names a Hugging Face dataset, download it with `hf download {path} --repo-type dataset "
            f"--local-dir data/hf/{path.split('/')[1]}` and set data.path to that folder"
        )
    return (
        f"data.path: {path} not found; prepare a corpus into it with `python {script('prepare_data.py')} --source "
        f"SOURCE --tokenizer {cfg.model.tokenizer_path or ''} --output {path} --workers N` (a recipe's header names "
        f"its SOURCE){named}"
    )


def _recipe_making(path: str, *, flavor: str) -> tuple[str, list[str]] | None:
    """The shipped recipe whose header prepares the corpus `path` (one of `flavor` first: the 8B, 70B and 405B
    recipes share a corpus), and the header's commands that make it: the dataset's download (`hf download ...
    --repo-type dataset`), if there is one, then `prepare_data.py --output path`."""
    found = []
    for toml in sorted((REPO / "configs").rglob("*.toml")):
        text = toml.read_text(encoding="utf-8")
        commands = _header_commands(text)
        prepare = [c for c in commands if "prepare_data.py" in c and f" --output {path} " in f"{c} "]
        if prepare:
            downloads = [c for c in commands if c.startswith("hf download") and "--repo-type dataset" in c]
            other_flavor = f'flavor = "{flavor}"' not in text
            found.append((other_flavor, str(toml.relative_to(REPO)), [*downloads, prepare[0]]))
    return min(found)[1:] if found else None


def _header_commands(text: str) -> list[str]:
    """The commands of a TOML's leading comment: its lines that start with `hf download` or `python`, a line that
    ends with a backslash joined to the next."""
    commands, current = [], ""
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        current = f"{current} {line.lstrip('#').strip()}".strip()
        if current.endswith("\\"):
            current = current[:-1].strip()
            continue
        if current.startswith(("hf download", "python ")):
            commands.append(current)
        current = ""
    return commands


def _missing_tokenizer(m: Model) -> str:
    published = family(m.name).hf.PUBLISHED if m.name in NAMES else {}
    # A folder named after a published repo (assets/hf/Llama-3.1-8B) comes from it; else the flavor's repo.
    folder = Path(m.tokenizer_path or "")
    by_name = [repo for repo in published.values() if repo.split("/")[1] == folder.name]
    repo = by_name[0] if by_name else published.get(m.flavor)
    fetch = f"; download it with `hf download {repo} --include 'tokenizer*' --local-dir {folder}`" if repo else ""
    return f"model.tokenizer_path: {folder} not found{fetch}" + (
        "" if fetch else '; point it at a tokenizer.json or tokenizer folder, or use "byte"'
    )
