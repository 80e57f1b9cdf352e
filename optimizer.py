"""AdamW (and Muon's half, muon.py), the learning-rate schedule, and the gate that refuses an update.

An update is skipped (weights, moments and step counts stay as they were) when the step's gradient
norm is not finite, or when the step is a spike: its global loss or gradient norm stands more than
training.skip_spike_sigma standard deviations above the mean of the last training.skip_spike_window
steps. The rule is OLMo-core's `SkipStepOptimizer`; the gate here owns its optimizers as torchtitan's optimizer
container does (AdamW alone, or muon.py's AdamW and Muon), whatever they are. A finite spike (a batch of garbage, one unlucky
update) does not stop a run the way a NaN does, but applying it can cost thousands of steps of
recovery, or the run.

Every finite step enters the window, skipped or not, as in OLMo-core: a lasting jump of the loss (a
new data source, a learning-rate change) widens the window's spread and is applied after a few
skipped steps instead of stalling the run. Non-finite steps stay out of it. The window is saved in
checkpoints (`SkipStepOptimizer.window`, a Stateful), so a resumed run skips exactly the steps a straight
run skips.

No host sync: the decision is a 0/1 device tensor that an optimizer which reads GradScaler's `found_inf`
takes as it (fused AdamW, whose kernel leaves everything as it was where it is 1; muon.py's Muon, through a
`where`); when one of them has no such input (AdamW's foreach and for-loop kernels) the gate pays one host read per
step. What happened (skipped or not, the loss, the norm)
is read after the step (`read_reports`, on CUDA one step later, through a non-blocking copy that has
long finished by then), so a run that must stop stops at most one step after the bad one, naming it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from config import LRScheduler, Optimizer, Training
from distributed import full_tensor, mean_over_loss_ranks
from errors import TrainingStopped, warn

# What became of a step's update (SkipStepOptimizer.skip_code, a float device scalar holding one of these).
APPLIED, NONFINITE, SPIKE = 0, 1, 2


def build_optimizer(
    o: Optimizer, model: torch.nn.Module, *, training: Training | None = None, pp_degree: int = 1
) -> SkipStepOptimizer:
    """AdamW over the model's parameters that train (frozen ones hold no state: LoRA's base) behind the skip-step
    gate; `training` gives the skip rules (default: skip non-finite steps only, and stop at the first)."""
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **adamw_settings(o))
    return SkipStepOptimizer([adamw], **skip_rules(model, training=training, pp_degree=pp_degree))


def adamw_settings(o: Optimizer) -> dict[str, Any]:
    """torch.optim.AdamW's keyword arguments: the config's settings and kernel (muon.py's AdamW half's too)."""
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[o.implementation]
    return dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **impl)


def skip_rules(model: torch.nn.Module, *, training: Training | None, pp_degree: int) -> dict[str, Any]:
    """SkipStepOptimizer's keyword arguments: the spike window, on the model's device, and the tolerated steps."""
    t = training or Training()
    return dict(
        window=SpikeWindow(t.skip_spike_window, sigma=t.skip_spike_sigma, device=next(model.parameters()).device),
        tolerate_nonfinite=t.skip_nonfinite_steps,
        pp_degree=pp_degree,
    )


class SpikeWindow:
    """The global (loss, gradient norm) of the last `size` finite steps, on the device; a Stateful."""

    def __init__(self, size: int, *, sigma: float, device: torch.device):
        self.size, self.sigma = size, sigma
        self.history = torch.full((size, 2), float("nan"), device=device)  # NaN rows: empty
        self.seen = 0  # steps offered to the window (a host count: no sync to know it is full)

    def is_spike(self, step: torch.Tensor) -> torch.Tensor:
        """`step`: (global loss, gradient norm). Whether it is a spike (a bool device tensor); enters the window."""
        finite = torch.isfinite(step).all()  # a non-finite step is skipped anyway, and stays out of the window
        spike = torch.zeros((), dtype=torch.bool, device=step.device)
        if self.sigma > 0 and self.seen >= self.size:
            filled = torch.isfinite(self.history).all(dim=1, keepdim=True)
            n = filled.sum()
            mean = torch.where(filled, self.history, 0.0).sum(0) / n
            std = (torch.where(filled, self.history - mean, 0.0).square().sum(0) / (n - 1)).sqrt()
            spike = ((step - mean) > self.sigma * std).any() & (n >= 2) & finite
        self.history[self.seen % self.size] = torch.where(finite, step, float("nan"))
        self.seen += 1
        return spike

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "seen": torch.tensor(self.seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.copy_(state["history"])
        self.seen = int(state["seen"])


class _States(Mapping[torch.Tensor, dict[str, Any]]):
    """The state of every parameter, read from the optimizer that owns it (which may replace its own mapping, as
    load_state_dict does): a view, so that torch's state-dict functions see one optimizer."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        self.owner = {p: o for o in optimizers for g in o.param_groups for p in g["params"]}

    def __getitem__(self, p: torch.Tensor) -> dict[str, Any]:
        return self.owner[p].state[p]  # a parameter without state yet gets its owner's empty one, as there

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for o in self.optimizers for p in o.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self.optimizers)


