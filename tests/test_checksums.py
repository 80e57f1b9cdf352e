"""Checkpoints that cannot lie: each save records its files' checksums as it writes them, and a file whose bytes
changed afterwards (one flipped bit) is never loaded: set aside at resume, refused when named, reported by
`python -m checkpoint verify`. One process each, no launcher; the end-to-end refusals through train.py start from
the session's seed checkpoint and stop before training."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

import checkpoint
from checkpoint import CheckpointManager, check_folder, verify_contents
from checkpoint.__main__ import main as verify_command
from checkpoint.checksums import CONTENT, MANIFEST, ChecksumWriter, first_damaged, read_manifest
from config import Checkpoint
from errors import ConfigError
from tests.conftest import TINY
from tests.launch import REPO, python, torchrun, two_at_a_time
from tests.parity_worker import build_tiny

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def flip(file: Path) -> None:
    """Bit 0 of the byte in the middle of `file`."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 1
    file.write_bytes(bytes(data))


def manager(dump: Path, **cfg: object) -> CheckpointManager:
    model = build_tiny(seed=7)
    optimizer = torch.optim.AdamW(model.parameters())
    return CheckpointManager(
        Checkpoint(enable=True, **cfg), dump_folder=str(dump), model=model, optimizer=optimizer, stateful={}
    )


def saved_weights(dump: Path, steps: list[int], **cfg: object) -> dict[int, dict[str, torch.Tensor]]:
    """Save the tiny model (other weights at each step) as step-<N>; the weights each holds."""
    saver, weights = manager(dump, **cfg), {}
    for step in steps:
        with torch.no_grad():
            for p in saver.model.parameters():
                p.add_(step)
        saver.save(step)
        weights[step] = {k: v.clone() for k, v in saver.model.state_dict().items()}
    saver.close()
    return weights


def _rchar() -> int:
    return int(
        next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar")).split()[1]
    )


def test_each_save_records_its_files_checksums_as_it_writes_them(tmp_path: Path) -> None:
    big = {"weights": torch.randn(2**21)}  # 8 MiB
    dcp.save(big, storage_writer=ChecksumWriter(tmp_path / "warm"))  # imports and first-call costs
    before = _rchar()
    dcp.save(big, storage_writer=ChecksumWriter(tmp_path / "ck"))
    read = _rchar() - before
    files = read_manifest(tmp_path / "ck")
    assert files is not None and sorted(files) == [".metadata", "__0_0.distcp"]
    assert read < files["__0_0.distcp"]["size"] // 8, read  # no second pass over the data to hash it
    for name, recorded in files.items():
        data = (tmp_path / "ck" / name).read_bytes()
        assert recorded == {"size": len(data), "hash": xxhash.xxh3_128_hexdigest(data)}
    # .metadata is identical to DCP's own: the checksums travel beside it, not in it.
    dcp.save(big, checkpoint_id=str(tmp_path / "plain"))
    assert checkpoint.verify(tmp_path / "plain").storage_data == checkpoint.verify(tmp_path / "ck").storage_data

    # Async saves too (hashed in the upload thread): the manifest is published with the folder.
    dump = tmp_path / "run"
    saved_weights(dump, [1], async_mode="async")
    step = dump / "checkpoint" / "step-1"
    files = read_manifest(step)
    assert files is not None and set(files) == {p.name for p in step.iterdir()} - {MANIFEST}
    assert all(xxhash.xxh3_128_hexdigest((step / n).read_bytes()) == f["hash"] for n, f in files.items())


