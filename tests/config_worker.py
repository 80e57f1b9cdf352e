"""Several train.py runs in one launch, one after another in one process group:

    torchrun --nproc_per_node=N tests/config_worker.py RUNS_JSON

RUNS_JSON holds a JSON list of train.py command lines (no `--print-config`, no dry run). Each is loaded and checked
as `train.py` loads it, then built and trained with train.py's own `build` and `train`; each writes its dump folder as
`torchrun ... train.py ARGS` would. A launch per command line would start torchrun and import torch on every rank again:
seconds each (tests/test_parallel_configs.py). `main` below repeats train.py main()'s calls (load_config with
layout_checks, init_distributed, build, train) for several configs in one process group: keep the two alike.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from config import load_config
from data.inputs import input_problems
from distributed import init_distributed
from train import after_step_work, build, layout_checks, train


def main(argv: list[str]) -> int:
    runs = json.loads(Path(argv[0]).read_text())
    world = int(os.environ["WORLD_SIZE"])
    cfgs = [load_config(args, input_checks=input_problems, extra_checks=layout_checks(world)) for args in runs]
    device, rank, world_size = init_distributed(cfgs[0].comm, dump_folder=cfgs[0].job.dump_folder)
    try:
        for cfg in cfgs:
            run = build(cfg, device=device, rank=rank, world_size=world_size)
            assert run is not None, cfg.job.dump_folder
            train(run, after_step_work(run))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
