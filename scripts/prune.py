"""Prune a checkpoint into a smaller model of the same family: a student to distill from its teacher.

    # depth: keep blocks 0, 2, 4 and 5 (in this order); width: keep the 512 FFN channels and 8 query heads with the
    # largest weight norms
    python scripts/prune.py --from outputs/run/checkpoint/step-1000 --to student --layers 0,2,4,5 --ffn-dim 512
    python scripts/prune.py --from HF_FOLDER --to student --heads 8 --dtype float32

    # train the student from it: the folder carries its own shape
    python train.py --config ... --model.hf_assets_path=student --model.shape_from_hf_config=true \\
        --checkpoint.initial_load_path=student --checkpoint.initial_load_in_hf=true

--from is a DCP step folder written by train.py (the run's config.toml beside it names the model) or a Hugging
Face folder (config.json + safetensors); --to is a new Hugging Face folder of the same family: config.json with the
pruned shape, model.safetensors, and the tokenizer files of the source (the HF folder's own, or the run's
model.tokenizer_path when it is a folder). `scripts/convert_hf.py to-dcp` turns it into a DCP checkpoint if wanted.

Importance is read from the weights alone, no calibration data:
  * an FFN channel j (SwiGLU: w2(silu(w1 x) * w3 x)) scores the L2 norm of every weight that touches it, row j of w1
    and of w3 and column j of w2 together: sqrt(|w1[j]|^2 + |w3[j]|^2 + |w2[:, j]|^2), per block;
  * a query head scores the L2 norm of its head_dim rows of wq and head_dim columns of wo together, per block. Every
    key/value head is kept, and each keeps the same number of its own query heads (those of the largest scores), so
    grouped-query attention stays valid: --heads must be a multiple of the key/value heads. A per-head QK-norm
    (Qwen3's, over head_dim) is kept whole; one over the whole projection (OLMo 2's) keeps the kept heads' entries.
Depth works for every family (a mixture of experts' blocks too); width only for the dense ones, and head pruning
only where the family's head_dim is its own field (Qwen3, OLMo 2): Llama 3 derives head_dim = dim / n_heads.

One process on CPU, the model in float32 once in memory. Nothing half-written: the folder is written beside --to
and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

# Runnable without installing the repo: its root holds config/ and models/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint import HF_SIDE_FILES  # noqa: E402
from errors import ConfigError, report  # noqa: E402
from models import ModelFamily, family  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------------------------------------ importance


def ffn_scores(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """(hidden,): each SwiGLU channel's L2 norm over row j of w1 and w3 (hidden, dim) and column j of w2 (dim,
    hidden), the weights that carry it in and out."""
    return (w1.float().pow(2).sum(1) + w3.float().pow(2).sum(1) + w2.float().pow(2).sum(0)).sqrt()


def head_scores(wq: torch.Tensor, wo: torch.Tensor, *, n_heads: int) -> torch.Tensor:
    """(n_heads,): each query head's L2 norm over its rows of wq (n_heads * head_dim, dim) and its columns of wo
    (dim, n_heads * head_dim)."""
    q = wq.float().pow(2).reshape(n_heads, -1).sum(1)
    o = wo.float().pow(2).reshape(wo.shape[0], n_heads, -1).sum((0, 2))
    return (q + o).sqrt()


def top_channels(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The indices of the `keep` largest scores, in their original order (ties: the lower index)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:keep].sort().values


def top_heads(scores: torch.Tensor, *, kv_heads: int, keep: int) -> torch.Tensor:
    """The kept query heads, in order: keep / kv_heads of each key/value head's own group (query heads
    g * group .. (g + 1) * group - 1 share key/value head g, as the attention repeats them), its largest scores."""
    group, per_group = len(scores) // kv_heads, keep // kv_heads
    kept = [g * group + top_channels(scores[g * group : (g + 1) * group], per_group) for g in range(kv_heads)]
    return torch.cat(kept)


# ------------------------------------------------------------------------------------------------ the plan


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to keep: blocks (old indices, in order), and the FFN width and query heads of every kept block (None:
    all)."""

    layers: list[int]
    ffn_dim: int | None
    heads: int | None


