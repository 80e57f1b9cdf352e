"""The dry run (dry_run.py, `[comm] mode = "fake_backend"`): rank 0's plan of a big job on this machine, on a fake
process group and the meta device, without its GPUs or its input files. (A fork that removes dry_run.py removes
this file.)"""

from __future__ import annotations

import os

from models.llama3 import FLAVORS
from tests.launch import python


def dry_run(config: str, world_size: int | None, *args: str, **env: str) -> tuple[int, str, str]:
    assert "WORLD_SIZE" not in os.environ
    env = env | ({"WORLD_SIZE": str(world_size)} if world_size is not None else {})
    proc = python("train.py", "--config", config, "--comm.mode=fake_backend", *args, env=env, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def test_dry_run_of_405b_on_512_ranks() -> None:
    code, out, err = dry_run("configs/llama3_405b.toml", 512)
    assert code == 0, out + err
    args = FLAVORS["llama3_405b"]
    # Rank 0: stages 0 and 8 (embedding + blocks 0-6 and 63-70), sharded over FSDP 8 x TP 8; the norm
    # weights are not split by TP. Counted on the parallelized meta model, derived here by hand.
    matmuls = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads) + 3 * args.dim * args.ffn_hidden_dim
    expected = args.vocab_size * args.dim // 64 + 15 * (matmuls // 64 + 2 * args.dim // 8)
    assert f"parameters on rank 0: {expected:,} " in out, out
    assert "pipeline: Interleaved1F1B, 16 stages (2 per rank), 32 micro-batches" in out
    assert "pp               8 ranks [0, 64, 128, 192, 256, 320, 384, 448]; 64 groups" in out
    assert "tp               8 ranks [0, 1, 2, 3, 4, 5, 6, 7]; 64 groups" in out
    assert "GiB allocated" in out and "dp_shard" in out and "nothing was allocated" in out


def test_dry_run_of_8b_on_64_ranks_and_without_world_size() -> None:
    code, out, err = dry_run("configs/llama3_8b.toml", 64)
    assert code == 0, out + err
    assert "parameters on rank 0: 125,472,832 " in out  # 8,030,261,248 / 64
    code, out, err = dry_run("configs/llama3_8b.toml", None)
    assert code == 2 and err.count("error: ") == 1 and "WORLD_SIZE is 'unset'" in err, err
    for bad in ("abc", "0"):
        code, out, err = dry_run("configs/llama3_8b.toml", 64, LOCAL_WORLD_SIZE=bad)
        assert code == 2 and err.strip() == (
            f"error: comm.mode: fake_backend plans nodes of LOCAL_WORLD_SIZE GPUs, but LOCAL_WORLD_SIZE is {bad!r}; "
            "set it to the GPUs per node (e.g. 8) or leave it unset"
        ), err


def test_dry_run_of_the_second_family_with_its_inputs_elsewhere() -> None:
    """Qwen3 8B on 8 ranks: planned like Llama (the family's own shapes, TP plan and traced costs); the Base
    weights and the corpus this machine lacks are notes, not errors."""
    code, out, err = dry_run("configs/qwen3_8b.toml", 8)
    assert code == 0, out + err
    assert out.startswith("qwen3 qwen3_8b: 8.19B parameters on 8 ranks")
    assert "parameters on rank 0: 1,023,841,920 " in out  # 8,190,735,360 / 8
    notes = out[out.index("inputs the job reads that this machine lacks") :]
    assert "model.hf_assets_path: assets/hf/Qwen3-8B-Base not found" in notes and "data.path: data/" in notes
    # Under TP the communication line comes from the traced block: QK-norm and all.
    code, out, err = dry_run("configs/qwen3_8b.toml", 16, "--parallelism.tensor_parallel_degree=2")
    assert code == 0, out + err
    assert "tp  " in out and "traced on one block" in out
