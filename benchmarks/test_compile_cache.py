"""The inductor cache and async TP (docs/failures.md #4), measured by benchmarks/compile_cache.py.

One run of the benchmark (five compiles in fresh processes, without kernel generation: the cache's keys and hits are
a real compile's, and the run takes about half the time); the tests read its JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import compile_cache
from benchmarks.harness import read_results, run_python


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("compile_cache")
    out = tmp / "compile_cache.json"
    proc = run_python(
        "-m",
        "benchmarks.compile_cache",
        "--out",
        str(out),
        "--cache-root",
        str(tmp / "caches"),
        "--no-kernels",
        capture=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "FX graphs the async-TP recipe got from plain TP's compile" in proc.stdout  # the table
    return read_results(out)


def test_recipes_differing_in_async_tp_get_different_cache_folders(tmp_path: Path) -> None:
    dirs = compile_cache.cache_dirs(tmp_path)
    assert dirs["plain_tp"] != dirs["async_tp"]
    assert dirs["plain_tp"] == dirs["plain_tp_again"]  # reruns of a recipe start warm
    assert len({dirs[name] for name in dirs if name != "plain_tp_again"}) == len(dirs) - 1  # TP degree, AC too
    assert all(Path(d).parent == tmp_path for d in dirs.values())


def test_shared_folder_serves_the_other_recipes_graphs_keyed_folders_do_not(result: dict[str, Any]) -> None:
    runs, graphs = result["runs"], result["graphs_per_compile"]
    assert graphs == 2  # forward and backward of the block
    assert runs["keyed/plain_tp"]["fxgraph_cache_hit"] == 0  # cold
    # Shared folder, key blind to async TP (PyTorch < 2.8): every graph served from plain TP's compile.
    assert runs["shared/async_tp_pre28_key"]["fxgraph_cache_hit"] == graphs
    assert runs["shared/async_tp_pre28_key"]["fxgraph_cache_miss"] == 0
    # Keyed folders: the same compile gets nothing from plain TP; it compiles its own graphs.
    assert runs["keyed/async_tp_pre28_key"]["fxgraph_cache_hit"] == 0
    assert runs["keyed/async_tp_pre28_key"]["fxgraph_cache_miss"] == graphs
    # PyTorch >= 2.8 (here 2.13) keys on _micro_pipeline_tp: no hits even in a shared folder.
    assert runs["shared/async_tp_2.13_key"]["fxgraph_cache_hit"] == 0
    # Equal recipes share their folder: the rerun is warm.
    assert runs["keyed/plain_tp_again"]["fxgraph_cache_hit"] == graphs
    assert result["cross_recipe_hits"] == {"shared_dir_pre28_key": 2, "shared_dir_2.13_key": 0, "keyed_dirs": 0}
    assert result["cache_dirs"]["plain_tp"] != result["cache_dirs"]["async_tp"]
    # Served graphs skip inductor: a warm compile is faster than a cold one (loose: a busy 2-core machine).
    assert result["compile_s"]["warm"] < result["compile_s"]["cold"]
    keyed, new_key, _ = compile_cache.rows(result)
    assert (keyed.broken_value, keyed.fixed_value, new_key.fixed_value) == (2, 0, 0)


def test_async_tp_is_refused_on_cpu_in_one_line(result: dict[str, Any]) -> None:
    refusal = result["async_tp_refusal"]
    message = refusal["apply_async_tp_1rank_gloo"]
    assert message.startswith("parallelism.enable_async_tensor_parallel: async TP needs compile.enable = true")
    assert "\n" not in message and "runs on cpu with gloo" in message and message.endswith("set it to false")
    train = refusal["train_py"]
    assert train["exit_code"] == 2
    assert train["stderr"].startswith("error: parallelism.enable_async_tensor_parallel: async TP needs")
    assert "Traceback" not in train["stderr"]
    assert result["reference_gpu"]["llama3_8b_64xH100_fsdp8_tp8_op_sac"] == {
        "tp": 4378,
        "async_tp": 4809,
        "speedup": 1.10,
    }