class SkipStepOptimizer(torch.optim.Optimizer):
    """A gate around any optimizers (AdamW; muon.py's AdamW and Muon): `step_unless_bad` applies their update
    unless the step is bad (this module's docstring); `step()` applies it unconditionally, theirs in order, then
    the step hooks registered here (float8's scales), once.

    To everything else it is one optimizer: `param_groups` are theirs, the same dicts in order (set_lr reaches
    them), `state` theirs, and the state dict is one optimizer's over all their groups, the layout checkpoints hold
    (DCP and checkpoint/torchtitan.py read and write it through torch's get/set_optimizer_state_dict)."""

    def __init__(
        self,
        optimizers: list[torch.optim.Optimizer],
        *,
        window: SpikeWindow,
        tolerate_nonfinite: int = 0,
        pp_degree: int = 1,
    ):
        self.optimizers = optimizers
        # torch.optim.Optimizer's own setup: the step and state-dict hooks, and step() wrapped to run them.
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.state = _States(optimizers)  # type: ignore[assignment]
        self.window, self.tolerate_nonfinite, self.pp_degree = window, tolerate_nonfinite, pp_degree
        self.nonfinite = 0  # skipped steps of this process, read on the host
        self.spikes = 0
        self.last_nonfinite: tuple[int, float, float] | None = None  # (step, loss, grad norm)
        self.skip_code: torch.Tensor | None = None  # the last step's APPLIED, NONFINITE or SPIKE (device)
        self._reports: list[tuple[int, torch.Tensor, torch.cuda.Event | None]] = []  # not yet read

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Every optimizer's update, unconditional."""
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """One optimizer's state dict over all the groups (`state_dict`'s layout), each optimizer given its own."""
        groups, state = state_dict["param_groups"], state_dict["state"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(groups)} parameter groups, the optimizer {len(self.param_groups)}"
            )
        for optimizer in self.optimizers:
            mine, groups = groups[: len(optimizer.param_groups)], groups[len(optimizer.param_groups) :]
            ids = {i for g in mine for i in g["params"]}
            optimizer.load_state_dict({"state": {i: s for i, s in state.items() if i in ids}, "param_groups": mine})
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]  # load_state_dict made new dicts

    def step_unless_bad(self, step: int, *, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """The update of training step `step`, unless it is bad. `loss`: this rank's mean loss of the step (0
        on ranks before the last pipeline stage); `grad_norm`: the global norm, the same on every rank, so
        every rank decides alike (a non-finite loss anywhere means non-finite gradients there)."""
        # A norm is >= 0, so `< inf` is isfinite in one kernel (NaN compares false); torch.isfinite takes four.
        finite = grad_norm < math.inf
        if self.window.sigma > 0:  # one all-reduce of a scalar: the loss of the whole step
            global_loss = mean_over_loss_ranks(loss, pp_degree=self.pp_degree)
            spike = self.window.is_spike(torch.stack([global_loss, grad_norm.detach().float()]))
            self.skip_code = torch.where(finite, spike.float() * SPIKE, NONFINITE)
            skip = (self.skip_code != APPLIED).float()
        else:  # three kernels in all, the decision's and the report's; NONFINITE is 1
            self.skip_code = skip = (~finite).float()
        self._step_unless(skip)
        self._report(step, torch.stack([self.skip_code, loss.detach().float(), grad_norm.detach().float()]))

    def _step_unless(self, skip: torch.Tensor) -> None:
        """The update, unless `skip` (a float32 device scalar) is 1."""
        # An optimizer whose step reads GradScaler's `found_inf` (and `grad_scale`) from these attributes says so in
        # _step_supports_amp_scaling (fused AdamW, PyTorch 2.0-2.13; muon.py's Muon).
        if all(getattr(o, "_step_supports_amp_scaling", False) for o in self.optimizers):
            for o in self.optimizers:
                o.found_inf, o.grad_scale = skip, None
            try:
                self.step()
            finally:
                for o in self.optimizers:
                    del o.found_inf, o.grad_scale
        elif not skip.item():
            self.step()

    def _report(self, step: int, values: torch.Tensor) -> None:
        """Start the step's numbers on their way to the host: a non-blocking copy on CUDA."""
        event = None
        if values.is_cuda:
            host = torch.empty(len(values), pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            values = host
        self._reports.append((step, values, event))

    def read_reports(self) -> None:
        """Count and warn about the steps whose numbers are on the host: on CUDA all but the last step's
        (its copy may still run: it is read after the next step), elsewhere all."""
        while self._reports and (len(self._reports) > 1 or self._reports[0][2] is None):
            self._read(*self._reports.pop(0))

    def _read(self, step: int, values: torch.Tensor, event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()  # the copy of an earlier step: already done
        code, loss, grad_norm = values.tolist()
        if code == SPIKE:
            self.spikes += 1
            warn(
                f"training: step {step} had loss {loss:g} (this rank's) and gradient norm {grad_norm:g}, a spike "
                f"(more than training.skip_spike_sigma = {self.window.sigma:g} standard deviations above the recent "
                f"steps'); its update was skipped ({self.spikes} so far)"
            )
        elif code == NONFINITE:
            self.nonfinite += 1
            self.last_nonfinite = (step, loss, grad_norm)
            if self.nonfinite <= self.tolerate_nonfinite:
                warn(
                    f"training: step {step} had loss {loss:g} and gradient norm {grad_norm:g}; its update was skipped "
                    f"({self.nonfinite} of training.skip_nonfinite_steps = {self.tolerate_nonfinite})"
                )

    def too_many_nonfinite(self) -> bool:
        return self.nonfinite > self.tolerate_nonfinite

    def nonfinite_error(self, *, last_checkpoint: str) -> TrainingStopped:
        step, loss, grad_norm = self.last_nonfinite or (0, math.nan, math.nan)
        return TrainingStopped(
            f"training.skip_nonfinite_steps: step {step} had loss {loss:g} and gradient norm {grad_norm:g} "
            f"({self.nonfinite} such steps, {self.tolerate_nonfinite} tolerated); its update was skipped and the run "
            f"stops. Last checkpoint: {last_checkpoint}. Lower optimizer.lr (or check the data) and rerun to resume "
            "from it"
        )


class StopOnNonfinite:
    """After each step: more non-finite steps than training.skip_nonfinite_steps stop the run (a
    TrainingStopped), after publishing a save that finished (skipped updates leave its weights finite)."""

    def __init__(self, optimizer: SkipStepOptimizer, checkpoint: Any):
        self.optimizer, self.checkpoint = optimizer, checkpoint

    def __call__(self, step: int, result: object) -> bool:
        self.optimizer.read_reports()
        if self.optimizer.too_many_nonfinite():
            self.checkpoint.close()
            raise self.optimizer.nonfinite_error(last_checkpoint=self.checkpoint.latest())
        return False


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def set_hyperparameters(optimizer: torch.optim.Optimizer, o: Optimizer) -> None:
    """The config's settings win over those a checkpoint restored into the param groups (Muon's, in its group)."""
    for group in optimizer.param_groups:
        group.update(betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
        if group.get("muon"):
            group.update(
                momentum=o.muon_momentum, nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps,
                adjust_lr_fn=o.muon_adjust_lr_fn,
            )  # fmt: skip


def lr_factor(step: int, cfg: LRScheduler, *, training_steps: int) -> float:
    """Multiplier of optimizer.lr after `step` scheduler steps (the lr of training step step + 1):
    linear warmup, constant, decay; torchtitan's schedule, step for step.

    Warmup: step s (from 0) uses (s + 1) / warmup_steps, so the first step learns and step
    warmup_steps - 1 reaches the peak. Decay over the last decay_ratio of the steps (all of them after
    warmup when unset), ending one step past the last, so the last step's lr is not exactly 0.
    """
    total = cfg.total_steps if cfg.total_steps is not None else training_steps
    warmup = min(cfg.warmup_steps, total)
    decay = total - warmup if cfg.decay_ratio is None else min(round(total * cfg.decay_ratio), total - warmup)
    stable_end = total + 1 - decay  # warmup + stable steps, with one virtual step at the end
    if step < warmup:
        return (step + 1) / warmup
    if step < stable_end:
        return 1.0
    progress = (step + 1 - stable_end) / decay
    match cfg.decay_type:
        case "linear":
            decayed = 1.0 - progress
        case "sqrt":
            decayed = 1.0 - math.sqrt(progress)
        case "cosine":
            decayed = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * decayed


def reduce_partial_grads(parameters: Iterable[torch.Tensor]) -> None:
    """Replace every DTensor gradient that holds partial sums by its sum (one all-reduce each)."""
    for p in parameters:
        grad = p.grad
        if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
            p.grad = grad.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in grad.placements])


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, *, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Global L2 gradient norm (and clipping to max_norm > 0) over plain or DTensor grads.

    With sharded (DTensor) gradients the per-shard norms are partial results; `distributed.full_tensor`
    reduces them across ranks, so every rank clips by the same, true global norm; gradients on different meshes
    (expert parallel's experts) add their norms up in squares. Pipeline stages
    hold different parameters: their squared norms add up over `pp_group`.

    Without FSDP, the gradients of the weights TP leaves whole (the norms') come out of backward as partial sums
    over the TP ranks, which DTensor all-reduces wherever they are read: once for the norm and again in the
    optimizer. They are summed once, here, in place (`reduce_partial_grads`).
    """
    parameters = [p for p in parameters if p.grad is not None]
    reduce_partial_grads(parameters)
    # One norm per mesh (expert parallel's experts live on a mesh of their own: parallelisms/ep.py), reduced over
    # its ranks, then added up in squares.
    by_mesh: dict[object, list[torch.Tensor]] = {}  # mesh (None: plain tensors) -> its parameters
    for p in parameters:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    if not by_mesh:  # a pipeline stage without gradients: 0
        by_mesh[None] = []
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True) for group in by_mesh.values()]
    norms = [full_tensor(n) for n in norms]
    total_norm = norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
    if pp_group is not None:
        total_norm = total_norm**2
        dist.all_reduce(total_norm, group=pp_group)
        total_norm = total_norm.sqrt()
    if max_norm > 0:
        for group in by_mesh.values():  # a foreach op takes the tensors of one mesh
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm, foreach=True)
    return total_norm
