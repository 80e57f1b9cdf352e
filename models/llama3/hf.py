"""Hugging Face Llama folders in and out: `from_hf`, `to_hf`, and the pieces they share.

A Hugging Face Llama folder is `config.json` plus `model.safetensors` or sharded
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json` (the tokenizer files
next to them are read by data.py, not here). Weight names map one to one:

    model.embed_tokens.weight                 tok_embeddings.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj layers.{i}.attention.w{q,k,v,o}
    model.layers.{i}.mlp.gate_proj            layers.{i}.feed_forward.w1
    model.layers.{i}.mlp.down_proj            layers.{i}.feed_forward.w2
    model.layers.{i}.mlp.up_proj              layers.{i}.feed_forward.w3
    model.layers.{i}.input_layernorm          layers.{i}.attention_norm
    model.layers.{i}.post_attention_layernorm layers.{i}.ffn_norm
    model.norm.weight                         norm.weight
    lm_head.weight                            output.weight (absent when embeddings are tied)

RoPE layout: Meta's original checkpoints (and torchtitan's model) rotate interleaved pairs
(x0, x1), (x2, x3), ... of each head, so converting them to HF permutes the rows of q_proj and
k_proj. Our model uses HF's "rotate half" layout, pairing x_i with x_{i + head_dim/2}, so HF
q_proj/k_proj are our wq/wk as they are: no permutation in either direction.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from errors import ConfigError
from models.llama3.model import FLAVORS, ModelArgs, RopeScaling, Transformer, rope_cos_sin

_TOP_LEVEL = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_PER_LAYER = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
# Written by old transformers versions: the RoPE table, which we derive from the config.
_IGNORED_SUFFIX = ".self_attn.rotary_emb.inv_freq"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # what transformers' save_pretrained uses
# Where each published flavor's weights and tokenizer live on the Hugging Face hub (gated: accept the license first).
PUBLISHED = {
    "llama3_1b": "meta-llama/Llama-3.2-1B",
    "llama3_3b": "meta-llama/Llama-3.2-3B",
    "llama3_8b": "meta-llama/Llama-3.1-8B",
    "llama3_70b": "meta-llama/Llama-3.1-70B",
    "llama3_405b": "meta-llama/Llama-3.1-405B",
}


# ------------------------------------------------------------------------- config


def model_args_from_hf_config(path: str | Path) -> ModelArgs:
    """ModelArgs from a Hugging Face Llama folder's config.json (or the file itself).

    Every field that changes the function is mapped; one the model cannot represent is
    refused, all such fields reported together as one ConfigError.
    """
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ConfigError(
            f"{path}: no config.json found; point at a Hugging Face Llama folder (config.json + *.safetensors)"
        )
    try:
        cfg: dict[str, Any] = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None

    problems: list[str] = []

    def refuse(key: str, why: str) -> None:
        problems.append(f"{file}: {key} = {cfg.get(key)!r} {why}")

    if cfg.get("model_type", "llama") != "llama":
        refuse("model_type", "is not a Llama model; only model_type 'llama' (LlamaForCausalLM) converts")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            refuse(key, "must be a positive integer")
    if problems:  # the checks below need the shape
        raise ConfigError(*problems)

    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    n_kv_heads = cfg.get("num_key_value_heads") or n_heads  # HF's default: multi-head attention
    if dim % n_heads:
        refuse("hidden_size", f"is not divisible by num_attention_heads = {n_heads}")
    if n_heads % n_kv_heads:
        refuse("num_key_value_heads", f"does not divide num_attention_heads = {n_heads}")
    if cfg.get("head_dim") not in (None, dim // n_heads):
        refuse("head_dim", f"differs from hidden_size / num_attention_heads = {dim // n_heads}; the model derives it")
    if cfg.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "is not supported; the model's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            refuse(key, "is not supported; the model's projections have no bias")
    if cfg.get("attention_dropout", 0.0):
        refuse("attention_dropout", "is not supported; the model has no dropout (set it to 0.0)")
    if cfg.get("quantization_config") is not None:
        problems.append(f"{file}: quantization_config is set; convert an unquantized (bf16/fp32) checkpoint")
    # pretraining_tp only splits the matmuls of old transformers code into slices: same function, ignored.

    # transformers < 5 writes rope_theta + rope_scaling, transformers 5 one rope_parameters dict.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = None
    if rope_type == "llama3":
        fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if missing := [f for f in fields if f not in rope]:
            problems.append(f"{file}: {rope_key} of type llama3 lacks {', '.join(missing)}")
        else:
            rope_scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
    elif rope_type != "default":
        problems.append(
            f"{file}: {rope_key}.rope_type = {rope_type!r} is not supported; the model implements "
            "no scaling or Llama 3.1's 'llama3' scaling"
        )
    if problems:
        raise ConfigError(*problems)

    args = ModelArgs(
        dim=dim,
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=cfg["vocab_size"],
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),  # defaults: transformers' LlamaConfig
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    return _with_ffn_width(args, cfg["intermediate_size"])


def _with_ffn_width(args: ModelArgs, width: int) -> ModelArgs:
    """Express the SwiGLU width the way a flavor does when one produces it, so a published
    Llama 3 config maps onto its flavor exactly; otherwise keep the width verbatim."""
    # Flavors of the same width first: 3B's multiplier 1.0 and the debug model's None agree at 3072.
    for flavor in sorted(FLAVORS.values(), key=lambda f: f.dim != args.dim):
        candidate = dataclasses.replace(
            args, multiple_of=flavor.multiple_of, ffn_dim_multiplier=flavor.ffn_dim_multiplier
        )
        if candidate.ffn_hidden_dim == width:
            return candidate
    return dataclasses.replace(args, ffn_hidden_dim_override=width)


def hf_config(
    args: ModelArgs, *, dtype: torch.dtype, bos_token_id: int | None = None, eos_token_id: int | None = None
) -> dict[str, Any]:
    """A config.json for `args`, in the layout published Llama 3.1 folders use (rope_theta +
    rope_scaling), which transformers 4 and 5 and inference stacks all read."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if args.rope_scaling is not None:
        s = args.rope_scaling
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    if bos_token_id is not None:
        config["bos_token_id"] = bos_token_id
    if eos_token_id is not None:
        config["eos_token_id"] = eos_token_id
    return config


