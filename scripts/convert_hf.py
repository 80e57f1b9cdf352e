"""Convert between Hugging Face folders (Llama, Qwen3) and this repo's DCP checkpoints.

    # HF folder -> a weights-only DCP checkpoint (like a seed checkpoint, step 0)
    python scripts/convert_hf.py to-dcp HF_FOLDER OUT_CHECKPOINT [--dtype keep]
    # start training from it: --checkpoint.initial_load_path=OUT_CHECKPOINT, or name it
    # <dump_folder>/<checkpoint.folder>/step-0 and train.py resumes from it

    # a trained DCP checkpoint (any step, saved on any number of ranks) -> HF folder
    python scripts/convert_hf.py to-hf CHECKPOINT OUT_HF_FOLDER --hf-assets-path HF_FOLDER [--dtype bfloat16]
    python scripts/convert_hf.py to-hf CHECKPOINT OUT_HF_FOLDER --flavor debugmodel --tokenizer-path assets/tokenizer
    python scripts/convert_hf.py to-hf CHECKPOINT OUT_HF_FOLDER --model qwen3 --flavor qwen3_0.6b ...

Both run as one process on CPU. to-dcp holds the weights once in memory (in the output
dtype); to-hf holds one output shard (--max-shard-gb) at a time. The tokenizer files and
generation_config.json of --tokenizer-path (default: --hf-assets-path) are copied next to
the exported weights, so the folder is complete for transformers, vLLM and friends.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

# Runnable without installing the repo: its root holds config/ and models/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint import HF_SIDE_FILES, export_hf_folder  # noqa: E402
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
    to_hf = sub.add_parser("to-hf", help="DCP checkpoint -> HF folder")
    to_hf.add_argument("checkpoint", type=Path, help="a step-<N> checkpoint folder (contains .metadata)")
    to_hf.add_argument("out", type=Path, help="HF folder to write (new or empty)")
    shape = to_hf.add_mutually_exclusive_group(required=True)
    shape.add_argument(
        "--hf-assets-path", type=Path, help="HF folder the model came from: its config.json gives the shape"
    )
    shape.add_argument("--flavor", help="the model.flavor the checkpoint was trained with")
    to_hf.add_argument("--model", choices=NAMES, default="llama3", help="the model.name (family) of --flavor")
    to_hf.add_argument(
        "--tokenizer-path", type=Path, help="folder whose tokenizer files to copy (default: --hf-assets-path)"
    )
    to_hf.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype to write (default bfloat16)")
    to_hf.add_argument("--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 2**30, help="largest file (GiB)")
    opts = parser.parse_args(argv)
    # One process by design: DCP's "assuming the intent is to save/load in a single process" is right.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

    if opts.direction == "to-dcp":
        hf_to_dcp(opts.hf_folder, opts.out, dtype=DTYPES[opts.dtype])
        return 0

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
