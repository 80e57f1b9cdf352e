"""benchmarks/cuda_paths.py's CPU rehearsal: every check runs through the code the GPU run uses, at tiny shapes, and
says what it checked (values within tolerance) or why a CUDA-only part did not run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import cuda_paths


def test_rehearsal_checks_values_and_gives_a_reason_for_each_cuda_only_part(tmp_path: Path) -> None:
    out = tmp_path / "cuda_paths.json"
    assert cuda_paths.main(["--out", str(out), "--rehearse", "--folder", str(tmp_path)]) == 0
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "cuda_paths"
    results = payload["results"]
    assert results["mode"] == "rehearsal" and list(results["checks"]) == list(cuda_paths.CHECKS)
    assert {name: c["status"] for name, c in results["checks"].items()} == dict.fromkeys(cuda_paths.CHECKS, "passed")

    flex = results["checks"]["flex"]
    assert set(flex["dtypes"]) == {"float32", "bfloat16"}
    for dtype, r in flex["dtypes"].items():
        # The forward ran and is within tolerance of the float64 reference, as dense SDPA is; no backward on CPU.
        assert r["flex_error"]["out"] <= r["tolerance"] * r["scale"]["out"], (dtype, r)
        assert r["sdpa_within"] == {p: True for p in cuda_paths.PARTS}, (dtype, r)
        assert not r["flex_backward"] and r["flex_error"]["dq"] is None and r["within"] == {"out": True}
        assert r["flex_ms"] > 0 and r["sdpa_ms"] > 0
    assert flex["dtypes"]["float32"]["flex_vs_sdpa"]["out"] < 1e-5
    assert any("does not support backward on CPU" in note for note in flex["notes"]), flex["notes"]

    modes = results["checks"]["async_save"]["modes"]
    plain = modes["async"]
    assert plain["status"] == "passed" and plain["unequal"] == 0 and plain["tensors"] > 0 and plain["resumed_step"] == 2
    assert plain["changed_after_save"] > 0 and 0 < plain["held_s"] < 60
    # Pinned memory needs CUDA: CheckpointManager says so, and the same branch runs with a stager that pins nothing
    # (the upload in DCP's checkpoint process, as on a GPU).
    pinned = modes["async_with_pinned_mem"]
    assert pinned["status"] == "passed" and pinned["unequal"] == 0 and pinned["changed_after_save"] > 0
    assert "needs CUDA" in pinned["cpu_counterpart"] and pinned["resumed_step"] == 2

    profile = results["checks"]["profile"]
    assert profile["documented"]["trace"] == "profile_traces/iteration_<step>/rank<r>_trace.json"
    assert list(profile["traces"]) == [
        str(s) for s in range(profile["profile_freq"], profile["steps"] + 1, profile["profile_freq"])
    ]
    assert len(profile["traces"]) == 2
    assert all(t["aten_cpu_ops"] > 0 and t["profiler_steps"] > 0 for t in profile["traces"].values())
    assert profile["snapshots"] == {} and "CUDA-only" in profile["snapshot_skipped"]

    rows = cuda_paths.rows(results)
    assert [r.unit for r in rows] == ["ms", "ms", "", "", "s", "s"]
    assert rows[-1].fixed == "its CPU counterpart (not pinned)" and "CPU rehearsal" in rows[-1].metric
    assert all(r.problem == cuda_paths.PROBLEM for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the checks without --rehearse")
def test_only_picks_checks_and_refuses_unknown_ones(tmp_path: Path) -> None:
    assert cuda_paths._checks("profile, flex") == ["profile", "flex"]
    with pytest.raises(SystemExit):
        cuda_paths.main(["--out", str(tmp_path / "x.json"), "--rehearse", "--only", "flex,nope"])
    with pytest.raises(SystemExit, match="no CUDA device"):
        cuda_paths.main(["--out", str(tmp_path / "x.json"), "--only", "profile"])


def test_a_wrong_mask_fails_the_value_check() -> None:
    """The reference is independent of models/attention.py's masks: plain causal attention over a packed window is
    far outside the tolerance."""
    import torch

    segments = cuda_paths.packed_segments(1, 64, 3)
    assert segments.unique().tolist() == [0, 1, 2]
    q, k, v = (torch.randn(1, 64, 2, 8, dtype=torch.float64) for _ in range(3))
    causal = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    causal = causal.transpose(1, 2).reshape(1, 64, 16)
    reference = cuda_paths.reference_attention(q, k, v, segments)
    assert (causal - reference).abs().max() > 10 * cuda_paths.TOLERANCE["bfloat16"]
    whole = cuda_paths.reference_attention(q, k, v, torch.zeros_like(segments))  # one document: plain causal
    torch.testing.assert_close(whole, causal)


def test_a_stager_that_closes_itself_after_each_save_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PyTorch 2.11's DefaultStager closes itself at the end of each stage (pytorch/pytorch#183413): on the H100 the
    second async_with_pinned_mem save failed with `KeyError: <class 'type'>`. Here DefaultStager does the same, and
    both pinned-branch saves of the check still load back equal, since CheckpointManager stages the next save with a
    new stager."""
    from torch.distributed.checkpoint.staging import DefaultStager

    from checkpoint import stager_reusable

    stage = DefaultStager._stage
    closed = []

    def stage_then_close(self: DefaultStager, *args: object, **kwargs: object) -> object:
        try:
            return stage(self, *args, **kwargs)
        finally:
            self._state_dict_stager.close()
            closed.append(stager_reusable(self))

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)
    result = cuda_paths.check_async_save(cuda_paths.SHAPES["rehearsal"], torch.device("cpu"), tmp_path)
    pinned = result["modes"]["async_with_pinned_mem"]
    assert closed == [False] * 4, closed  # 2 saves of each mode, each staged by a stager that then closed
    assert pinned["status"] == "passed" and pinned["unequal"] == 0 and pinned["resumed_step"] == 2, pinned
