"""torchtitan 0.2.2's own Trainer on CPU ranks, unchanged: what `make bench` compares this recipe with, and what the tests of
torchtitan's checkpoints resume from and continue (tests/test_torchtitan_checkpoints.py).

    torchrun --nproc_per_node=2 -m tests.torchtitan_trainer --job.config_file debug_model.toml ...

torchtitan picks its device once, at import (`torchtitan.tools.utils.device_type`, "cuda" when no
accelerator is found) and reads memory statistics from `torch.cuda`. On a machine without a GPU this
module sets the device to "cpu" before torchtitan's other modules import it (the process group is
then gloo, torch's default for CPU tensors), gives it a device module for the calls it makes
(no-ops, a name, and the process's peak resident memory for its memory line), and has FSDP reduce
gradients with a plain SUM, which gloo has (`_sum_gradients_with_gloo`). Nothing else of torchtitan
is touched; with a GPU the module runs torchtitan as it is.

A model shape torchtitan has no flavor for (benchmarks/vs_torchtitan.py `--shape busy`: Llama 3 8B's block with
fewer layers) reaches it through its own registry: the environment variable FLAVORS_ENV holds JSON
{flavor: TransformerModelArgs fields}, which `prepare` adds to torchtitan's Llama 3 flavors
(`torchtitan.models.llama3.llama3_args`, the TrainSpec's model_args) before the Trainer looks its flavor up
(`--model.flavor=<name>`); torchtitan's files stay as they are.
"""

from __future__ import annotations

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
    same reduction: FSDP is told to use it (set_force_sum_reduction_for_comms, dividing by 1 after)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.models.llama3.infra import parallelize

    disable = parallelize.disable_fsdp_gradient_division

    def disable_then_sum(model: torch.nn.Module) -> None:
        disable(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    parallelize.disable_fsdp_gradient_division = disable_then_sum


def llama3_model_args(fields: dict[str, Any]) -> Any:
    """torchtitan's TransformerModelArgs of `fields` (JSON: rope_scaling_args as a dict of RoPEScalingArgs)."""
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

    fields = dict(fields)
    if (rope := fields.pop("rope_scaling_args", None)) is not None:
        fields["rope_scaling_args"] = RoPEScalingArgs(**rope)
    return TransformerModelArgs(**fields)


def register_flavors(flavors: dict[str, dict[str, Any]]) -> None:
    """Add `flavors` ({name: TransformerModelArgs fields}) to torchtitan's Llama 3 flavors, where its TrainSpec
    (`get_train_spec("llama3").model_args`) finds them."""
    from torchtitan.models.llama3 import llama3_args

    for name, fields in flavors.items():
        llama3_args[name] = llama3_model_args(fields)


def prepare() -> None:
    """Before torchtitan.train is imported: the flavors FLAVORS_ENV names, and on a machine without a GPU the CPU
    device and SUM reductions."""
    if flavors := os.environ.get(FLAVORS_ENV):
        register_flavors(json.loads(flavors))
    import torchtitan.tools.utils as utils

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
