"""Nested activation checkpointing runs each layer's forward three times per step (docs/failures.md #1).

    python -m benchmarks.recompute --out outputs/bench/recompute.json     # one process, CPU is enough

The llama-recipes setup (issue #740) on a small transformers LlamaForCausalLM (benchmarks/hf_llama.py:
fp32, "sdpa" attention, transformers' own init, built in code, no download): Hugging Face's own
checkpointing, reentrant as in transformers 4.x, plus a second, per-block checkpoint applied from
outside. Variants:

    nested          HF gradient_checkpointing_enable(use_reentrant=True) + our checkpoint_module
                    (non-reentrant) on every decoder layer; apply_ac_hf refuses this, so it is
                    built by hand. transformers >= 5 checkpoints a layer's `forward`, so here HF's
                    reentrant checkpoint ends up outside ours.
    nested_wrapper  the same HF checkpointing + FSDP-era checkpoint_wrapper(NO_REENTRANT) around
                    each layer, what llama-recipes did; here the non-reentrant level is outside.
    single          HF checkpointing off, benchmarks.hf_llama.apply_ac_hf (one non-reentrant
                    checkpoint per layer, after its guards): the fix
    none            no activation checkpointing

Per training step (forward + loss + backward, no optimizer step, after a warm-up step):
  attention forwards   forward calls of each LlamaAttention, recomputations included
                       (count_calls): 1 none, 2 single, 3 nested in either order.
  backward FLOPs       FlopCounterMode around backward, recomputation included. The fused CPU SDPA
                       kernel (aten._scaled_dot_product_flash_attention_for_cpu) has no FLOP formula
                       in torch.utils.flop_counter, so this step runs under
                       sdpa_kernel(SDPBackend.MATH), whose bmm pieces are counted; the JSON also
                       keeps the default-backend count to show the gap. "recomputed layer forwards"
                       is (backward - backward of none) / forward FLOPs of all decoder layers.
                       Non-reentrant checkpointing stops a recomputation as soon as the last saved
                       tensor is back (torch.utils.checkpoint early stop), before the layer's final
                       matmul (mlp.down_proj) runs: single recomputes 1 layer forward minus that
                       matmul, nested 2 minus it; nested_wrapper exactly 2 (what its outer,
                       non-reentrant level recomputes is HF's reentrant checkpoint, which runs the
                       whole layer before saving anything). With early stop off (also in the JSON)
                       the multiples are exactly 1, 2 and 2.
  step time            median over --steps steps of the default (fused SDPA) backend, the variants
                       interleaved round-robin in one process so that they share the machine's noise.
  gradients            max |grad - grad of none| over all parameters: recomputation is exact.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import re
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import transformers
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

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
    param_name,
    quiet_transformers,
    random_batch,
    refusal,
    shape_from_args,
    wrap_layers_fsdp1_style,
)
from parallelisms.ac import checkpoint_module
from tests.instruments import count_calls

PROBLEM = "#1 nested AC"
VARIANTS: dict[str, str] = {
    "nested": "HF reentrant GC + checkpoint_module per layer",
    "nested_wrapper": "HF reentrant GC + checkpoint_wrapper per layer",
    "single": "apply_ac_hf (one checkpoint per layer)",
    "none": "no AC",
}


def make_variant(name: str, base: LlamaForCausalLM) -> LlamaForCausalLM:
    """A copy of `base` (same weights) with the checkpointing of variant `name`."""
    model = copy.deepcopy(base).train()
    match name:
        case "nested":
            enable_hf_gradient_checkpointing(model, use_reentrant=True)
            for layer in model.model.layers:
                checkpoint_module(layer)  # what apply_ac_hf would refuse: see refusals()
        case "nested_wrapper":
            enable_hf_gradient_checkpointing(model, use_reentrant=True)
            wrap_layers_fsdp1_style(model, reentrant=False)
        case "single":
            apply_ac_hf(model)
        case "none":
            pass
        case _:
            raise ValueError(f"unknown variant {name!r}; expected one of {sorted(VARIANTS)}")
    return model


def refusals(base: LlamaForCausalLM) -> dict[str, str | None]:
    """apply_ac_hf on the two halves of the nested setup: both must be refused."""

    def hf_gc_then_apply_ac() -> None:
        model = copy.deepcopy(base)
        enable_hf_gradient_checkpointing(model, use_reentrant=True)
        apply_ac_hf(model)

    def wrapped_then_apply_ac() -> None:
        model = copy.deepcopy(base)
        wrap_layers_fsdp1_style(model, reentrant=False)
        apply_ac_hf(model)

    return {
        "hf_gradient_checkpointing": refusal(hf_gc_then_apply_ac),
        "checkpoint_wrapper": refusal(wrapped_then_apply_ac),
    }


# ------------------------------------------------------------------ measuring


def forward_backward(model: nn.Module, tokens: torch.Tensor) -> None:
    """Forward + HF's next-token loss + backward; the gradients are left in .grad."""
    model.zero_grad(set_to_none=True)
    model(input_ids=tokens, labels=tokens).loss.backward()


