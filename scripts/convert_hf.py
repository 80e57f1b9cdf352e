"""Convert between Hugging Face folders (Llama, Qwen3) and this repo's DCP checkpoints.

    # HF folder -> a weights-only DCP checkpoint (like a seed checkpoint, step 0)
    python scripts/convert_hf.py to-dcp HF_FOLDER OUT_CHECKPOINT [--dtype keep]
    # start training from it: --checkpoint.initial_load_path=OUT_CHECKPOINT, or name it
    # <dump_folder>/<checkpoint.folder>/step-0 and train.py resumes from it

    # a trained DCP checkpoint (any step, saved on any number of ranks) -> HF folder
    python scripts/convert_hf.py to-hf CHECKPOINT OUT_HF_FOLDER --hf-assets-path HF_FOLDER [--dtype bfloat16]
    python scripts/convert_hf.py to-hf CHECKPOINT OUT_HF_FOLDER --flavor debugmodel --tokenizer-path assets/tokenizer
    python scripts/convert_hf.py to-hf CHECKPOINT OUT_HF_FOLDER --model qwen3 --flavor qwen3_0.6b ...

    # a LoRA run's step ([lora] enable = true) -> a PEFT adapter folder (adapter_config.json,
    # adapter_model.safetensors) that peft.PeftModel.from_pretrained loads onto the base
    python scripts/convert_hf.py to-peft CHECKPOINT OUT_PEFT_FOLDER [--config TOML] [--base BASE]
    # a LoRA run's step -> the merged model (W + s B A in every targeted linear) as an HF folder
    python scripts/convert_hf.py to-hf CHECKPOINT OUT_HF_FOLDER [--config TOML] [--base BASE]

All run as one process on CPU. to-dcp holds the weights once in memory (in the output
dtype); to-hf holds one output shard (--max-shard-gb) at a time, and the whole base once
for a LoRA step. The tokenizer files and generation_config.json of --tokenizer-path
(default: --hf-assets-path; for a LoRA step, the run's model.hf_assets_path, else its
tokenizer folder) are copied next to the exported weights, so the folder is complete for
transformers, vLLM and friends.

A LoRA step is read by its run's config.toml beside the step folders (--config to name
another): [model] gives the shape, [lora] the adapters' rank, scale and targets, and the
base is checkpoint.initial_load_path (a DCP step or HF folder) or model.hf_assets_path
(--base to name another). Only the adapters are read from the step. Outputs are written
to OUT.partial and renamed to OUT once complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

# Runnable without installing the repo: its root holds config/ and models/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint import HF_SIDE_FILES, MODEL_PREFIX, export_hf_folder, verify  # noqa: E402
from checkpoint.checksums import ChecksumWriter  # noqa: E402
from errors import ConfigError, report  # noqa: E402
from models import NAMES, family  # noqa: E402
from models.hf import DEFAULT_MAX_SHARD_BYTES, family_of_hf_config, model_args_from_hf, read_hf_weights  # noqa: E402

DTYPES = {"keep": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_to_dcp(hf_folder: Path, out: Path, *, dtype: torch.dtype | None) -> None:
    """Write HF weights as a weights-only DCP checkpoint under our parameter names."""
    if out.exists():
        raise ConfigError(f"{out}: already exists; choose a new checkpoint folder")
    fam = family_of_hf_config(hf_folder)
    args = model_args_from_hf(fam, hf_folder)
    state = {name: t if dtype is None else t.to(dtype) for name, t in read_hf_weights(hf_folder, fam, args)}
    # The same layout CheckpointManager writes ({"model_and_optimizer": {"model": ...}}), so
    # train.py's initial_load_path and resume read it, resharding onto any FSDP/TP layout.
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    # One process, no group; every file checksummed as it is written, as train.py's saves are (checkpoint/checksums.py).
    dcp.save({"model_and_optimizer": {"model": state}}, storage_writer=ChecksumWriter(partial))
    os.replace(partial, out)
    print(f"wrote {out}: {len(state)} tensors, {sum(t.numel() for t in state.values()):,} parameters")


def lora_run(checkpoint: Path, config: Path | None) -> tuple[Any, Path]:
    """The [lora] run config of a LoRA step (config.toml beside the step folders, or `config`), and its path."""
    from inference import step_config

    cfg, config = step_config(checkpoint, config)
    if not cfg.lora.enable:
        raise ConfigError(
            f"--config: {config} has no [lora] enable = true, so {checkpoint} is no LoRA run's step; name the LoRA "
            "run's TOML with --config"
        )
    return cfg, config


def holds_adapters(checkpoint: Path) -> bool:
    from lora import is_adapter

    return any(k.startswith(MODEL_PREFIX) and is_adapter(k) for k in verify(checkpoint).state_dict_metadata)


def new_folder(out: Path) -> Path:
    """OUT.partial, emptied, for an output renamed to OUT once complete (nothing half-written is ever at OUT)."""
    if out.exists():
        raise ConfigError(f"{out}: already exists; choose a new folder")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    return partial


def to_peft(checkpoint: Path, out: Path, *, config: Path | None, base: Path | None, dtype: torch.dtype | None) -> None:
    """A LoRA step's adapters as a PEFT adapter folder; base_model_name_or_path names the run's base (or --base)."""
    from config import model_args
    from inference import step_adapters
    from lora import target_names, write_peft_folder

    cfg, _ = lora_run(checkpoint, config)
    adapters = step_adapters(checkpoint, key="CHECKPOINT")
    fam, args = family(cfg.model.name), model_args(cfg.model)
    named = base or cfg.checkpoint.initial_load_path or cfg.model.hf_assets_path
    partial = new_folder(out)
    write_peft_folder(
        partial, adapters, fam=fam, args=args, cfg=cfg.lora, base=str(named) if named else None, dtype=dtype
    )
    os.replace(partial, out)
    print(f"wrote {out}: {len(adapters)} adapter tensors of {', '.join(target_names(fam, args, cfg.lora))}")


def lora_to_hf(
    checkpoint: Path,
    out: Path,
    *,
    config: Path | None,
    base: Path | None,
    dtype: torch.dtype,
    max_shard_bytes: int,
    tokenizer_path: Path | None,
) -> None:
    """A LoRA step merged into its base (W + s B A, in float32), written as an HF folder in `dtype`."""
    from inference import load_model, lora_base
    from models.hf import hf_config, hf_shapes, hf_sources, hf_tensor, plan_shards, write_hf_folder

    cfg, config = lora_run(checkpoint, config)
    base = base or lora_base(cfg, config=config)
    model, _ = load_model(checkpoint, config=config, device=torch.device("cpu"), dtype=torch.float32, base=base)
    fam, args = family(cfg.model.name), model.args
    state = model.state_dict()
    sources = hf_sources(fam, args)
    shapes = hf_shapes(sources, {name: t.shape for name, t in state.items()})
    # The tokenizer files (and token ids) of: --tokenizer-path, the run's HF folder, an HF base, its tokenizer folder.
    side = tokenizer_path or next(
        (Path(p) for p in (cfg.model.hf_assets_path, base, cfg.model.tokenizer_path) if p and Path(p).is_dir()
         and (p != base or (Path(p) / "config.json").is_file())),
        None,
    )  # fmt: skip
    token_ids = {}
    if side is not None and (side / "config.json").is_file():
        source = json.loads((side / "config.json").read_text())
        token_ids = {k: source[k] for k in ("bos_token_id", "eos_token_id") if source.get(k) is not None}
    partial = new_folder(out)
    write_hf_folder(
        partial,
        config=hf_config(fam, args, dtype=dtype, **token_ids),
        shards=plan_shards({h: s.numel() * dtype.itemsize for h, s in shapes.items()}, max_shard_bytes=max_shard_bytes),
        load_shard=lambda names: {h: hf_tensor(state[sources[h][0]], sources[h][1], dtype) for h in names},
    )
    copied = [name for name in HF_SIDE_FILES if side is not None and (side / name).is_file()]
    for name in copied:
        shutil.copy2(side / name, partial / name)
    os.replace(partial, out)
    print(
        f"wrote {out} ({dtype}): the base with the adapters of {checkpoint} merged; copied {', '.join(copied) or 'no tokenizer files'}"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    to_dcp = sub.add_parser("to-dcp", help="HF folder -> weights-only DCP checkpoint")
    to_dcp.add_argument("hf_folder", type=Path, help="Hugging Face folder (config.json + *.safetensors)")
    to_dcp.add_argument("out", type=Path, help="checkpoint folder to create")
    to_dcp.add_argument(
        "--dtype",
        choices=DTYPES,
        default="keep",
        help="dtype to store (default keep: bf16 stays bf16; train.py upcasts into its fp32 parameters exactly)",
    )
    to_hf = sub.add_parser("to-hf", help="DCP checkpoint -> HF folder (a LoRA run's step: the merged model)")
    to_hf.add_argument("checkpoint", type=Path, help="a step-<N> checkpoint folder (contains .metadata)")
    to_hf.add_argument("out", type=Path, help="HF folder to write (new or empty)")
    shape = to_hf.add_mutually_exclusive_group()
    shape.add_argument(
        "--hf-assets-path", type=Path, help="HF folder the model came from: its config.json gives the shape"
    )
    shape.add_argument(
        "--flavor", help="the model.flavor the checkpoint was trained with (neither: a LoRA step, its config's shape)"
    )
    to_hf.add_argument("--model", choices=NAMES, default="llama3", help="the model.name (family) of --flavor")
    to_hf.add_argument(
        "--tokenizer-path", type=Path, help="folder whose tokenizer files to copy (default: --hf-assets-path)"
    )
    to_hf.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype to write (default bfloat16)")
    to_hf.add_argument("--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 2**30, help="largest file (GiB)")
    to_peft_ = sub.add_parser("to-peft", help="a LoRA run's DCP step -> PEFT adapter folder")
    to_peft_.add_argument("checkpoint", type=Path, help="a step-<N> folder of a run with [lora] enable = true")
    to_peft_.add_argument("out", type=Path, help="PEFT adapter folder to create")
    to_peft_.add_argument(
        "--dtype", choices=DTYPES, default="keep", help="dtype of the adapters (default keep: as trained)"
    )
    for command in (to_hf, to_peft_):
        command.add_argument(
            "--config", type=Path, help="a LoRA run's TOML (default: config.toml beside the step folders)"
        )
        command.add_argument("--base", type=Path, help="a LoRA step's base, a DCP step or HF folder (default: the "
                             "config's checkpoint.initial_load_path, else model.hf_assets_path)")  # fmt: skip
    opts = parser.parse_args(argv)
    # One process by design: DCP's "assuming the intent is to save/load in a single process" is right.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

    if opts.direction == "to-dcp":
        hf_to_dcp(opts.hf_folder, opts.out, dtype=DTYPES[opts.dtype])
        return 0
    if opts.direction == "to-peft":
        to_peft(opts.checkpoint, opts.out, config=opts.config, base=opts.base, dtype=DTYPES[opts.dtype])
        return 0
    lora_step = holds_adapters(opts.checkpoint)
    if not lora_step and opts.base is not None:
        raise ConfigError(f"--base: {opts.checkpoint} holds no LoRA adapters, so it has no base; drop --base")
    if lora_step or (opts.config is not None and not (opts.hf_assets_path or opts.flavor)):
        lora_to_hf(
            opts.checkpoint,
            opts.out,
            config=opts.config,
            base=opts.base,
            dtype=DTYPES[opts.dtype] or torch.float32,
            max_shard_bytes=int(opts.max_shard_gb * 2**30),
            tokenizer_path=opts.tokenizer_path or opts.hf_assets_path,
        )
        return 0
    if not (opts.hf_assets_path or opts.flavor):
        raise ConfigError("to-hf: name the model's shape with --hf-assets-path HF_FOLDER or --flavor FLAVOR")

    if opts.hf_assets_path:
        fam = family_of_hf_config(opts.hf_assets_path)
        args = model_args_from_hf(fam, opts.hf_assets_path)
    else:
        fam = family(opts.model)
        if opts.flavor not in fam.flavors:
            raise ConfigError(
                f"--flavor: {opts.flavor!r} is no {fam.name} flavor; choose from {', '.join(fam.flavors)}"
            )
        args = fam.flavors[opts.flavor]
    tokenizer_path = opts.tokenizer_path or opts.hf_assets_path
    if tokenizer_path is not None and not tokenizer_path.is_dir():
        raise ConfigError(f"--tokenizer-path: {tokenizer_path} is not a folder; point it at a tokenizer folder")
    copied = export_hf_folder(
        opts.checkpoint,
        opts.out,
        family=fam,
        args=args,
        dtype=DTYPES[opts.dtype],
        max_shard_bytes=int(opts.max_shard_gb * 2**30),
        side_files_from=opts.hf_assets_path,
    )
    if opts.tokenizer_path is not None:  # another folder's tokenizer files
        copied = [name for name in HF_SIDE_FILES if (opts.tokenizer_path / name).is_file()]
        for name in copied:
            shutil.copy2(opts.tokenizer_path / name, opts.out / name)
    print(
        f"wrote {opts.out} ({DTYPES[opts.dtype] or 'stored dtype'}); copied {', '.join(copied) or 'no tokenizer files'}"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as e:
        sys.exit(report(e))