def test_a_flipped_bit_in_any_file_is_found_and_reported(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    state = {"a": torch.randn(256, 256), "b": torch.randn(1000), "extra": {"step": 3}}
    whole = tmp_path / "step-3"
    dcp.save(state, storage_writer=ChecksumWriter(whole, thread_count=2))  # two data files
    files = sorted(read_manifest(whole) or {})
    assert files == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    verify_contents(whole)
    for name in files:
        copy = tmp_path / f"copy-{name}" / "step-3"
        shutil.copytree(whole, copy)
        flip(copy / name)
        with pytest.raises(ConfigError, match=rf"^checkpoint: {copy / name} is damaged \(its bytes are not what was"):
            verify_contents(copy)
        (problem,) = [p for _, p in check_folder(copy.parent)]
        assert problem is not None and str(copy / name) in problem
    # The command: per step OK or damaged, exit 2 when any is damaged.
    assert verify_command(["verify", str(whole)]) == 0
    assert capsys.readouterr().out == f"{whole}: OK\n"
    assert verify_command(["verify", str(whole), str(tmp_path / "nowhere")]) == 2  # a typo is not damage
    assert capsys.readouterr().out == f"{whole}: OK\n{tmp_path / 'nowhere'}: not found\n"
    damaged = tmp_path / "copy-__0_1.distcp"
    shutil.copytree(whole, damaged / "step-1")
    assert verify_command(["verify", str(damaged)]) == 2
    assert capsys.readouterr().out.splitlines() == [
        f"{damaged / 'step-1'}: OK",
        f"{damaged / 'step-3'}: damaged: {damaged / 'step-3' / '__0_1.distcp'} is damaged (its bytes are not what "
        "was saved, by the xxh3_128 checksums of checksums.json)",
    ]
    (damaged / "step-1" / MANIFEST).unlink()
    (damaged / "step-3" / "__0_0.distcp").write_bytes(b"short")
    proc = subprocess.run(
        [sys.executable, "-m", "checkpoint", "verify", str(damaged)], cwd=REPO, capture_output=True, text=True
    )
    assert (
        proc.returncode == 2 and proc.stdout.splitlines()[0] == f"{damaged / 'step-1'}: OK (sizes only: no {MANIFEST})"
    )
    assert "__0_0.distcp is truncated" in proc.stdout.splitlines()[1], proc.stdout


def test_a_damaged_checkpoint_is_never_loaded(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dump = tmp_path / "run"
    weights = saved_weights(dump, [1, 2])
    ckpt = dump / "checkpoint"
    flip(ckpt / "step-2" / "__0_0.distcp")
    shutil.copytree(ckpt / "step-2", tmp_path / "pointed")

    # Named: refused in one line that names the file, before anything is read.
    with pytest.raises(ConfigError, match=rf"^checkpoint.load_step: {ckpt / 'step-2' / '__0_0.distcp'} is damaged"):
        manager(dump, load_step=2).load()
    initial = tmp_path / "pointed"
    with pytest.raises(ConfigError) as refused:
        CheckpointManager(
            Checkpoint(initial_load_path=str(initial)), dump_folder=str(tmp_path / "new"), model=build_tiny(),
            optimizer=None, stateful={},
        ).load()  # fmt: skip
    assert refused.value.problems == [
        f"checkpoint.initial_load_path: {initial / '__0_0.distcp'} is damaged (its bytes are not what was saved, by "
        f"the xxh3_128 checksums of checksums.json) (point checkpoint.initial_load_path at a complete checkpoint)"
    ]

    # The newest at resume: set aside, and the one before resumes.
    resumed = manager(dump)
    capsys.readouterr()
    resumed.load()
    assert resumed.resume_step() == 1
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"warning: checkpoint.folder: skipped step 2, it is damaged ({ckpt / 'step-2'}/__0_0")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-1", "step-2.damaged"]
    assert all(torch.equal(v, weights[1][k]) for k, v in resumed.model.state_dict().items())

    # Every checkpoint damaged: the run stops in one line instead of starting again from step 0.
    flip(ckpt / "step-1" / "__0_0.distcp")
    with pytest.raises(ConfigError) as stopped:
        manager(dump).load()
    assert stopped.value.problems == [
        f"checkpoint.folder: every checkpoint in {ckpt} is damaged (step-1.damaged, step-2.damaged); not starting "
        f"again from step 0. Copy a whole checkpoint there to resume from it, or move {ckpt} aside to start afresh"
    ]
    with pytest.raises(ConfigError, match="every checkpoint"):  # and so on every rerun: nothing was deleted
        manager(dump).load()


def test_a_checkpoint_saved_before_checksums_loads_with_one_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dump = tmp_path / "run"
    weights = saved_weights(dump, [4])
    step = dump / "checkpoint" / "step-4"
    (step / MANIFEST).unlink()
    capsys.readouterr()
    for _ in range(2):
        resumed = manager(dump)
        resumed.load()
        assert resumed.resume_step() == 4
    assert all(torch.equal(v, weights[4][k]) for k, v in resumed.model.state_dict().items())
    assert capsys.readouterr().err == (
        f"warning: checkpoint.folder: {step} has no {MANIFEST} (saved by torchtitan, or before this recipe recorded checksums): its files "
        "are checked by size only\n"
    )


def test_train_py_refuses_damaged_checkpoints_in_one_line(seed: Path, tmp_path: Path) -> None:
    # Two damaged copies: the resumed run sets its own aside while the other reads the one it is pointed at.
    damaged, other = tmp_path / "run" / "checkpoint" / "step-0", tmp_path / "pointed" / "step-0"
    for copy in (damaged, other):
        shutil.copytree(seed, copy)
        flip(copy / "__0_0.distcp")
    pointed, resumed = two_at_a_time(
        lambda: python(
            "train.py", *TINY, f"--job.dump_folder={tmp_path / 'new'}", f"--checkpoint.initial_load_path={other}"
        ),
        lambda: python("train.py", *TINY, f"--job.dump_folder={tmp_path / 'run'}", "--checkpoint.enable"),
    )
    for proc in (pointed, resumed):
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in pointed.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: checkpoint.initial_load_path: {other / '__0_0.distcp'} is damaged")
    (line,) = [line for line in resumed.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith(
        f"error: checkpoint.folder: every checkpoint in {damaged.parent} is damaged (step-0.damaged)"
    )
    assert "step  1" not in resumed.stdout


def test_two_ranks_gather_their_checksums_and_share_the_check(tmp_path: Path) -> None:
    proc = torchrun(__file__, str(tmp_path / "step-1"), nproc=2)
    files = read_manifest(tmp_path / "step-1")
    assert files is not None and sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # both ranks'
    hashes = {n: xxhash.xxh3_128_hexdigest((tmp_path / "step-1" / n).read_bytes()) for n in files}
    assert [n for n, f in files.items() if hashes[n] != f["hash"]] == ["__1_0.distcp"]  # the one the worker flipped
    # Round-robin over the sorted names, rank 1 hashed __0_0 alone; it names rank 0's find all the same.
    assert proc.stdout.splitlines() == [
        "rank 0: whole, then __1_0.distcp damaged",
        "rank 1: whole, then __1_0.distcp damaged",
    ]


def _two_ranks(folder: Path) -> None:
    """Each rank saves its half into `folder`; both check it whole, then with rank 1's file damaged."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    dcp.save({f"rank{rank}": torch.randn(4096)}, storage_writer=ChecksumWriter(folder))
    files = read_manifest(folder) or {}
    whole = first_damaged(folder, files) is None
    dist.barrier()
    if rank == 0:
        flip(folder / "__1_0.distcp")
    dist.barrier()
    damaged = first_damaged(folder, files)
    assert damaged is not None and damaged[1] == CONTENT
    print(f"rank {rank}: {'whole' if whole else 'damaged'}, then {damaged[0]} damaged", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _two_ranks(Path(sys.argv[1]))
