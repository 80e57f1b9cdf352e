"""[validation] (evaluation/validation.py): the held-out loss, the same on any number of ranks and under pipeline parallel,
with no effect on training, in every logger. (A fork that removes evaluation/validation.py removes this file.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import TINY, losses
from tests.launch import REPO, python, torchrun


def test_validation_is_dp_and_pp_invariant_leaves_training_alone_and_reaches_every_logger(
    tmp_path: Path, seed: Path
) -> None:
    """Held-out loss on 1 rank, 2 data-parallel ranks and 2 pipeline stages agrees; training losses with and without
    validation are identical; the values reach metrics.jsonl, TensorBoard and (offline) Weights & Biases."""
    # Held-out data of ~50 windows of 65 tokens: one pass (steps = -1) ends in a partial global batch.
    held_out = tmp_path / "held_out.jsonl"
    lines = (REPO / "assets/corpus/stories_validation.jsonl").read_text().splitlines(keepends=True)
    held_out.write_text("".join(lines[:29]))
    common = [
        *TINY, "--training.steps=4", "--training.global_batch_size=4", "--debug.deterministic",
        "--validation.enable", f"--validation.dataset_path={held_out}", "--validation.freq=2",
        "--validation.seq_len=64", "--validation.local_batch_size=4", "--validation.steps=-1",
        f"--checkpoint.initial_load_path={seed}",  # the same weights on 1 and 2 ranks
    ]  # fmt: skip
    one, two, off, pp = tmp_path / "one", tmp_path / "two", tmp_path / "off", tmp_path / "pp"
    proc = python("train.py", *common, f"--job.dump_folder={one}")
    assert proc.returncode == 0, proc.stderr
    # The three 2-rank runs in one launch (tests/config_worker.py): without validation; as a pipeline (the stages
    # forward only, the schedule's eval; validation batches have training's shape); with TensorBoard and (offline)
    # Weights & Biases.
    runs = [
        [*common, f"--job.dump_folder={off}", "--validation.enable=false"],
        [
            *common,
            f"--job.dump_folder={pp}",
            "--parallelism.pipeline_parallel_degree=2",
            "--validation.local_batch_size=2",
        ],
        [*common, f"--job.dump_folder={two}", "--metrics.enable_tensorboard", "--metrics.enable_wandb",
         "--checkpoint.enable"],
    ]  # fmt: skip
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    wandb_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_PROJECT": "test"}
    torchrun(REPO / "tests" / "config_worker.py", str(tmp_path / "runs.json"), nproc=2, env=wandb_env)

    def validations(dump: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
        return {row["step"]: row["validation_loss"] for row in rows if "validation_loss" in row}

    assert sorted(validations(two)) == [1, 2, 4]  # step 1, every freq, the last
    # The same held-out sequences on 1 and 2 ranks; only the reduction order differs.
    assert validations(one) == pytest.approx(validations(two), rel=1e-5)
    assert validations(pp) == pytest.approx(validations(one), rel=1e-5)
    assert losses(pp) == pytest.approx(losses(one), rel=1e-5)
    assert validations(two)[4] < validations(two)[1]  # the model learns
    assert losses(two) == losses(off)  # validation changes nothing in training (bit for bit)
    # eval.py on the step-4 checkpoint (config.toml beside it), on another layout (TP 2 instead of FSDP 2),
    # without training: the loss train.py logged at step 4.
    # README's command, as written but for the checkpoint and the layout.
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index("`eval.py` scores a checkpoint") :], flags=re.S)[1]
    readme = block.splitlines()[0].split()
    assert readme[:3] == [".venv/bin/torchrun", "--nproc_per_node=2", "eval.py"], readme
    scored = torchrun(
        "eval.py", *[a.replace("outputs/debug/checkpoint/step-100", str(two / "checkpoint" / "step-4")) for a in readme[3:]],
        "--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1", nproc=2,
    )  # fmt: skip
    logged = float(re.search(r"^eval: .* \| loss ([0-9.]+) \| perplexity ([0-9.]+) \|", scored.stdout, re.M)[1])
    assert logged == pytest.approx(validations(two)[4], abs=6e-5), scored.stdout  # (printed to 4 decimals)
    assert sorted(p.name for p in (two / "checkpoint").iterdir()) == ["config.toml", "step-4"]  # nothing written
    tokens = int(re.search(r"validation at step 4: loss +[0-9.]+ \| ([0-9,]+) tokens", proc.stdout)[1].replace(",", ""))
    assert tokens % 64 == 0 and (tokens // 64) % 4 != 0  # whole windows, a partial last batch on 1 rank
    assert (tokens // 64) % 8 != 0  # and on 2

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(two / "tb"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("validation_loss")}
    assert logged == pytest.approx(validations(two), rel=1e-6)
    # wandb's offline run file holds each logged value as JSON text.
    (run_file,) = (two / "wandb").glob("offline-run-*/run-*.wandb")
    blob = run_file.read_bytes()
    for value in [*validations(two).values(), *losses(two).values()]:
        assert json.dumps(value).encode() in blob, value
