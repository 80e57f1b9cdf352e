"""LoRA ([lora] enable = true): low-rank adapters on a frozen base, PEFT's model and folder format.

Each target linear y = W x becomes y = W x + s B A dropout(x), A (r, in) and B (out, r), s = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora); A starts as PEFT initializes it (Kaiming-uniform, a = sqrt(5), as
nn.Linear's own weight), B at zero, so step 1 starts from the base exactly. Every other weight is frozen: no
gradient, no optimizer state (optimizer.py takes the parameters that train), not in checkpoints (a checkpoint holds
what trains: checkpoint/manager.py; the base is read from checkpoint.initial_load_path again on resume). The targets
are named by the family's Hugging Face module names (q_proj, ..., down_proj: models/<family>/hf.py PER_LAYER), as
PEFT's target_modules are; "all-linear" is every nn.Linear of every block, never the output head (PEFT's rule). An
MoE's grouped experts are no nn.Linear and take none.

Where it sits in parallelisms/parallelize.py: after float8, TP and EP, before CP, AC, compile and FSDP, so that
  * each target keeps its class and gains two children (a class of its own with this forward mixed in: the way
    FSDP2 itself extends a module), so the parameter names are the base's plus `<linear>.lora_A.weight` and
    `<linear>.lora_B.weight`, and the TP plan, float8 and the checkpoints of the base see the modules they know;
  * under TP the adapters follow PEFT's rule for parallel layers, read off the weight's placement: column-parallel
    (W split by output rows): A replicated, B split like W; row-parallel (W split by input columns): A split like W,
    B replicated, so that A x is a partial sum DTensor adds up with W x's in TP's own reduction;
  * float8 converts the base linears only: the adapters are plain nn.Linear in the compute dtype;
  * AC, compile and FSDP see the final block: the adapters shard with their block, are recomputed with it, and are
    part of its graph.
A model with adapters carries `as_reference()`, a context under which it is DPO's reference (dpo.py) as TRL 1.16's is,
without a second model: its initial self. Adapters that start at zero: the base, the adapters off (`adapters_off`);
adapters read from lora.adapter_path: those, as they started, swapped in for the forward (`adapters_as_started`).

Removing LoRA: docs/development.md's "Removing a part" (its row names this file, config/lora.py, the call in
parallelize_model and the loaders of its folders).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from errors import ConfigError

if TYPE_CHECKING:
    from config import Lora
    from models import ModelFamily

ALL_LINEAR = "all-linear"
PEFT_PREFIX = "base_model.model."  # what PEFT puts before transformers' own names in adapter_model.safetensors
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # a PEFT folder's two files


class LoRAMixin:
    """Mixed into an nn.Linear's class (or torchao's Float8Linear) by `apply_lora`: its forward plus the adapter's."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    lora_scaling: float
    lora_enabled: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # type: ignore[misc]
        if not self.lora_enabled:
            return out
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.lora_scaling

    def reset_adapter(self) -> None:
        """PEFT's initialization: A as nn.Linear's weight is (Kaiming-uniform, a = sqrt(5)), B zero."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)


@functools.cache
def _with_adapter(cls: type) -> type:
    return type(f"LoRA{cls.__name__}", (LoRAMixin, cls), {})


def scaling(cfg: Lora) -> float:
    return cfg.lora_alpha / (math.sqrt(cfg.r) if cfg.use_rslora else cfg.r)


# ------------------------------------------------------------------ targets


def hf_module_names(fam: ModelFamily) -> dict[str, str]:
    """Our module name inside a block -> the family's Hugging Face module name (its leaf: "attention.wq" -> "q_proj")."""
    return {ours: hf.rsplit(".", 1)[-1] for hf, ours in fam.hf.PER_LAYER.items()}


def targets(block: nn.Module, fam: ModelFamily, cfg: Lora) -> list[str]:
    """The names inside `block` of the linears that get adapters: those whose Hugging Face name is in
    target_modules, or every nn.Linear with "all-linear"; a name that matches no linear of the family is refused."""
    hf = hf_module_names(fam)
    linears = [name for name, m in block.named_modules() if isinstance(m, nn.Linear) and name in hf]
    if cfg.target_modules == [ALL_LINEAR]:
        return linears
    known = {hf[name] for name in linears}
    if unknown := [name for name in cfg.target_modules if name not in known]:
        raise ConfigError(
            f"lora.target_modules: {', '.join(unknown)} is no linear of a {fam.name} block; choose from "
            f'{", ".join(sorted(known))}, or ["{ALL_LINEAR}"]'
        )
    return [name for name in linears if hf[name] in cfg.target_modules]


