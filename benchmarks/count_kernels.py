"""Kernels per training step: one trainer's step, its ops counted as the dispatcher runs them (rank 0).

    torchrun --nproc_per_node=2 -m benchmarks.count_kernels recipe|torchtitan OUT.json TRAINER ARGS...

benchmarks/vs_torchtitan.py starts both trainers through this module in its eager layouts: train.py's
`train_step` or torchtitan 0.2.2's `Trainer.train_step` is wrapped (neither trainer's code is changed) and
step COUNTED_STEP, the first after lazy initialization and outside the timed steps, runs under
estimate_memory.observe_ops. On a GPU every op an eager step dispatches that is not a view is a kernel
launch, and at small shapes launches, not FLOPs, bound a step. DTensor ops count as the local ops they run,
collectives as one op each; views (reshapes, transposes, slices) launch nothing and are counted apart, and
record_function's annotations (the profiler namespace) not at all.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

COUNTED_STEP = 2


def count_step(step_fn: Callable[..., Any], is_counted: Callable[..., bool], out: Path) -> Callable[..., Any]:
    """`step_fn`, writing to `out` (JSON) on rank 0 the ops of the call where `is_counted(*args, **kwargs)`."""
    import torch.distributed as dist

    from estimate_memory import observe_ops

    def counted(*args: Any, **kwargs: Any) -> Any:
        if not (is_counted(*args, **kwargs) and dist.get_rank() == 0):
            return step_fn(*args, **kwargs)
        kernels: Counter[str] = Counter()
        views = 0

        def on_op(op: Any, *_: Any) -> None:
            nonlocal views
            if op.namespace == "profiler":  # record_function's annotations: no kernel
                return
            if op.is_view:
                views += 1
            else:
                kernels[op.name()] += 1

        with observe_ops(on_op):
            result = step_fn(*args, **kwargs)
        counts = {"kernels": sum(kernels.values()), "views": views, "by_op": dict(sorted(kernels.items()))}
        out.write_text(json.dumps(counts, indent=1))
        return result

    return counted


def main(argv: list[str]) -> int:
    trainer, out, trainer_argv = argv[0], Path(argv[1]), argv[2:]
    if trainer == "recipe":
        import train  # the repo is on PYTHONPATH (benchmarks.harness.run_python)

        train.train_step = count_step(train.train_step, lambda *a, step, **k: step == COUNTED_STEP, out)
        return train.main(trainer_argv)
    from tests import torchtitan_trainer

    sys.argv = [sys.argv[0], *trainer_argv]  # before torchtitan imports: its parser's default is sys.argv[1:] then
    torchtitan_trainer.prepare()
    from torchtitan.train import Trainer

    Trainer.train_step = count_step(Trainer.train_step, lambda self, *a, **k: self.step == COUNTED_STEP, out)
    torchtitan_trainer.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
