"""A KV cache in a training forward breaks activation checkpointing (docs/failures.md #2), on CPU.

    python -m benchmarks.metadata --out outputs/bench/metadata.json     # one process, CPU is enough

The small transformers LlamaForCausalLM of benchmarks/hf_llama.py, in training mode with
`config.use_cache=True` (transformers' default), each decoder layer checkpointed from outside:

    non_reentrant   our checkpoint_module (non-reentrant), bypassing apply_ac_hf, which refuses it
    reentrant       torch's checkpoint_wrapper(REENTRANT), what FSDP1-era recipes used (our
                    checkpoint_module cannot be reentrant on an HF layer: reentrant checkpoint
                    takes no keyword arguments, and HF layers get all but hidden_states by keyword)
    hf_workaround   HF's own gradient_checkpointing_enable(use_reentrant=True) instead, the
                    workaround of the reports: it turns the cache off, so it trains correctly, but
                    adding the outer per-block AC on top is docs/failures.md #1
    fix             use_cache=False and apply_ac_hf (benchmarks/hf_llama.py), non-reentrant

Gradients are compared with the same model without any AC and use_cache=False (max |diff| and
||diff|| / ||ref|| over all parameters). Also: our models.llama3 Transformer, which has no cache,
with and without apply_ac.

What transformers 5.23 does here (read from its source, and measured below). As in 4.x, the model
creates a DynamicCache whenever use_cache is on, also in training: only HF's own checkpointing
turns it off (4.x: in LlamaModel.forward; 5.x: GradientCheckpointingLayer drops use_cache and
past_key_values per layer). So under a checkpoint applied from outside, the recomputation runs the
layer with the cache already filled: DynamicLayer.update concatenates again and the keys/values
are twice as long (seq_len 256 -> 512). What that does depends on the attention function, so each
case runs with three:

    sdpa        transformers' default. transformers 5.x's sdpa_attention_forward slices key/value to
                the first q_length positions when there is no mask and kv_length > q_length (a
                prefill shortcut meant for static caches). That silently drops the recomputed keys
                and attends to the stale ones from the forward, which are equal in value: under
                non-reentrant AC no error and exact gradients, but the cache ends the step holding
                2 x seq_len tokens. Under reentrant AC the stale keys were made under no_grad:
                k_proj and v_proj get no gradient at all (zeros), and the step goes on silently.
    eager       the causal mask was built for 256 keys; adding it to 256 x 512 scores raises a
                RuntimeError (size mismatch) inside the recomputation, reentrant or not.
    fa2_semantics_cpu
                flash_attention_2's semantics: no mask, causal aligned to the bottom-right, so more
                keys than queries is accepted. The reports' shapes, e.g. [1, 1024, 8, 128] as
                (batch, seq, kv_heads, head_dim), are flash-attention's layout, so they most likely
                ran flash_attention_2 on their A100s; flash-attn needs CUDA, so the same semantics
                are registered here through transformers' public AttentionInterface (sdpa with an
                explicit bottom-right causal mask). The recomputation runs through with 512 keys,
                and non-reentrant checkpointing's metadata check raises the reported
                torch.utils.checkpoint.CheckpointError (saved [4, 4, 256, 32], recomputed
                [4, 4, 512, 32]); reentrant trains on wrong attention (each query also sees the
                whole stale cache, future tokens included).

transformers 4.x's LlamaSdpaAttention (4.38 read) had no such slicing: it passed all cached keys
to sdpa with a mask sliced from a max_position_embeddings-sized buffer, so there the default sdpa
path also ran through to the CheckpointError. That is read from the source, not run here.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import AttentionInterface, LlamaForCausalLM

from benchmarks import harness
from benchmarks.harness import Row
from benchmarks.hf_llama import (
    HFShape,
    add_shape_args,
    apply_ac_hf,
    build_hf_llama,
    enable_hf_gradient_checkpointing,
    grads,
    max_abs_diff,
    quiet_transformers,
    random_batch,
    refusal,
    rel_norm_error,
    shape_from_args,
    wrap_layers_fsdp1_style,
)
from config import ActivationCheckpoint
from models.llama3 import ModelArgs, Transformer
from parallelisms.ac import apply_ac, checkpoint_module

PROBLEM = "#2 KV cache + AC"
ATTENTION: dict[str, str] = {
    "sdpa": "transformers' default",
    "eager": "matmul + mask + softmax",
    "fa2_semantics_cpu": "flash_attention_2 semantics on CPU",
}


@dataclass(frozen=True)
class Setup:
    use_cache: bool  # config.use_cache
    checkpointing: str  # how the layers are checkpointed: see build()
    description: str


SETUPS: dict[str, Setup] = {
    "non_reentrant": Setup(True, "checkpoint_module", "use_cache + checkpoint_module per layer"),
    "reentrant": Setup(True, "checkpoint_wrapper_reentrant", "use_cache + checkpoint_wrapper(REENTRANT)"),
    "hf_workaround": Setup(True, "hf_reentrant", "use_cache + HF reentrant GC only"),
    "fix": Setup(False, "apply_ac_hf", "use_cache=False + apply_ac_hf"),
}


# ------------------------------------------------------------------ attention


def flash2_semantics_attention(
    module: nn.Module,
    query: torch.Tensor,  # (bs, n_heads, q_len, head_dim)
    key: torch.Tensor,  # (bs, n_kv_heads, kv_len, head_dim)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """What flash_attn_func(causal=True) (flash-attn >= 2.1) computes, on any device.

    No padding mask; query i attends to keys 0 .. i + kv_len - q_len (causal aligned to the
    bottom-right), so a key/value longer than the query is accepted rather than refused.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=causal, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # (bs, n_heads, q_len, head_dim)
    return out.transpose(1, 2).contiguous(), None  # HF attention functions return (bs, q_len, ...)