def target_names(fam: ModelFamily, args: Any, cfg: Lora) -> list[str]:
    """The Hugging Face module names (q_proj, ...) a model of `args` gets adapters on, sorted (adapter_config.json's
    target_modules)."""
    with torch.device("meta"):
        block = next(iter(fam.model_cls(args).layers.values()))
    hf = hf_module_names(fam)
    return sorted({hf[name] for name in targets(block, fam, cfg)})


# ------------------------------------------------------------------ the model


def apply_lora(model: nn.Module, cfg: Lora, fam: ModelFamily, *, base_dtype: torch.dtype) -> None:
    """Adapters on the target linears of every block of `model` (on any device, meta included, after TP and EP),
    every other parameter frozen and stored in `base_dtype` (training.mixed_precision_param's: what the forward
    computes in anyway, so a bf16 base costs nothing in accuracy and halves its memory); the model's init_weights
    then initializes the adapters too (or reads lora.adapter_path), and `model.adapters_off()` is a context under
    which it computes as its base; `model.as_reference()` as it started (DPO's reference)."""
    s = scaling(cfg)
    for block in model.layers.values():
        for name in targets(block, fam, cfg):
            _add_adapter(block.get_submodule(name), r=cfg.r, dropout=cfg.lora_dropout, scaling=s)
    for name, p in list(model.named_parameters()):
        if not is_adapter(name):
            owner, _, leaf = name.rpartition(".")
            frozen = nn.Parameter(p.detach().to(base_dtype), requires_grad=False)
            setattr(model.get_submodule(owner), leaf, frozen)

    init_weights = model.init_weights

    def init_with_adapters(*args: Any, **kwargs: Any) -> None:
        init_weights(*args, **kwargs)
        for m in adapters(model):
            m.reset_adapter()
        if cfg.adapter_path is not None:
            load_peft_adapter(model, Path(cfg.adapter_path), fam, cfg)
            started = {name: p.detach().clone() for name, p in model.named_parameters() if is_adapter(name)}
            model.as_reference = functools.partial(adapters_as_started, model, started)  # type: ignore[attr-defined]
            model.adapters_from = cfg.adapter_path  # type: ignore[attr-defined]  # what a reference table is keyed on

    model.init_weights = init_with_adapters  # type: ignore[method-assign]
    model.adapters_off = functools.partial(adapters_off, model)  # type: ignore[attr-defined]
    model.as_reference = model.adapters_off  # type: ignore[attr-defined]  # B = 0: the start is the base


def _add_adapter(linear: nn.Linear, *, r: int, dropout: float, scaling: float) -> None:
    w = linear.weight
    a_place, b_place = _adapter_placements(w)
    make = functools.partial(torch.empty, device=w.device, dtype=w.dtype)
    lora_a = nn.Linear(linear.in_features, r, bias=False, device="meta")
    lora_b = nn.Linear(r, linear.out_features, bias=False, device="meta")
    for module, shape, place in (
        (lora_a, (r, linear.in_features), a_place),
        (lora_b, (linear.out_features, r), b_place),
    ):
        t = make(shape)
        if isinstance(w, DTensor):
            t = distribute_tensor(t, w.device_mesh, [place], src_data_rank=None)
        module.weight = nn.Parameter(t)
    linear.__class__ = _with_adapter(type(linear))
    linear.lora_A, linear.lora_B = lora_a, lora_b
    linear.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
    linear.lora_scaling, linear.lora_enabled = scaling, True


def _adapter_placements(w: torch.Tensor) -> tuple[Any, Any]:
    """PEFT's rule for parallel layers, from the weight's TP placement: column-parallel (Shard(0)): A replicated, B
    split like W; row-parallel (Shard(1)): A split like W, B replicated; a weight TP leaves whole: both whole."""
    if not isinstance(w, DTensor):
        return None, None
    if len(w.placements) != 1:
        raise ValueError(f"apply_lora runs before FSDP: a weight on a {len(w.placements)}-D mesh is unexpected")
    (place,) = w.placements
    if place == Shard(0):
        return Replicate(), Shard(0)
    if place == Shard(1):
        return Shard(1), Replicate()
    return Replicate(), Replicate()


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (`<linear>.lora_A.weight`, `<linear>.lora_B.weight`)."""
    return ".lora_A." in name or ".lora_B." in name


def adapters(model: nn.Module) -> Iterator[LoRAMixin]:
    return (m for m in model.modules() if isinstance(m, LoRAMixin))


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The model as its base while inside: every adapter's path skipped (DPO's reference, TRL's disable_adapter)."""
    modules = list(adapters(model))
    for m in modules:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.lora_enabled = True


