"""Shared fixtures: the tiny debug run every end-to-end test starts from, and every shipped config
with the launch it is meant for."""

from __future__ import annotations

import functools
import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

from tests.launch import REPO, python

# The debug model, small enough for many launches on 2 cores.
TINY = [
    "--config", "configs/debug.toml", "--training.seq_len=64", "--training.local_batch_size=2",
    "--metrics.log_freq=1", "--lr_scheduler.warmup_steps=5", "--validation.enable=false", "--checkpoint.enable=false",
]  # fmt: skip


@dataclass(frozen=True)
class Launch:
    """How a shipped config is meant to be launched (what its header comment tells the user)."""

    world_size: int
    gpus_per_node: int | None = None  # None: CPU ranks (gloo) on one host


# Every file under configs/, with its launch. test_config.py fails when a config is added without a row.
SHIPPED: dict[str, Launch] = {
    "configs/debug.toml": Launch(2),
    "configs/debug_ac_full.toml": Launch(2),
    "configs/debug_ac_layer.toml": Launch(2),
    "configs/debug_ac_op.toml": Launch(2),
    "configs/debug_compile.toml": Launch(2),
    "configs/debug_cp.toml": Launch(2),
    "configs/debug_fsdp_tp.toml": Launch(4),
    "configs/debug_hsdp.toml": Launch(4),
    "configs/debug_pp.toml": Launch(2),
    "configs/debug_tp.toml": Launch(2),
    "configs/finetune_chat.toml": Launch(8, gpus_per_node=8),
    "configs/finetune_hf.toml": Launch(8, gpus_per_node=8),
    "configs/fixes/1_single_activation_checkpoint.toml": Launch(2),
    "configs/fixes/2_stateless_forward.toml": Launch(2),
    "configs/fixes/3_hsdp_2nodes.toml": Launch(16, gpus_per_node=8),
    "configs/fixes/4_tp_async.toml": Launch(2, gpus_per_node=2),  # needs CUDA: refused on CPU
    "configs/fixes/4_tp_plain.toml": Launch(2),
    "configs/fixes/5_memory.toml": Launch(2),
    "configs/llama3_8b.toml": Launch(8, gpus_per_node=8),
    "configs/llama3_8b_128k.toml": Launch(64, gpus_per_node=8),
    "configs/llama3_70b.toml": Launch(64, gpus_per_node=8),
    "configs/llama3_405b.toml": Launch(512, gpus_per_node=8),
    "configs/qwen3_debug.toml": Launch(2),
    "configs/qwen3_8b.toml": Launch(8, gpus_per_node=8),
    "configs/olmo2_debug.toml": Launch(2),
    "configs/olmo2_7b.toml": Launch(8, gpus_per_node=8),
}


# (A fork that removes a part with its configs, README "Removing a part", keeps the rows of the others.)
SHIPPED = {path: launch for path, launch in SHIPPED.items() if (REPO / path).exists()}


@pytest.fixture(params=list(SHIPPED))
def shipped_config(
    request: pytest.FixtureRequest, tmp_path: Path, llama3_stand_ins: tuple[Path, Path]
) -> tuple[str, Launch, list[str]]:
    """(config, its launch, the overrides that stand in for files a clone does not have)."""
    path = request.param
    text = (REPO / path).read_text()
    overrides = []
    if "hf_assets_path" in text:
        # A fine-tune config names a downloaded HF folder: stand in a tiny random one (256 positions),
        # whose shape is no flavor.
        from tests.tiny_hf import tiny_hf_folder

        family = tomllib.loads(text).get("model", {}).get("name", "llama3")
        hf = tiny_hf_folder(tmp_path / "hf", family=family, vocab_size=2048)  # the shipped tokenizer's
        overrides = [f"--model.hf_assets_path={hf}", "--model.shape_from_hf_config", "--training.seq_len=256"]
    tokenizer, corpus = llama3_stand_ins
    if "assets/hf/Llama-3.1-8B" in text:  # the big recipes: the Llama 3.1 tokenizer
        overrides.append(f"--model.tokenizer_path={tokenizer}")
    if 'path = "data/' in text:  # and a corpus prepared from FineWeb-Edu
        overrides.append(f"--data.path={corpus}")
    return path, SHIPPED[path], overrides