# ------------------------------------------------------------------------- names


def hf_to_ours(args: ModelArgs) -> dict[str, str]:
    """HF weight name -> our parameter name, for every weight a model of `args` has."""
    names = {hf: ours for hf, ours in _TOP_LEVEL.items() if not (args.tie_word_embeddings and hf == "lm_head.weight")}
    for i in range(args.n_layers):
        for hf, ours in _PER_LAYER.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"layers.{i}.{ours}.weight"
    return names


def expected_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """Our parameter name -> shape, from a model on the meta device (costs nothing)."""
    with torch.device("meta"):
        return {name: t.shape for name, t in Transformer(args).state_dict().items()}


# ------------------------------------------------------------------------ reading


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    # Top level only: downloaded Llama folders also hold Meta's original/ weights, not read here.
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        hint = (
            " (found pytorch_model*.bin: re-save with save_pretrained, which writes safetensors)"
            if any(folder.glob("pytorch_model*.bin"))
            else ""
        )
        raise ConfigError(f"{folder}: no *.safetensors weights{hint}; point at a Hugging Face Llama folder")
    return files


def check_hf_weights(path: str | Path, args: ModelArgs) -> None:
    """Every weight of a model of `args` is in the folder with its shape, and nothing else is: read
    from the safetensors headers alone. Raises ConfigError naming the first problem."""
    from safetensors import safe_open

    folder = Path(path)
    names, shapes = hf_to_ours(args), expected_shapes(args)
    seen: set[str] = set()
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                if hf_name.endswith(_IGNORED_SUFFIX) or (hf_name == "lm_head.weight" and args.tie_word_embeddings):
                    continue
                if hf_name not in names:
                    raise ConfigError(f"{file}: unexpected weight {hf_name}; is this a Llama model of this size?")
                shape = tuple(f.get_slice(hf_name).get_shape())
                if shape != tuple(shapes[names[hf_name]]):
                    raise ConfigError(
                        f"{file}: {hf_name} has shape {shape}, the model expects {tuple(shapes[names[hf_name]])}; "
                        "check model.flavor"
                    )
                seen.add(hf_name)
    if missing := [name for name in names if name not in seen]:
        raise ConfigError(f"{folder}: {len(missing)} weights missing, e.g. {missing[0]}; is the download complete?")