@contextlib.contextmanager
def adapters_as_started(model: nn.Module, started: dict[str, torch.Tensor]) -> Iterator[None]:
    """The model with its adapters' starting values swapped in while inside (no autograd: DPO's reference forward):
    what TRL 1.16 makes of a PEFT model with a pretrained adapter, a frozen copy of it as the reference adapter."""
    params = dict(model.named_parameters())
    now = {name: params[name].detach().clone() for name in started}
    with torch.no_grad():
        for name, t in started.items():
            params[name].copy_(t)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, t in now.items():
                params[name].copy_(t)


# ------------------------------------------------------------------ PEFT's folders


def peft_name(fam: ModelFamily, ours: str) -> str:
    """Our adapter parameter name -> PEFT's key in adapter_model.safetensors:
    layers.3.attention.wq.lora_A.weight -> base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight."""
    _, layer, rest = ours.split(".", 2)
    module, which = rest.rsplit(".", 2)[0], rest.rsplit(".", 2)[1]
    hf = {o: h for h, o in fam.hf.PER_LAYER.items()}[module]
    return f"{PEFT_PREFIX}model.layers.{layer}.{hf}.{which}.weight"


def load_peft_adapter(model: nn.Module, folder: Path, fam: ModelFamily, cfg: Lora) -> None:
    """A PEFT adapter folder's weights (`read_peft_folder`) into the model's adapters (any layout: each rank copies its
    shard); its scale, its adapters' names (the targets) and their shapes (the rank) must be [lora]'s, or it is
    refused in one line saying which differs."""
    key = "lora.adapter_path"
    adapters, s = read_peft_folder(folder, fam, key=key)
    if not math.isclose(s, scaling(cfg)):
        raise ConfigError(
            f"{key}: {folder}'s scale lora_alpha / r{' / sqrt' if cfg.use_rslora else ''} is {s:g}, the run's "
            f"{scaling(cfg):g}; set lora.r, lora.lora_alpha and lora.use_rslora to its adapter_config.json's"
        )
    params = {name: p for name, p in model.named_parameters() if is_adapter(name)}
    if odd := sorted(set(params) ^ set(adapters)):
        raise ConfigError(
            f"{key}: {folder}'s adapters are not on the linears the run's lora.target_modules names ({len(odd)} "
            f"differ, e.g. {odd[0]}); set lora.target_modules to its adapter_config.json's"
        )
    with torch.no_grad():
        for name, p in params.items():
            t = adapters[name].to(p.dtype)
            if tuple(t.shape) != tuple(p.shape):
                raise ConfigError(f"{key}: {folder}'s {name} has shape {tuple(t.shape)}, the run's {tuple(p.shape)}")
            if isinstance(p, DTensor):
                t = distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(t)


# ---- PEFT folders: out, and read whole (merged into a plain model: inference.py)