def parse_plan(opts: argparse.Namespace, fam: ModelFamily, args: Any) -> Plan:
    """The options checked against the source's shape; every problem in one ConfigError, each naming its flag."""
    problems: list[str] = []
    layers = list(range(args.n_layers))
    if opts.layers is not None:
        try:
            layers = [int(part) for part in opts.layers.split(",")]
        except ValueError:
            layers = []
        bad = not layers or any(not 0 <= i < args.n_layers for i in layers) or len(set(layers)) != len(layers)
        if bad:
            problems.append(
                f"--layers: {opts.layers!r} is not a comma-separated list of distinct block indices, each in "
                f"0..{args.n_layers - 1} (the source has {args.n_layers} blocks); e.g. --layers 0,{args.n_layers - 1}"
            )
    dense = fam.num_experts(args) == 0
    if not dense and (opts.ffn_dim is not None or opts.heads is not None):
        problems.append(
            f"{'--ffn-dim' if opts.ffn_dim is not None else '--heads'}: {fam.name} is a mixture of experts, which this script prunes in depth only; "
            "leave --ffn-dim and --heads out and prune with --layers"
        )
    elif opts.ffn_dim is not None:
        width = shape(fam, args)["intermediate_size"]
        if not 0 < opts.ffn_dim <= width:
            problems.append(f"--ffn-dim: {opts.ffn_dim} is not in 1..{width} (the source's FFN width); choose one")
    if dense and opts.heads is not None:
        n_heads, kv = args.n_heads, args.kv_heads
        if "head_dim" not in {f.name for f in dataclasses.fields(args)}:
            problems.append(
                f"--heads: {fam.name} derives head_dim = dim / n_heads, so fewer heads would change every head's "
                "width; leave --heads out (prune with --layers and --ffn-dim)"
            )
        elif not (0 < opts.heads <= n_heads and opts.heads % kv == 0):
            problems.append(
                f"--heads: {opts.heads} is not a multiple of the {kv} key/value heads up to {n_heads} (the source's "
                f"query heads), which grouped-query attention needs; choose one, e.g. {max(kv, n_heads // 2 // kv * kv)}"
            )
    if problems:
        raise ConfigError(*problems)
    return Plan(layers=layers, ffn_dim=opts.ffn_dim, heads=opts.heads)


def shape(fam: ModelFamily, args: Any) -> dict[str, Any]:
    """The family's config.json of `args`: the shape in names every family shares (num_hidden_layers,
    intermediate_size, num_attention_heads, head_dim)."""
    return fam.hf.hf_config(args, dtype=torch.float32)


def pruned_args(fam: ModelFamily, args: Any, plan: Plan) -> Any:
    """The student's ModelArgs: the source's config.json with the pruned shape, read back as the family reads any
    Hugging Face config (so the width is expressed as a flavor would, where one does)."""
    config = shape(fam, args) | {"num_hidden_layers": len(plan.layers)}
    if plan.ffn_dim is not None:
        config["intermediate_size"] = plan.ffn_dim
    if plan.heads is not None:
        config |= {"num_attention_heads": plan.heads, "head_dim": args.head_dim}
    student = fam.hf.model_args_from_hf_config(config, source="the pruned shape")
    # What config.json does not hold (the run's mask type, a mixture's balancing) stays the source's.
    carried = {f: getattr(args, f) for f in ("attn_mask_type", "balance") if hasattr(args, f)}
    return dataclasses.replace(student, **carried)


@torch.no_grad()
def prune_state(state: dict[str, torch.Tensor], args: Any, plan: Plan) -> dict[str, torch.Tensor]:
    """The student's weights (our names): the kept blocks renumbered 0, 1, ... in `plan.layers`' order, each cut to
    its most important FFN channels and query heads; the embedding, final norm and output as they are."""
    out = {name: t for name, t in state.items() if not name.startswith("layers.")}
    for new, old in enumerate(plan.layers):
        block = {
            name.removeprefix(f"layers.{old}."): t for name, t in state.items() if name.startswith(f"layers.{old}.")
        }
        if plan.ffn_dim is not None:
            w1, w2, w3 = (block[f"feed_forward.w{i}.weight"] for i in (1, 2, 3))
            keep = top_channels(ffn_scores(w1, w2, w3), plan.ffn_dim)
            block |= {
                "feed_forward.w1.weight": w1[keep],
                "feed_forward.w2.weight": w2[:, keep],
                "feed_forward.w3.weight": w3[keep],
            }
        if plan.heads is not None:
            wq, wo = block["attention.wq.weight"], block["attention.wo.weight"]
            heads = top_heads(head_scores(wq, wo, n_heads=args.n_heads), kv_heads=args.kv_heads, keep=plan.heads)
            rows = (heads[:, None] * args.head_dim + torch.arange(args.head_dim)).flatten()
            block |= {"attention.wq.weight": wq[rows], "attention.wo.weight": wo[:, rows]}
            for name, t in block.items():  # a QK-norm over the whole query projection has one entry per row of wq
                if name.startswith("attention.q_norm") and t.shape == (args.n_heads * args.head_dim,):
                    block[name] = t[rows]
        out |= {f"layers.{new}.{name}": t.contiguous() for name, t in block.items()}
    return out