@dataclass
class Counted:
    """One counted training step."""

    attention_forwards: dict[str, int]  # LlamaAttention forward calls per layer
    forward_flops: int
    backward_flops: int
    flops_by_module: dict[str, int]  # forward FLOPs by module name (FlopCounterMode's breakdown)


def counted_step(model: nn.Module, tokens: torch.Tensor, *, math_sdpa: bool = True, early_stop: bool = True) -> Counted:
    """One training step under count_calls and FlopCounterMode (forward and backward apart)."""
    backend = sdpa_kernel(SDPBackend.MATH) if math_sdpa else contextlib.nullcontext()
    model.zero_grad(set_to_none=True)
    with backend, set_checkpoint_early_stop(early_stop), count_calls(model, LlamaAttention) as calls:
        with FlopCounterMode(display=False) as fwd:
            loss = model(input_ids=tokens, labels=tokens).loss
        with FlopCounterMode(display=False) as bwd:
            loss.backward()
    by_module = {name: sum(ops.values()) for name, ops in fwd.get_flop_counts().items()}
    return Counted(
        attention_forwards={param_name(k): v for k, v in calls.items()},
        forward_flops=fwd.get_total_flops(),
        backward_flops=bwd.get_total_flops(),
        flops_by_module=by_module,
    )


def layer_flops(counted: Counted, suffix: str = "") -> int:
    """Forward FLOPs of every decoder layer (or of their `suffix` submodule, e.g. ".mlp.down_proj")."""
    # FlopCounterMode names modules from the root class: "LlamaForCausalLM.model.layers.0.mlp".
    pattern = re.compile(r"\.layers\.\d+" + re.escape(suffix) + "$")
    return sum(flops for name, flops in counted.flops_by_module.items() if pattern.search(name))


def measure(shape: HFShape, *, steps: int = 5, variants: list[str] | None = None) -> dict[str, Any]:
    """Every measurement of the module docstring, for each variant; one process, one machine."""
    names = variants or list(VARIANTS)
    base = build_hf_llama(shape)
    tokens = random_batch(shape)
    models = {name: make_variant(name, base) for name in names}

    counted = {name: counted_step(m, tokens) for name, m in models.items()}
    no_early_stop = {name: counted_step(m, tokens, early_stop=False) for name, m in models.items()}
    # Only to show that the default (fused) CPU kernel's FLOPs are not counted.
    fused = counted_step(models[names[-1]], tokens, math_sdpa=False)

    # Gradients and time with the default SDPA backend; one warm-up step each.
    gradients = {}
    for name, m in models.items():
        forward_backward(m, tokens)
        gradients[name] = grads(m)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for step in range(steps):
        # One step of each variant per round, starting one further each round, so that they
        # share the machine's noise and no variant always runs first.
        for name in names[step % len(names) :] + names[: step % len(names)]:
            start = time.perf_counter()
            forward_backward(models[name], tokens)
            seconds[name].append(time.perf_counter() - start)

    ref = counted.get("none")
    layer_fwd = layer_flops(ref) if ref is not None else 0
    results: dict[str, Any] = {
        "model": asdict(shape),
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "variants": {},
    }
    for name in names:
        c = counted[name]
        per_layer = sorted(set(c.attention_forwards.values()))
        row = {
            "description": VARIANTS[name],
            "attention_forwards_per_layer": per_layer[0] if len(per_layer) == 1 else per_layer,
            "attention_forwards": c.attention_forwards,
            "forward_flops": c.forward_flops,
            "backward_flops": c.backward_flops,
            "backward_flops_no_early_stop": no_early_stop[name].backward_flops,
            "step_seconds": seconds[name],
            "step_seconds_median": statistics.median(seconds[name]),
            "step_seconds_min": min(seconds[name]),
        }
        if ref is not None:
            row["recomputed_layer_forwards"] = (c.backward_flops - ref.backward_flops) / layer_fwd
            row["recomputed_layer_forwards_no_early_stop"] = (
                no_early_stop[name].backward_flops - no_early_stop["none"].backward_flops
            ) / layer_fwd
            row["max_abs_grad_diff_vs_none"] = max_abs_diff(gradients[name], gradients["none"])
        results["variants"][name] = row

    v = results["variants"]
    if ref is not None:
        results["layer_forward_flops"] = layer_fwd
        results["last_matmul_flops"] = layer_flops(ref, ".mlp.down_proj")
        # The fused CPU kernel is invisible to FlopCounterMode: the default backend counts fewer FLOPs.
        results["fused_sdpa_counted"] = fused.forward_flops == counted[names[-1]].forward_flops
        results["forward_flops_fused_sdpa"] = fused.forward_flops
    if "nested" in v and "single" in v:
        results["backward_flops_ratio_nested_vs_single"] = v["nested"]["backward_flops"] / v["single"]["backward_flops"]
        results["step_time_ratio_nested_vs_single"] = (
            v["nested"]["step_seconds_median"] / v["single"]["step_seconds_median"]
        )
        # Paired: the two steps of one round ran back to back, under the same load.
        results["step_time_ratio_nested_vs_single_paired"] = statistics.median(
            n / s for n, s in zip(seconds["nested"], seconds["single"], strict=True)
        )
    results["refusals"] = refusals(base)
    return results