@pytest.fixture(scope="session")
def llama3_stand_ins(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tokenizer with Llama 3's 128,256 ids, and a "prepared corpus" whose manifest claims the
    ~10B tokens of FineWeb-Edu sample-10BT: what config validation and the doctor read of them."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folder = tmp_path_factory.mktemp("llama3")
    vocab = {f"t{i}": i for i in range(128_000)} | {f"<|reserved_{i}|>": 128_000 + i for i in range(256)}
    vocab |= {"<|begin_of_text|>": 128_000, "<|end_of_text|>": 128_001}
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    corpus = folder / "fineweb"
    corpus.mkdir()
    (corpus / "manifest.json").write_text(json.dumps({"tokens": 10_000_000_000}))
    return folder / "tokenizer.json", corpus


def losses(dump: Path) -> dict[int, float]:
    """step -> training loss, from a run's metrics.jsonl (validation rows have none)."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


@pytest.fixture(scope="session")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One set of initial weights for every layout (sharded init differs per layout on CPU)."""
    dump = tmp_path_factory.mktemp("seed")
    proc = python("train.py", *TINY, f"--job.dump_folder={dump}", "--checkpoint.create_seed_checkpoint")
    assert proc.returncode == 0, proc.stderr
    return dump / "checkpoint" / "step-0"


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """30 steps of the debug model on 2 ranks (FSDP), logging every 5 steps and profiling every 15: its dump folder
    and output, read by tests/test_train.py (loss and metrics) and tests/test_profiling.py (traces)."""
    from tests.launch import torchrun

    dump = tmp_path_factory.mktemp("two_rank") / "run"
    proc = torchrun(
        "train.py",
        *TINY,
        "--training.steps=30",
        "--training.local_batch_size=4",
        f"--job.dump_folder={dump}",
        "--metrics.log_freq=5",
        "--metrics.enable_tensorboard",
        "--training.skip_spike_sigma=6",
        "--training.skip_spike_window=10",  # agreed on by both ranks, no spike
        "--training.z_loss_weight=1e-4",
        "--profiling.enable_profiling",
        "--profiling.profile_freq=15",
        "--profiling.enable_memory_snapshot",
        nproc=2,
    )
    return dump, proc


# ------------------------------------------------------------ parity layouts


@pytest.fixture(scope="session")
def parity_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-process reference (weights, batch, losses, final parameters) every layout of
    tests/parity_worker.py compares to, and the folder the layouts write their results to."""
    from tests.parity_worker import write_reference

    path = tmp_path_factory.mktemp("parity")
    write_reference(path / "reference.pt")
    return path


@pytest.fixture(scope="session")
def parity(parity_dir: Path) -> Callable[[int], dict[str, dict]]:
    """world size -> every layout of that size of tests/parity_worker.py (its losses, parameters and counts),
    from one torchrun launch per world size, run when a test first asks for it."""
    from tests.launch import torchrun
    from tests.parity_worker import LAYOUTS

    @functools.cache
    def launch(world_size: int) -> dict[str, dict]:
        names = [name for name, layout in LAYOUTS.items() if layout.world_size == world_size]
        # A fresh inductor cache under the run folder: compiled layouts compile for real, and the
        # per-recipe folders they create can be inspected.
        env = {"TORCHINDUCTOR_CACHE_DIR": str(parity_dir / f"inductor-{world_size}")}
        torchrun(REPO / "tests" / "parity_worker.py", str(parity_dir), *names, nproc=world_size, env=env, timeout=600)
        return {name: json.loads((parity_dir / f"{name}.json").read_text()) for name in names}

    return launch