# ------------------------------------------------------------------------------------------------ in and out


def source_shape(path: Path) -> tuple[ModelFamily, Any]:
    """The source's family and ModelArgs, read before its weights: a mistake in the options costs no loading."""
    if not path.is_dir():
        raise ConfigError(f"--from: {path} is not a folder; point it at a DCP step folder or a Hugging Face folder")
    if (path / "config.json").is_file():
        from models.hf import family_of_hf_config, model_args_from_hf

        fam = family_of_hf_config(path)
        return fam, model_args_from_hf(fam, path)
    from checkpoint import refuse_folder_of_steps
    from checkpoint.folder import is_checkpoint
    from config import load_config, model_args

    refuse_folder_of_steps(path, key="--from")  # a run folder or its checkpoint folder, not a step
    if not is_checkpoint(path) or not (path.parent / "config.toml").is_file():
        raise ConfigError(
            f"--from: {path} is no Hugging Face folder (config.json) nor a run's step folder (.metadata, config.toml "
            "beside it); point it at one"
        )
    cfg = load_config(["--config", str(path.parent / "config.toml")])
    return family(cfg.model.name), model_args(cfg.model)


def read_source(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], Path | None]:
    """The source's weights (float32, our names), the token ids its config.json names, and the folder whose tokenizer
    files go with it (None: none)."""
    from inference import load_model

    model, tokenizer_path = load_model(path, config=None, device=torch.device("cpu"), dtype=torch.float32)
    token_ids: dict[str, Any] = {}
    if (path / "config.json").is_file():
        from models.hf import read_hf_config

        config = read_hf_config(path)[0]
        token_ids = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
    tokenizer = Path(tokenizer_path) if tokenizer_path is not None and Path(tokenizer_path).is_dir() else None
    return model.state_dict(), token_ids, tokenizer


def write_student(
    out: Path,
    fam: ModelFamily,
    args: Any,
    state: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    token_ids: dict[str, Any],
    tokenizer: Path | None,
) -> list[str]:
    """Write the student as a Hugging Face folder at `out`, whole or not at all: built in a folder beside it, renamed
    into place. Returns the tokenizer files copied."""
    from models.hf import to_hf

    with torch.device("meta"):
        model = fam.model_cls(args)
    model.load_state_dict(state, strict=True, assign=True)  # the pruned shapes are the student's, every one
    partial = out.with_name(f".{out.name}.partial")  # a failed run's leftover is ours to replace
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        to_hf(model, fam, args, partial, dtype=dtype)
        config = json.loads((partial / "config.json").read_text()) | token_ids
        (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copied = [name for name in HF_SIDE_FILES if tokenizer is not None and (tokenizer / name).is_file()]
        for name in copied:
            shutil.copy2(tokenizer / name, partial / name)
        os.replace(partial, out)  # (an empty folder at `out` is replaced too)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return copied


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path, required=True, help="DCP step folder or HF folder")
    parser.add_argument("--to", dest="out", type=Path, required=True, help="Hugging Face folder to create")
    parser.add_argument("--layers", help="blocks to keep, in order, e.g. 0,2,4,5 (default: all)")
    parser.add_argument("--ffn-dim", type=int, help="FFN channels to keep per block, largest weight norm first")
    parser.add_argument("--heads", type=int, help="query heads to keep per block (a multiple of the key/value heads)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype to write (default bfloat16)")
    opts = parser.parse_args(argv)
    # One process by design: DCP's "assuming the intent is to save/load in a single process" is right.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

    out = opts.out
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ConfigError(f"--to: {out} already exists; choose a new folder (or remove it)")
    if not out.parent.is_dir():
        raise ConfigError(f"--to: {out.parent} does not exist; create it or choose another folder")
    fam, args = source_shape(opts.source)
    plan = parse_plan(opts, fam, args)
    state, token_ids, tokenizer = read_source(opts.source)
    student = pruned_args(fam, args, plan)
    copied = write_student(
        out, fam, student, prune_state(state, args, plan), dtype=DTYPES[opts.dtype], token_ids=token_ids,
        tokenizer=tokenizer,
    )  # fmt: skip
    before, after = fam.num_params(args), fam.num_params(student)
    print(
        f"wrote {out}: {fam.name}, {len(plan.layers)} of {args.n_layers} blocks, {after:,} of {before:,} parameters; "
        f"copied {', '.join(copied) or 'no tokenizer files'}"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as e:
        sys.exit(report(e))