def peft_adapter_config(fam: ModelFamily, args: Any, cfg: Lora, *, base: str | None) -> dict[str, Any]:
    """adapter_config.json of our adapters: the [lora] keys under PEFT's names, and PEFT 0.21's other LoraConfig
    fields at the values that mean plain LoRA (no bias, no DoRA, no per-module rank or alpha), so that
    PeftModel.from_pretrained computes what our model computes."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.r,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "target_modules": target_names(fam, args, cfg),
        "use_rslora": cfg.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
        "lora_bias": False,
        "revision": None,
    }


def write_peft_folder(
    out: Path,
    adapters: dict[str, torch.Tensor],
    *,
    fam: ModelFamily,
    args: Any,
    cfg: Lora,
    base: str | None,
    dtype: torch.dtype | None = None,
) -> None:
    """A PEFT adapter folder in `out` (created): adapter_config.json and adapter_model.safetensors under PEFT's keys
    (`peft_name`), from our adapter tensors (name -> whole tensor; dtype None keeps theirs). Every adapter the
    [lora] targets of `args` name must be given, and nothing else."""
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = fam.model_cls(args)
    apply_lora(model, cfg, fam, base_dtype=torch.float32)
    expected = {name for name, _ in model.named_parameters() if is_adapter(name)}
    if set(adapters) != expected:
        odd = sorted(set(adapters) ^ expected)
        raise ConfigError(
            f"{out}: the adapters given are not those [lora] puts on this model ({len(odd)} differ, e.g. {odd[0]}); "
            "is [lora] the run's?"
        )
    tensors = {peft_name(fam, n): (t if dtype is None else t.to(dtype)).contiguous() for n, t in adapters.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / ADAPTER_CONFIG).write_text(json.dumps(peft_adapter_config(fam, args, cfg, base=base), indent=2) + "\n")
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})


@torch.no_grad()
def merge_adapters(model: nn.Module, adapters: dict[str, torch.Tensor], s: float) -> int:
    """Each adapter pair `<linear>.lora_A/B.weight` of `adapters` (whole tensors) merged into the plain model's
    `<linear>.weight` in place (a TP- or FSDP-sharded weight takes its shard); returns how many were merged. A pair
    whose linear the model lacks, or of the wrong shape, is refused."""
    params = dict(model.named_parameters())
    linears = sorted({n.rsplit(".", 2)[0] for n in adapters})
    for linear in linears:
        a, b = adapters.get(f"{linear}.lora_A.weight"), adapters.get(f"{linear}.lora_B.weight")
        w = params.get(f"{linear}.weight")
        if (
            a is None
            or b is None
            or w is None
            or tuple(w.shape) != (b.shape[0], a.shape[1])
            or a.shape[0] != b.shape[1]
        ):
            raise ConfigError(
                f"the adapter of {linear} does not fit this model (its A, B or weight is missing or of another "
                "shape); is it an adapter of this model?"
            )
        # W + s B A in float32, in W's dtype (what PEFT's merge_and_unload writes); a sharded W takes its shard.
        delta = (s * (b.float() @ a.float())).to(w.device)
        if isinstance(w, DTensor):
            delta, w = (
                distribute_tensor(delta, w.device_mesh, w.placements, src_data_rank=None).to_local(),
                w.to_local(),
            )
        w.copy_((w.float() + delta).to(w.dtype))
    return len(linears)


def read_peft_folder(folder: Path, fam: ModelFamily, *, key: str) -> tuple[dict[str, torch.Tensor], float]:
    """A PEFT LoRA folder's adapters under our names, and their scale; what it holds that is no plain LoRA of the
    family's linears (DoRA, biases, per-module ranks, other saved modules) is refused, naming `key`."""
    from safetensors.torch import load_file

    try:
        saved = json.loads((folder / ADAPTER_CONFIG).read_text())  # (PEFT's other keys: plain LoRA's, or refused)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"{key}: {folder / ADAPTER_CONFIG} could not be read ({e}); point it at a PEFT adapter folder"
        ) from None
    unlike = [
        f"{k} {saved.get(k)!r}"
        for k, plain in (("peft_type", "LORA"), ("bias", "none"), ("use_dora", False), ("fan_in_fan_out", False))
        if saved.get(k, plain) != plain
    ] + [f"{k} {saved[k]!r}" for k in ("rank_pattern", "alpha_pattern", "modules_to_save") if saved.get(k)]
    if unlike:
        raise ConfigError(f"{key}: {folder} is no plain LoRA adapter ({', '.join(unlike)}); only those are read here")
    hf_to_ours = fam.hf.PER_LAYER  # (HF module name -> ours)
    prefix = f"{PEFT_PREFIX}model.layers."
    adapters = {}
    for name, t in load_file(str(folder / ADAPTER_WEIGHTS)).items():
        # base_model.model.model.layers.{i}.{hf module}.lora_{A,B}[.default].weight (PEFT drops the adapter name).
        layer, _, rest = name.removeprefix(prefix).partition(".")
        module, _, which = rest.removesuffix(".weight").rpartition(".")
        if not name.startswith(prefix) or which not in ("lora_A", "lora_B") or module not in hf_to_ours:
            raise ConfigError(f"{key}: {folder} holds {name}, no LoRA adapter of a {fam.name} linear")
        adapters[f"layers.{layer}.{hf_to_ours[module]}.{which}.weight"] = t
    r, alpha = saved.get("r"), saved.get("lora_alpha")
    if not isinstance(r, int) or not isinstance(alpha, int | float) or r < 1:
        raise ConfigError(f"{key}: {folder / ADAPTER_CONFIG} lacks a positive r or a lora_alpha")
    return adapters, alpha / (math.sqrt(r) if saved.get("use_rslora") else r)
