"""Shared fixtures: the tiny debug run every end-to-end test starts from, and every shipped config
with the launch it is meant for."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

from tests.launch import REPO, python, torchrun

# The debug model, small enough for many launches on 2 cores.
TINY = [
    "--config", "configs/debug.toml", "--training.seq_len=64", "--training.local_batch_size=2",
    "--metrics.log_freq=1", "--lr_scheduler.warmup_steps=5", "--validation.enable=false", "--checkpoint.enable=false",
    "--eval.enable=false",
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
    "configs/debug_dpo.toml": Launch(2),
    "configs/debug_distill.toml": Launch(2),
    "configs/debug_cp.toml": Launch(2),
    "configs/debug_fsdp_tp.toml": Launch(4),
    "configs/debug_hsdp.toml": Launch(4),
    "configs/debug_muon.toml": Launch(2),
    "configs/debug_pp.toml": Launch(2),
    "configs/debug_tp.toml": Launch(2),
    "configs/finetune_chat.toml": Launch(8, gpus_per_node=8),
    "configs/finetune_hf.toml": Launch(8, gpus_per_node=8),
    "configs/llama3_8b_dpo.toml": Launch(8, gpus_per_node=8),
    "configs/fixes/1_single_activation_checkpoint.toml": Launch(2),
    "configs/fixes/2_stateless_forward.toml": Launch(2),
    "configs/fixes/3_hsdp_2nodes.toml": Launch(16, gpus_per_node=8),
    "configs/fixes/4_tp_async.toml": Launch(2, gpus_per_node=2),  # needs CUDA: refused on CPU
    "configs/fixes/4_tp_plain.toml": Launch(2),
    "configs/fixes/5_memory.toml": Launch(2),
    "configs/fixes/6_muon_shards.toml": Launch(2),
    "configs/fixes/7_moe_balance.toml": Launch(2),
    "configs/fixes/8_dpo_format_tokens.toml": Launch(2),
    "configs/llama3_8b.toml": Launch(8, gpus_per_node=8),
    "configs/llama3_8b_128k.toml": Launch(64, gpus_per_node=8),
    "configs/llama3_70b.toml": Launch(64, gpus_per_node=8),
    "configs/llama3_405b.toml": Launch(512, gpus_per_node=8),
    "configs/qwen3_debug.toml": Launch(2),
    "configs/qwen3_8b.toml": Launch(8, gpus_per_node=8),
    "configs/olmo2_debug.toml": Launch(2),
    "configs/olmo2_7b.toml": Launch(8, gpus_per_node=8),
    "configs/qwen3_moe_debug.toml": Launch(2),
    "configs/qwen3_moe_30b_a3b.toml": Launch(8, gpus_per_node=8),
}


# (A fork that removes a part with its configs, docs/development.md "Removing a part", keeps the rows of the others.)
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


class ParityLaunches:
    """world size -> every layout of that size of tests/parity_worker.py (its losses, parameters and counts), from
    one torchrun launch per world size, after the single-process reference they compare to (RUN_DIR/reference.pt).

    Started ahead: the session starts them when it starts (`parity_ahead`), in a background thread, one after the
    other, and a test that asks for a world size waits for its launch. They are minutes of 2 and 4 ranks, and the
    tests before the first that reads them (test_dry_run.py, in file order) keep the machine's two cores only partly
    busy: most run one process, or wait on one. Everything runs in processes of its own, none in this one."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parity")
        self._launches: dict[int, Future[dict[str, dict]]] = {}
        self._reference = self._pool.submit(self._write_reference)

    def start(self, world_size: int) -> None:
        if world_size not in self._launches:
            self._launches[world_size] = self._pool.submit(self._launch, world_size)

    def __call__(self, world_size: int) -> dict[str, dict]:
        self.start(world_size)
        return self._launches[world_size].result()

    def reference(self) -> Path:
        self._reference.result()
        return self.folder / "reference.pt"

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)

    def _write_reference(self) -> None:
        proc = python(str(REPO / "tests" / "parity_worker.py"), str(self.folder), "--reference")
        assert proc.returncode == 0, proc.stderr[-6000:]

    def _launch(self, world_size: int) -> dict[str, dict]:
        from tests.parity_worker import LAYOUTS

        self._reference.result()
        names = [name for name, layout in LAYOUTS.items() if layout.world_size == world_size]
        # A fresh inductor cache under the run folder: compiled layouts compile for real, and the
        # per-recipe folders they create can be inspected.
        env = {"TORCHINDUCTOR_CACHE_DIR": str(self.folder / f"inductor-{world_size}")}
        torchrun(REPO / "tests" / "parity_worker.py", str(self.folder), *names, nproc=world_size, env=env, timeout=600)
        return {name: json.loads((self.folder / f"{name}.json").read_text()) for name in names}


@pytest.fixture(scope="session", autouse=True)
def parity_ahead(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ParityLaunches | None]:
    """The parity launches, started with the session when a collected test reads them; None when none does."""
    from tests.parity_worker import LAYOUTS

    if not any("parity" in item.fixturenames or "parity_dir" in item.fixturenames for item in request.session.items):
        yield None
        return
    launches = ParityLaunches(tmp_path_factory.mktemp("parity"))
    for world_size in sorted({layout.world_size for layout in LAYOUTS.values()}):
        launches.start(world_size)
    yield launches
    launches.close()


@pytest.fixture(scope="session")
def parity_dir(parity_ahead: ParityLaunches | None) -> Path:
    """The folder of the single-process reference every layout of tests/parity_worker.py compares to (reference.pt:
    weights, batch, losses, final parameters), and of the layouts' results."""
    assert parity_ahead is not None
    return parity_ahead.reference().parent


@pytest.fixture(scope="session")
def parity(parity_ahead: ParityLaunches | None) -> ParityLaunches:
    """world size -> every layout of that size (ParityLaunches)."""
    assert parity_ahead is not None
    return parity_ahead
