"""Context parallel's rules (parallelisms/cp.py): how a window is cut, what the config refuses in one line. Its
parity with one process, its collectives against the dry run and its resume run with the other layouts
(tests/test_parallelisms.py, tests/test_dry_run.py, tests/test_train.py); its memory in benchmarks/."""

from __future__ import annotations

import pytest
import torch

from config import load_config
from errors import ConfigError
from parallelisms.cp import window_positions
from parallelisms.parallel_dims import layout_checks


def test_head_tail_chunks_cover_the_window_once_and_even_out_causal_work() -> None:
    window, cp = 64, 4
    parts = [window_positions(window, cp=cp, rank=r, load_balance=True) for r in range(cp)]
    assert parts[0].tolist() == [*range(0, 8), *range(56, 64)]  # chunks 0 and 7 of 8
    assert sorted(torch.cat(parts).tolist()) == list(range(window))
    # Under a causal mask query position p attends to p + 1 keys: every rank gets the same number of pairs.
    assert {int((p + 1).sum()) for p in parts} == {window * (window + 1) // 2 // cp}
    # Without balancing, contiguous quarters: the last rank does 7x the first's work.
    plain = [window_positions(window, cp=cp, rank=r, load_balance=False) for r in range(cp)]
    assert plain[1].tolist() == list(range(16, 32))
    assert int((plain[-1] + 1).sum()) > 6 * int((plain[0] + 1).sum())


def problems(*argv: str, world_size: int = 4) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(["--config", "configs/debug_cp.toml", *argv], extra_checks=layout_checks(world_size))
    return info.value.problems


def test_what_context_parallel_refuses_in_one_line() -> None:
    cfg = load_config(["--config", "configs/debug_cp.toml"], extra_checks=layout_checks(4))
    assert cfg.parallelism.context_parallel_degree == 2
    assert problems("--training.seq_len=250") == [
        "training.seq_len: 250 is not divisible by 4 (context_parallel_degree 2 cuts each window into 4 equal "
        "chunks); use a multiple of 4"
    ]
    (p,) = problems("--validation.seq_len=130")
    assert p.startswith("validation.seq_len: 130 is not divisible by 4")
    (p,) = problems("--training.seq_len=260", "--parallelism.tensor_parallel_degree=4", world_size=8)
    assert p == (
        "training.seq_len: each context-parallel rank holds 130 tokens, not divisible by tensor_parallel_degree 4 "
        "(sequence parallel splits them); use a multiple of 8"
    )
    (p,) = problems("--parallelism.context_parallel_load_balancer=ptrr")
    assert p.startswith("parallelism.context_parallel_load_balancer: ptrr balances torchtitan's FlexAttention ring")
    (p,) = problems("--parallelism.context_parallel_rotate_method=alltoall")
    assert p.startswith('parallelism.context_parallel_rotate_method: "alltoall" rotates ring-attention shards')
    (train, validation) = problems("--parallelism.context_parallel_degree=3", world_size=6)
    assert train.startswith("training.seq_len: 256 is not divisible by 6") and validation.startswith(
        "validation.seq_len"
    )
    (p,) = problems("--parallelism.context_parallel_degree=0")  # (and no layout rule divides by it)
    assert p == "parallelism.context_parallel_degree: must be >= 1, got 0"


def test_a_fork_without_cp_py_refuses_its_keys(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """docs/development.md "Removing a part": in a copy without parallelisms/cp.py, context_parallel_degree > 1 is refused."""
    import config.loading

    monkeypatch.setattr(config.loading, "REPO", tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(["--parallelism.context_parallel_degree=2", "--memory_estimation.enable=false"])
    assert info.value.problems == [
        "parallelism.context_parallel_degree: 2 asks for parallelisms/cp.py, which this copy of the recipe does not "
        "have; remove the key or set it to 1"
    ]


def test_the_cuda_block_mask_of_a_ranks_queries_is_the_cpu_mask() -> None:
    """The FlexAttention BlockMask CUDA runs under CP (a rank's head-tail queries x the window, within documents),
    built on CPU and run forward by flex_attention (which has a CPU forward, not a backward): the same output as
    SDPA with the dense mask the CPU path uses."""
    from torch.nn.attention.flex_attention import flex_attention

    from models.attention import document_mask

    torch.manual_seed(0)
    window, heads, dim = 256, 2, 16
    segments = torch.cumsum(torch.rand(2, window) < 0.02, dim=1).int()
    positions = window_positions(window, cp=2, rank=1, load_balance=True)  # chunks 1 and 2 of 4
    q = torch.randn(2, heads, len(positions), dim)
    k, v = torch.randn(2, heads, window, dim), torch.randn(2, heads, window, dim)
    dense = document_mask(segments, positions)
    blocks = document_mask(segments, positions, block_mask=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=blocks), expected, atol=1e-5, rtol=1e-5)


def test_the_estimators_cli_plans_cp_and_refuses_a_fake_step_under_it(capsys: pytest.CaptureFixture[str]) -> None:
    from planning import estimate_memory

    argv = ["--flavor", "debugmodel", "--ngpu", "4", "--cp", "2", "--seq-len", "1024", "--allocator", "cpu"]
    assert estimate_memory.main(argv) == 0
    assert "4 GPUs = replicate 1 x shard 2 x cp 2 x tp 1" in capsys.readouterr().out
    assert estimate_memory.main([*argv, "--fake-step"]) == 2
    assert capsys.readouterr().err == (
        "error: --fake-step: context parallel (cp > 1) is estimated by the formulas only (the breakdown above)\n"
    )
