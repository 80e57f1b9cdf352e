"""Loss spikes: the update of a step whose loss or gradient norm stands far above the recent ones is skipped.

A finite spike (a batch of garbage, one unlucky update) does not stop a run the way a NaN does, but
applying it can cost thousands of steps of recovery, or the run. The rule is OLMo-core's
(`SkipStepOptimizer`): keep the global loss and gradient norm of the last `window` steps; once the
window is full, a step whose loss or gradient norm is more than `sigma` standard deviations above the
window's mean is not applied (weights and optimizer state stay as they were, as for a non-finite step).

Every finite step enters the window, skipped or not, as in OLMo-core: a lasting jump of the loss
(a new data source, a learning-rate change) widens the window's spread and is applied after a few
skipped steps instead of stalling the run. Non-finite steps stay out of it.

The decision is a 0/1 tensor that train_step multiplies into its `finite` flag: no host sync. The
gradient norm is global already; the loss is made global with one all-reduce of a scalar per step.
The window is not checkpointed: after a resume it fills again before any step is skipped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class SpikeGuard:
    """training.skip_spike_sigma / training.skip_spike_window: `guard(loss, grad_norm)` -> 1.0 (apply) or 0.0."""

    def __init__(self, *, sigma: float, window: int, device: torch.device, pp: int = 1):
        self.sigma, self.window, self.pp = sigma, window, pp
        self.history = torch.full((window, 2), float("nan"), device=device)  # (loss, grad norm) rows; NaN: empty
        self.seen = 0  # steps that were offered to the window (a host count: no sync to know it is full)

    def __call__(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """`loss`: this rank's mean loss of the step (0 on ranks before the last pipeline stage);
        `grad_norm`: the global gradient norm. The same answer on every rank."""
        total = loss.detach().float().reshape(1).clone()
        dist.all_reduce(total)  # SUM (gloo has no AVG); TP ranks hold equal values, pipeline stages 0 but the last
        step = torch.cat([total * self.pp / dist.get_world_size(), grad_norm.detach().float().reshape(1)])
        finite = torch.isfinite(step).all()  # a non-finite step is train_step's to skip, and stays out of the window
        apply = torch.ones((), device=step.device)
        if self.seen >= self.window:
            filled = torch.isfinite(self.history).all(dim=1, keepdim=True)
            n = filled.sum()
            mean = torch.where(filled, self.history, 0.0).sum(0) / n
            std = (torch.where(filled, self.history - mean, 0.0).square().sum(0) / (n - 1)).sqrt()
            spike = ((step - mean) > self.sigma * std).any() & (n >= 2) & finite
            apply = 1.0 - spike.float()
        self.history[self.seen % self.window] = torch.where(finite, step, float("nan"))
        self.seen += 1
        return apply
