"""torchtitan 0.2.2's own Trainer on CPU ranks, unchanged: what `make bench` compares this recipe with, and what the tests of
torchtitan's checkpoints resume from and continue (tests/test_torchtitan_checkpoints.py, tests/test_torchtitan_moe.py).

    torchrun --nproc_per_node=2 -m tests.torchtitan_trainer --job.config_file debug_model.toml ...

torchtitan picks its device once, at import (`torchtitan.tools.utils.device_type`, "cuda" when no
accelerator is found) and reads memory statistics from `torch.cuda`. On a machine without a GPU this
module sets the device to "cpu" before torchtitan's other modules import it (the process group is
then gloo, torch's default for CPU tensors), gives it a device module for the calls it makes
(no-ops, a name, and the process's peak resident memory for its memory line), has FSDP reduce
gradients with a plain SUM, which gloo has (`_sum_gradients_with_gloo`), and lets torch.histc count
integers, which torchtitan's MoE router asks of it (`_histc_of_integers_on_cpu`). Nothing else of
torchtitan is touched; with a GPU the module runs torchtitan as it is.

A model shape torchtitan has no flavor for (benchmarks/vs_torchtitan.py `--shape busy`: Llama 3 8B's block with
fewer layers; this recipe's Qwen3 MoE debug model, tests/test_torchtitan_moe.py) reaches it through its own
registry: the environment variable FLAVORS_ENV holds JSON {torchtitan model name: {flavor: its ModelArgs' fields}},
which `prepare` adds to that model's flavors (`torchtitan.models.llama3.llama3_args`,
`torchtitan.models.qwen3.qwen3_args`: the TrainSpecs' model_args) before the Trainer looks its flavor up
(`--model.name=<model> --model.flavor=<name>`); torchtitan's files stay as they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
FLAVORS_ENV = "TORCHTITAN_TRAINER_FLAVORS"
# torchtitan's qwen3 TrainSpec with the optimizers that move its MoE's expert_bias (register_flavors).
BALANCED_QWEN3 = "qwen3_load_balanced"
MOE_FLAVOR = "recipe_debugmodel"  # what the tests and the bench name this recipe's Qwen3 MoE debugmodel in torchtitan


def _cpu_device_module() -> types.SimpleNamespace:
    """What torchtitan calls on its device module (set_device, memory statistics, synchronize), for CPU."""

    def peak_rss(*_: object) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0, "num_ooms": 0}

    total = types.SimpleNamespace(total_memory=_total_memory())
    return types.SimpleNamespace(
        set_device=lambda *_: None,
        current_device=lambda: 0,
        synchronize=lambda *_: None,
        get_device_name=lambda *_: "cpu",
        get_device_properties=lambda *_: total,
        reset_peak_memory_stats=lambda *_: None,
        empty_cache=lambda: None,
        memory_stats=peak_rss,
    )


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _sum_gradients_with_gloo() -> None:
    """torchtitan sets FSDP's gradient divide factor to 1 (it scales the loss by the global token count
    itself); FSDP then reduce-scatters with ReduceOp.PREMUL_SUM(1.0), which gloo lacks. Plain SUM is the
    same reduction: FSDP is told to use it (set_force_sum_reduction_for_comms, dividing by 1 after). Llama 3's
    apply_fsdp calls disable_fsdp_gradient_division from its module, Llama 4's (which Qwen3's parallelize uses) from
    its own import of it: both are given the same function."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.models.llama3.infra import parallelize
    from torchtitan.models.llama4.infra import parallelize as moe_parallelize

    disable = parallelize.disable_fsdp_gradient_division

    def disable_then_sum(model: torch.nn.Module) -> None:
        disable(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    parallelize.disable_fsdp_gradient_division = disable_then_sum
    moe_parallelize.disable_fsdp_gradient_division = disable_then_sum


def llama3_model_args(fields: dict[str, Any]) -> Any:
    """torchtitan's TransformerModelArgs of `fields` (JSON: rope_scaling_args as a dict of RoPEScalingArgs)."""
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

    fields = dict(fields)
    if (rope := fields.pop("rope_scaling_args", None)) is not None:
        fields["rope_scaling_args"] = RoPEScalingArgs(**rope)
    return TransformerModelArgs(**fields)


def qwen3_model_args(fields: dict[str, Any]) -> Any:
    """torchtitan's Qwen3ModelArgs of `fields` (JSON: moe_args as a dict of MoEArgs)."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    fields = dict(fields)
    if (moe := fields.pop("moe_args", None)) is not None:
        fields["moe_args"] = MoEArgs(**moe)
    return Qwen3ModelArgs(**fields)


def qwen3_moe_flavor(args: Any, *, grouped_mm: bool = False, load_balance_coeff: float | None = None) -> dict[str, Any]:
    """The fields of torchtitan 0.2.2's Qwen3ModelArgs (JSON) for this recipe's Qwen3 MoE `args`, the same model:
    torchtitan's MoE with its router scores softmaxed in float32, the top_k renormalized (route_norm) where
    norm_topk_prob says so, scaled by 1, combined after the experts (score_before_experts false), no shared experts.

    load_balance_coeff: None (default), no expert_bias; else the bias's step after each optimizer step, which only
    the BALANCED_QWEN3 TrainSpec takes (`--model.name` of the run).

    grouped_mm: torchtitan's grouped-matmul experts, which cast their inputs and weights to bfloat16 whatever the
    parameters' dtype (torchtitan.models.moe.moe._run_experts_grouped_mm); off (default), its loop over experts,
    which computes in the parameters' dtype: a float32 run's equal."""
    return {
        "dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
        "head_dim": args.head_dim, "vocab_size": args.vocab_size, "norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "max_seq_len": args.max_seq_len, "qk_norm": True,
        "enable_weight_tying": args.tie_word_embeddings, "attn_mask_type": args.attn_mask_type,
        "moe_enabled": True, "moe_inter_dim": args.moe_hidden_dim,
        "moe_args": {
            "num_experts": args.num_experts, "num_shared_experts": 0, "top_k": args.top_k, "score_func": "softmax",
            "route_norm": args.norm_topk_prob, "route_scale": 1.0, "score_before_experts": False,
            "load_balance_coeff": load_balance_coeff, "use_grouped_mm": grouped_mm,
        },
    }  # fmt: skip


def register_flavors(flavors: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Add `flavors` ({torchtitan model name: {flavor: its ModelArgs' fields}}) to that model's flavors, where its
    TrainSpec (`get_train_spec(name).model_args`) finds them. With qwen3's, BALANCED_QWEN3 too: torchtitan 0.2.2's
    qwen3 TrainSpec builds plain optimizers, so its MoE's expert_bias never moves whatever load_balance_coeff says;
    its deepseek_v3 and llama4 TrainSpecs build `build_optimizers_with_moe_load_balancing`, whose step pre-hook moves
    it. BALANCED_QWEN3 is the qwen3 TrainSpec with those (torchtitan's register_train_spec), on the same flavors."""
    for model, named in flavors.items():
        match model:
            case "llama3":
                from torchtitan.models.llama3 import llama3_args as registry

                build = llama3_model_args
            case "qwen3":
                from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
                from torchtitan.models.qwen3 import qwen3_args as registry
                from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

                build = qwen3_model_args
                qwen3 = get_train_spec("qwen3")
                balanced = dataclasses.replace(qwen3, build_optimizers_fn=build_optimizers_with_moe_load_balancing)
                with contextlib.suppress(ValueError):  # registered by an earlier call in this process: the same
                    register_train_spec(BALANCED_QWEN3, balanced)
            case _:
                raise ValueError(f"{FLAVORS_ENV}: no flavors of torchtitan's {model!r} here (llama3, qwen3)")
        for name, fields in named.items():
            registry[name] = build(fields)


def _histc_of_integers_on_cpu() -> None:
    """torchtitan's MoE counts the tokens of each expert with torch.histc over the chosen experts' int64 ids, and CPU's
    histc has floating-point kernels only ("histogram_cpu" not implemented for 'Long': pytorch#74236, open in 2.13).
    In this process torch.histc takes integer input as float32 and returns the counts in the input's dtype, as CUDA's
    histc does: the same counts (expert ids are far below float32's 2**24)."""
    histc = torch.histc

    def histc_any_dtype(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if input.is_floating_point() or input.is_cuda:
            return histc(input, *args, **kwargs)
        return histc(input.float(), *args, **kwargs).to(input.dtype)

    torch.histc = histc_any_dtype


def prepare() -> None:
    """Before torchtitan.train is imported: the flavors FLAVORS_ENV names, and on a machine without a GPU the CPU
    device and SUM reductions."""
    if flavors := os.environ.get(FLAVORS_ENV):
        register_flavors(json.loads(flavors))
    import torchtitan.tools.utils as utils

    if not torch.cuda.is_available():
        _histc_of_integers_on_cpu()
    if not torch.cuda.is_available() and utils.device_type != "cpu":
        module = _cpu_device_module()
        utils.device_type, utils.device_module = "cpu", module
        # Modules that importing torchtitan.tools.utils already loaded hold their own copies.
        for loaded in [m for name, m in sys.modules.items() if name.startswith("torchtitan.")]:
            if getattr(loaded, "device_type", None) == "cuda":
                loaded.device_type = "cpu"
            if getattr(loaded, "device_module", None) is torch.cuda:
                loaded.device_module = module
        _sum_gradients_with_gloo()


def user_folder(root: Path) -> Path:
    """A working folder as torchtitan's repository lays it out (its debug_model.toml, tests/assets/tokenizer,
    tests/assets/c4_test), with this repo's tokenizer and corpus: both trainers run from it."""
    shutil.copytree(REPO / "assets" / "tokenizer", root / "tests" / "assets" / "tokenizer")
    (root / "tests" / "assets" / "c4_test").mkdir(parents=True)
    shutil.copy(REPO / "assets" / "corpus" / "stories.jsonl", root / "tests" / "assets" / "c4_test" / "data.json")
    shutil.copy(REPO / "tests" / "torchtitan" / "debug_model.toml", root / "debug_model.toml")
    return root


def main() -> None:
    prepare()
    from torchtitan.train import Trainer
    from torchtitan.train import main as torchtitan_main

    sys.argv[0] = "torchtitan.train"
    torchtitan_main(Trainer)


if __name__ == "__main__":
    main()