def register_attention() -> None:
    """Make attn_implementation="fa2_semantics_cpu" available (transformers' public extension point)."""
    AttentionInterface.register("fa2_semantics_cpu", flash2_semantics_attention)


# ------------------------------------------------------------------- one case


def build(shape: HFShape, attention: str, *, use_cache: bool, checkpointing: str, seed: int = 0) -> LlamaForCausalLM:
    """The HF model with `attention`, config.use_cache and the `checkpointing` of a Setup (or "none")."""
    model = build_hf_llama(shape, use_cache=use_cache, attn_implementation=attention, seed=seed)
    match checkpointing:
        case "none":
            pass
        case "checkpoint_module":
            for layer in model.model.layers:
                checkpoint_module(layer)  # apply_ac_hf refuses this model: see kv_cache_refusal()
        case "checkpoint_wrapper_reentrant":
            wrap_layers_fsdp1_style(model, reentrant=True)
        case "hf_reentrant":
            enable_hf_gradient_checkpointing(model, use_reentrant=True)
        case "apply_ac_hf":
            apply_ac_hf(model)
        case _:
            raise ValueError(f"unknown checkpointing {checkpointing!r}")
    return model


_SHAPE = re.compile(r"(saved|recomputed) metadata: \{'shape': torch\.Size\((\[[^\]]*\])\)")


def describe_error(e: BaseException) -> dict[str, Any]:
    """Type, first line and, for a CheckpointError, the saved and recomputed shapes it lists."""
    message = str(e)
    shapes = [json.loads(s) for _, s in _SHAPE.findall(message)]
    return {
        "type": f"{type(e).__module__}.{type(e).__qualname__}".removeprefix("builtins."),
        "first_line": message.splitlines()[0] if message else "",
        "shapes": [{"saved": s, "recomputed": r} for s, r in zip(shapes[::2], shapes[1::2], strict=False)],
    }