def read_hf_weights(path: str | Path, args: ModelArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) for every weight of an HF folder, one tensor at a time, checked against
    `args` first (`check_hf_weights`)."""
    from safetensors import safe_open

    check_hf_weights(path, args)
    names = hf_to_ours(args)
    for file in _weight_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                if hf_name in names:
                    yield names[hf_name], f.get_tensor(hf_name)


def from_hf(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[Transformer, ModelArgs]:
    """Our model with the weights of a Hugging Face Llama folder, and its ModelArgs.

    Built on the meta device and filled by assignment, so the weights exist once in memory.
    """
    args = model_args_from_hf_config(path)
    state = {name: tensor.to(device=device, dtype=dtype) for name, tensor in read_hf_weights(path, args)}
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(state, strict=True, assign=True)
    # The RoPE table is a non-persistent buffer derived from args: compute it for real.
    model.rope_cos_sin = rope_cos_sin(args, device=torch.device(device))
    return model, args


# ------------------------------------------------------------------------ writing


def plan_shards(sizes: dict[str, int], *, max_shard_bytes: int) -> list[list[str]]:
    """Group names (in order) into shards of at most max_shard_bytes (a bigger tensor goes alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_hf_folder(
    path: str | Path,
    *,
    config: dict[str, Any],
    shards: list[list[str]],
    load_shard: Callable[[list[str]], dict[str, torch.Tensor]],
) -> None:
    """Write config.json and the weights, one shard in memory at a time.

    `shards` lists HF weight names per file; `load_shard(names)` returns those tensors.
    One shard: model.safetensors. Several: model-0000k-of-0000n.safetensors + index, as
    save_pretrained writes them.
    """
    from safetensors.torch import save_file

    folder = Path(path)
    if any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").exists():
        raise ConfigError(f"{folder}: already holds safetensors weights; write to an empty or new folder")
    folder.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for k, names in enumerate(shards, start=1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: t.detach().contiguous() for name, t in load_shard(names).items()}
        assert list(tensors) == names, "load_shard must return exactly the requested weights"
        save_file(tensors, str(folder / file), metadata={"format": "pt"})  # transformers checks "format"
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def to_hf(
    model: Transformer,
    model_args: ModelArgs,
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write `model` as a Hugging Face Llama folder that AutoModelForCausalLM.from_pretrained
    loads (weights + config.json; copy the tokenizer files next to them yourself).

    `model` is a plain module; for a sharded (FSDP/TP) model save a checkpoint and export it
    with `scripts/convert_hf.py to-hf`. dtype: None keeps the parameters' dtype.
    """
    state = model.state_dict()
    if any(isinstance(t, DTensor) for t in state.values()):
        raise ValueError("to_hf: the model is sharded (DTensor); save a checkpoint and use scripts/convert_hf.py to-hf")
    ours_to_hf = {ours: hf for hf, ours in hf_to_ours(model_args).items()}
    if set(state) != set(ours_to_hf):
        raise ValueError(
            f"to_hf: the model's weights do not match model_args ({sorted(set(state) ^ set(ours_to_hf))[:3]})"
        )
    hf_state = {ours_to_hf[name]: t if dtype is None else t.to(dtype) for name, t in state.items()}
    out_dtype = dtype or next(iter(state.values())).dtype
    sizes = {name: t.numel() * t.element_size() for name, t in hf_state.items()}
    write_hf_folder(
        path,
        config=hf_config(model_args, dtype=out_dtype),
        shards=plan_shards(sizes, max_shard_bytes=max_shard_bytes),
        load_shard=lambda names: {name: hf_state[name] for name in names},
    )
