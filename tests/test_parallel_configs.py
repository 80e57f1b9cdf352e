"""Every shipped parallel config, loaded and trained as train.py does: the same losses as one process.

All runs start from one seed checkpoint and read the same global batch per step (8
sequences, split over however many data-parallel ranks a layout has), so any layout that
computes the same function must log the same losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import losses
from tests.launch import REPO, python, torchrun

COMMON = [
    "--training.steps=3", "--training.seq_len=64", "--training.global_batch_size=8", "--training.local_batch_size=2",
    "--debug.deterministic", "--metrics.log_freq=1", "--lr_scheduler.warmup_steps=1",
    # The configs that validate do it on one small batch (their 10 x 8 x 256 tokens were half of a run's time).
    "--validation.steps=1", "--validation.local_batch_size=2", "--validation.seq_len=64",
    "--eval.limit=8",  # configs/debug.toml scores its task at the last step: 8 documents of it
]  # fmt: skip

# config -> ranks; compile is run in test_compiled_config_matches_one_process_and_compiles_once.
LAYOUTS = {
    "configs/debug.toml": 2,  # FSDP(2)
    "configs/debug_hsdp.toml": 4,
    "configs/debug_tp.toml": 2,
    "configs/debug_fsdp_tp.toml": 4,
    "configs/debug_ac_full.toml": 2,
    "configs/debug_ac_op.toml": 2,
    "configs/debug_ac_layer.toml": 2,
    "configs/debug_pp.toml": 2,  # 2 stages, 2 micro-batches of 1 sequence, 4 accumulation steps (COMMON)
    "configs/debug_cp.toml": 2,  # each 64-token window cut over 2 ranks
}


@pytest.fixture(scope="module")
def reference(seed: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    dump = tmp_path_factory.mktemp("single")
    proc = python(
        "train.py",
        "--config",
        "configs/debug.toml",
        *COMMON,
        f"--job.dump_folder={dump}",
        f"--checkpoint.initial_load_path={seed}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(dump)


LAYOUTS = {config: nproc for config, nproc in LAYOUTS.items() if (REPO / config).exists()}  # (a fork removed it)


@pytest.fixture(scope="module")
def config_losses(seed: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, float]]:
    """Each config's losses, the configs of one world size run one after another in one launch
    (tests/config_worker.py)."""
    root = tmp_path_factory.mktemp("configs")
    dumps = {config: root / Path(config).stem for config in LAYOUTS}
    for nproc in sorted(set(LAYOUTS.values())):
        seeded = f"--checkpoint.initial_load_path={seed}"
        runs = [
            ["--config", config, *COMMON, f"--job.dump_folder={dumps[config]}", seeded]
            for config, n in LAYOUTS.items()
            if n == nproc
        ]
        (root / f"runs-{nproc}.json").write_text(json.dumps(runs))
        torchrun(REPO / "tests" / "config_worker.py", str(root / f"runs-{nproc}.json"), nproc=nproc)
    return {config: losses(dump) for config, dump in dumps.items()}


@pytest.mark.parametrize(("config", "nproc"), list(LAYOUTS.items()))
def test_parallel_config_matches_one_process(
    config: str, nproc: int, config_losses: dict[str, dict[int, float]], reference: dict[int, float]
) -> None:
    got = config_losses[config]
    assert sorted(got) == [1, 2, 3]
    assert max(abs(got[s] - reference[s]) for s in got) <= 1e-5, (got, reference)


def test_compiled_config_matches_one_process_and_compiles_once(
    seed: Path, reference: dict[int, float], tmp_path: Path
) -> None:
    """FSDP 2 + op SAC + compile, validating after every step, then resumed in a new launch: each launch
    compiles its training graphs once and, at its first validation, the no-grad graphs once; nothing
    recompiles after that and nothing breaks a graph (dynamo's own logs, TORCH_LOGS)."""
    validate = (
        "--validation.enable",
        "--validation.freq=1",
        "--validation.dataset_path=assets/corpus/stories_validation.jsonl",
        "--checkpoint.enable",
    )
    logs = {"TORCH_LOGS": "recompiles,graph_breaks"}
    dump = tmp_path / "run"
    launches = [
        torchrun("train.py", "--config", "configs/debug_compile.toml", *COMMON, f"--job.dump_folder={dump}",
                 f"--checkpoint.initial_load_path={seed}", *validate, f"--training.steps={steps}", nproc=2, env=logs)
        for steps in (3, 5)
    ]  # fmt: skip
    got = losses(dump)
    # Inductor fuses and reorders float32 arithmetic (e.g. RMSNorm, SiLU * up): rounding
    # differs from eager by ~1e-6 per step, well inside the tolerance.
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert max(abs(got[s] - reference[s]) for s in reference) <= 1e-5, (got, reference)
    for proc in launches:
        lines = proc.stderr.splitlines()
        recompiled = [
            line.split("Recompiling function ")[1].split(" in ")[0] for line in lines if "Recompiling function" in line
        ]
        reasons = [line.rstrip() for line in lines if "[__recompiles]     - " in line]
        # Per rank: the block (under op SAC) and the loss, each once, for no-grad validation.
        assert sorted(recompiled) == ["forward"] * 2 + ["summed_losses"] * 2, recompiled
        assert len(reasons) == 4 and all(r.endswith("GLOBAL_STATE changed: grad_mode") for r in reasons), reasons
        assert "Graph break" not in proc.stderr