# ------------------------------------------------------------------- reporting


def rows(results: dict[str, Any]) -> list[Row]:
    """Nested vs single checkpointing; the headline is the count of attention forwards."""
    nested, single = results["variants"]["nested"], results["variants"]["single"]
    row = functools.partial(Row, problem=PROBLEM, broken="HF GC + per-layer AC", fixed="per-layer AC only")
    return [
        row(metric="attention forwards per layer per step", unit="calls",
            broken_value=nested["attention_forwards_per_layer"], fixed_value=single["attention_forwards_per_layer"]),
        row(metric="backward FLOPs per step, recompute included", unit="GFLOP",
            broken_value=nested["backward_flops"] / 1e9, fixed_value=single["backward_flops"] / 1e9),
        row(metric="step time (CPU fp32, median)", unit="ms",
            broken_value=nested["step_seconds_median"] * 1e3, fixed_value=single["step_seconds_median"] * 1e3),
    ]  # fmt: skip


def table(results: dict[str, Any]) -> str:
    head = (
        f"{'variant':<15} {'attn fwd/layer':>14} {'bwd GFLOP':>10} {'recomputed':>10} {'(no e.s.)':>9} "
        f"{'step ms':>8} {'max |dgrad|':>11}  setup"
    )
    lines = [head, "-" * len(head)]
    for name, r in results["variants"].items():
        lines.append(
            f"{name:<15} {r['attention_forwards_per_layer']!s:>14} {r['backward_flops'] / 1e9:>10.3f} "
            f"{r.get('recomputed_layer_forwards', float('nan')):>9.3f}x "
            f"{r.get('recomputed_layer_forwards_no_early_stop', float('nan')):>8.3f}x "
            f"{r['step_seconds_median'] * 1e3:>8.1f} {r.get('max_abs_grad_diff_vs_none', float('nan')):>11.2e}  "
            f"{r['description']}"
        )
    lines.append(
        "recomputed: extra backward FLOPs in decoder-layer forwards (MATH SDPA); no e.s.: checkpoint early stop off"
    )
    if "step_time_ratio_nested_vs_single" in results:
        lines.append(
            f"nested / single: step time {results['step_time_ratio_nested_vs_single']:.3f}x "
            f"(paired per round {results['step_time_ratio_nested_vs_single_paired']:.3f}x), "
            f"backward FLOPs {results['backward_flops_ratio_nested_vs_single']:.3f}x; "
            f"fused CPU SDPA counted by FlopCounterMode: {results.get('fused_sdpa_counted')}"
        )
    for what, message in results["refusals"].items():
        lines.append(f"apply_ac_hf refuses ({what}): {message}")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (after one warm-up step)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    add_shape_args(p)


def measure_args(args: argparse.Namespace) -> dict[str, Any]:
    with quiet_transformers():
        return measure(shape_from_args(args), steps=args.steps, variants=args.variants)


def main(argv: list[str] | None = None) -> int:
    return harness.main("recompute", argv, doc=__doc__, add_args=add_args, measure=measure_args, table=table)


if __name__ == "__main__":
    raise SystemExit(main())