def run_case(model: LlamaForCausalLM, tokens: torch.Tensor, ref: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """One training step; the error it raises, or its gradients compared with `ref`."""
    model.zero_grad(set_to_none=True)
    out: dict[str, Any] = {"error": None}
    result = None
    try:
        result = model(input_ids=tokens, labels=tokens)
        result.loss.backward()
    except Exception as e:  # the failure under study; any other kind is recorded the same way
        out["error"] = describe_error(e)
    cache = getattr(result, "past_key_values", None)
    # The most tokens a layer's cache holds after the step: seq_len if only the forward wrote to
    # it, 2 x seq_len once a recomputation appended again (backward reaches the last layer first).
    layers = len(model.model.layers)
    out["cached_tokens"] = max(cache.get_seq_length(i) for i in range(layers)) if cache is not None else 0
    if out["error"] is None and ref is not None:
        got = grads(model)
        out["max_abs_grad_diff"] = max_abs_diff(got, ref)
        out["rel_grad_norm_error"] = rel_norm_error(got, ref)
        out["params_without_grad"] = sorted(k for k in ref if not got[k].any() and ref[k].any())
    return out


def kv_cache_refusal(shape: HFShape) -> str | None:
    """apply_ac_hf on a model with use_cache=True must refuse."""
    model = build(shape, "sdpa", use_cache=True, checkpointing="none")
    return refusal(lambda: apply_ac_hf(model))


# ------------------------------------------------------------- our Transformer


def own_transformer_case(shape: HFShape, tokens: torch.Tensor) -> dict[str, Any]:
    """models.llama3.Transformer, no AC vs apply_ac(full): no cache, so the same gradients."""
    args = ModelArgs(
        dim=shape.hidden_size,
        n_layers=shape.num_hidden_layers,
        n_heads=shape.num_attention_heads,
        n_kv_heads=shape.num_key_value_heads,
        vocab_size=shape.vocab_size,
        hidden_dim_override=shape.intermediate_size,
        max_seq_len=shape.seq_len,
    )
    torch.manual_seed(0)
    base = Transformer(args)
    base.init_weights()
    buffers_before = {k: v.clone() for k, v in base.named_buffers()}

    def step(model: Transformer) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logits = model(tokens)  # (bs, seqlen, vocab)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
        return grads(model)

    ref = step(base)
    checkpointed = copy.deepcopy(base)
    apply_ac(checkpointed, ActivationCheckpoint(mode="full"))
    got = step(checkpointed)
    buffers_after = dict(checkpointed.named_buffers())
    return {
        "max_abs_grad_diff": max_abs_diff(got, ref),
        "rel_grad_norm_error": rel_norm_error(got, ref),
        # forward(tokens) takes no cache and its only buffer (the RoPE table) is read, never written.
        "buffers_unchanged_by_step": all(torch.equal(buffers_after[k], v) for k, v in buffers_before.items()),
    }


# ------------------------------------------------------------------ measuring


def measure(shape: HFShape, *, attentions: list[str] | None = None) -> dict[str, Any]:
    """Every case of the module docstring; one process."""
    register_attention()
    tokens = random_batch(shape)
    results: dict[str, Any] = {
        "model": asdict(shape),
        "dtype": "float32",
        "transformers": transformers.__version__,
        "attention": {},
    }
    for attention in attentions or list(ATTENTION):
        reference = build(shape, attention, use_cache=False, checkpointing="none")
        run_case(reference, tokens, None)
        ref = grads(reference)
        row: dict[str, Any] = {"description": ATTENTION[attention]}
        for name, setup in SETUPS.items():
            model = build(shape, attention, use_cache=setup.use_cache, checkpointing=setup.checkpointing)
            row[name] = {"setup": setup.description} | run_case(model, tokens, ref)
        # The cache on its own, without AC, does not change the gradients: only the recomputation does.
        model = build(shape, attention, use_cache=True, checkpointing="none")
        row["no_ac_with_cache"] = run_case(model, tokens, ref)
        results["attention"][attention] = row
    results["refusal"] = kv_cache_refusal(shape)
    results["own_transformer"] = own_transformer_case(shape, tokens)
    return results


# ------------------------------------------------------------------- reporting


def rows(results: dict[str, Any]) -> list[Row]:
    """The headline is the silent one: reentrant AC trains on wrong gradients (sdpa, the default)."""
    sdpa, fa2 = results["attention"]["sdpa"], results["attention"]["fa2_semantics_cpu"]
    row = functools.partial(Row, problem=PROBLEM, fixed="no cache + AC")
    return [
        row(metric="relative gradient error vs no AC (sdpa)", unit="", broken="cache + reentrant AC",
            broken_value=sdpa["reentrant"]["rel_grad_norm_error"], fixed_value=sdpa["fix"]["rel_grad_norm_error"]),
        row(metric="backward raises CheckpointError, 1 = yes (FA2 semantics)", unit="", broken="cache + AC",
            broken_value=float(fa2["non_reentrant"]["error"] is not None),
            fixed_value=float(fa2["fix"]["error"] is not None)),
        row(metric="KV tokens cached per layer after a step (sdpa)", unit="tokens", broken="cache + AC",
            broken_value=sdpa["non_reentrant"]["cached_tokens"], fixed_value=sdpa["fix"]["cached_tokens"]),
    ]  # fmt: skip


def _cell(case: dict[str, Any]) -> str:
    if case["error"] is not None:
        return case["error"]["type"].rsplit(".", 1)[-1]
    return f"rel {case['rel_grad_norm_error']:.1e}"


def table(results: dict[str, Any]) -> str:
    head = f"{'attention':<18} " + " ".join(f"{s:>17}" for s in SETUPS) + f" {'max cached tokens':>17}"
    lines = [
        "one training step, use_cache=True unless fixed; gradients vs no AC (rel = ||diff|| / ||ref||); "
        f"seq_len {results['model']['seq_len']}",
        head,
        "-" * len(head),
    ]
    for attention, row in results["attention"].items():
        cells = " ".join(f"{_cell(row[s]):>17}" for s in SETUPS)
        lines.append(f"{attention:<18} {cells} {row['non_reentrant']['cached_tokens']:>17}")
    for attention, row in results["attention"].items():
        for setup in ("non_reentrant", "reentrant"):
            case = row[setup]
            if case["error"] is not None:
                shapes = "; ".join(f"{s['saved']} vs {s['recomputed']}" for s in case["error"]["shapes"][:3])
                lines.append(f"{attention} {setup}: {case['error']['type']}: {case['error']['first_line']}")
                if shapes:
                    lines.append(f"    saved vs recomputed shapes: {shapes}")
            elif case.get("params_without_grad"):
                lines.append(
                    f"{attention} {setup}: max |dgrad| {case['max_abs_grad_diff']:.3g}; "
                    f"{len(case['params_without_grad'])} parameters get zero gradient, e.g. {case['params_without_grad'][0]}"
                )
    own = results["own_transformer"]
    lines.append(
        f"models.llama3 Transformer (no cache) + apply_ac(full): max |dgrad| {own['max_abs_grad_diff']:.2e}, "
        f"buffers unchanged by the step: {own['buffers_unchanged_by_step']}"
    )
    lines.append(f"apply_ac_hf refuses use_cache=True: {results['refusal']}")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention", nargs="+", choices=list(ATTENTION), default=list(ATTENTION))
    add_shape_args(p)


def measure_args(args: argparse.Namespace) -> dict[str, Any]:
    with quiet_transformers():
        return measure(shape_from_args(args), attentions=args.attention)


def main(argv: list[str] | None = None) -> int:
    return harness.main("metadata", argv, doc=__doc__, add_args=add_args, measure=measure_args, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
