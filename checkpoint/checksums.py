"""Checksums of a checkpoint's files, taken while DCP writes them, so that a copy damaged afterwards is never loaded.

A save through `ChecksumWriter` (torch.distributed.checkpoint's FileSystemWriter) hashes every byte on its way
to a file, in the thread that writes it (an async save's background thread: the training thread waits no
longer), so no second read pass. Each rank hands its files' sizes and hashes to the coordinator with its write
results; the coordinator writes them all to `checksums.json` just before DCP renames `.metadata` into place,
whose hash it also holds. So a folder with `.metadata` has its manifest, and the manifest covers every file.

`first_damaged` re-hashes a saved folder, the files shared round-robin over the ranks of a group, and agrees on
the first damaged file with one all-reduce. Checkpoints of earlier versions have no manifest (`read_manifest`
returns None). xxh3_128 reads at memory speed; it detects damage, not tampering.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

MANIFEST = "checksums.json"
ALGORITHM = "xxh3_128"
_METADATA = ".metadata"  # DCP's, renamed from .metadata.tmp once written
_RECORD = MetadataIndex("checksums")  # the extra write result that carries a rank's checksums to the coordinator
_CHUNK = 16 * 2**20


class _HashingStream:
    """A file opened for writing that hashes what passes through it; what DCP's writer calls, and no more."""

    def __init__(self, raw: Any, on_close: Any, *, on_first_bytes: Callable[[], None] | None):
        self.raw, self.on_close, self.on_first_bytes = raw, on_close, on_first_bytes
        self.hash, self.size = xxhash.xxh3_128(), 0

    def write(self, data: Any) -> int:
        written = self.raw.write(data)
        view = memoryview(data).cast("B")
        self.hash.update(view[:written])
        self.size += written
        if self.size == written and self.on_first_bytes is not None:
            self.on_first_bytes()
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if not self.raw.closed:
            self.raw.close()
            self.on_close(self.size, self.hash.hexdigest())


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording the size and hash of every file it writes; renaming `.metadata` into
    place first writes the manifest (`manifest` set by the coordinator's `finish`). `point`: the save's hook at
    its named points (ChecksumWriter), or None."""

    def __init__(self, point: Callable[[str], None] | None) -> None:
        self.written: dict[str, dict[str, Any]] = {}
        self.manifest: dict[str, dict[str, Any]] | None = None
        self.point = point

    def create_stream(self, path: str | os.PathLike, mode: str) -> Any:
        if mode != "wb":
            return super().create_stream(path, mode)
        return self._hashing(Path(path))

    def _hashing(self, path: Path) -> Any:
        @contextlib.contextmanager
        def stream() -> Any:
            def record(size: int, digest: str) -> None:  # one writer thread per file: no lock needed
                self.written[path.name] = {"size": size, "hash": digest}

            with path.open("wb") as raw:
                point = self.point
                first = None if point is None else lambda: point("write")
                hashing = _HashingStream(raw, record, on_first_bytes=first)
                try:
                    yield hashing
                finally:
                    hashing.close()

        return stream()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        if Path(new_path).name == _METADATA and self.manifest is not None:
            files = {**self.manifest, _METADATA: self.written[Path(path).name]}
            write_manifest(Path(new_path).parent, files)
            if self.point is not None:
                self.point("manifest")
        super().rename(path, new_path)


class ChecksumWriter(FileSystemWriter):
    """FileSystemWriter that also writes `checksums.json`: every file's size and xxh3_128, hashed as written.

    on_point: called with a point's name and `step` at the points of the save it writes (`write`, after the first bytes
    of a file; `metadata` and `manifest` on the coordinator; CheckpointManager's `on_point`)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        step: int = 0,
        on_point: Callable[[str, int], None] | None = None,
        **kwargs: Any,
    ):
        super().__init__(path, **kwargs)
        self.point = None if on_point is None else lambda name: on_point(name, step)
        self.fs = _HashingFileSystem(self.point)

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.fs.written.clear()
        results = super().write_data(plan, planner).value()  # DCP's file writer is done when it returns
        record = WriteResult(index=_RECORD, size_in_bytes=0, storage_data=dict(self.fs.written))
        future: torch.futures.Future = torch.futures.Future()
        future.set_result([*results, record])
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self.point is not None:
            self.point("metadata")
        files: dict[str, dict[str, Any]] = {}
        for rank_results in results:
            files.update(*(r.storage_data for r in rank_results if r.index == _RECORD))
        self.fs.manifest = files
        plain = [[r for r in rank_results if r.index != _RECORD] for rank_results in results]
        super().finish(metadata, plain)


def write_manifest(folder: Path, files: dict[str, dict[str, Any]]) -> None:
    text = json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, indent=1) + "\n"
    with open(folder / MANIFEST, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(folder: Path) -> dict[str, dict[str, Any]] | None:
    """{file name: {"size", "hash"}} of `folder`'s checksums.json; None without one (saved before checksums).

    Raises ValueError when the manifest itself is unreadable or of another algorithm."""
    try:
        text = (folder / MANIFEST).read_text()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise ValueError(f"{MANIFEST} is not text") from None
    try:
        manifest = json.loads(text)
        files = manifest["files"]
        if manifest["algorithm"] != ALGORITHM:
            raise ValueError(f"{MANIFEST} uses {manifest['algorithm']}, not {ALGORITHM}")
        return {name: {"size": int(f["size"]), "hash": str(f["hash"])} for name, f in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{MANIFEST} is unreadable ({type(e).__name__})") from None


def file_digest(path: Path) -> tuple[int, str]:
    """The size and xxh3_128 of the file at `path`, read once in 16 MiB chunks."""
    digest, size = xxhash.xxh3_128(), 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


SIZE, CONTENT = 0, 1  # why a file is damaged


def first_damaged(
    folder: Path, files: dict[str, dict[str, Any]], *, group: dist.ProcessGroup | None = None, alone: bool = False
) -> tuple[str, int] | None:
    """The first file (by name) of `files` whose size or hash differs on disk, and why (SIZE or CONTENT); None if
    all match. Under torch.distributed every rank of `group` hashes its share (every world-th file) and one
    all-reduce (MIN) gives every rank the same answer; so every rank of the group must call it. `alone`: this
    process hashes every file itself (one rank's work, such as rank 0's Hugging Face export), no collective."""
    names = sorted(files)
    distributed = dist.is_initialized() and not alone
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    worst = 2 * len(names)  # none damaged
    for i in range(rank, len(names), world):
        path, want = folder / names[i], files[names[i]]
        size = path.stat().st_size if path.is_file() else -1
        if size != want["size"]:
            worst = 2 * i + SIZE
        elif file_digest(path)[1] != want["hash"]:
            worst = 2 * i + CONTENT
        if worst < 2 * len(names):
            break
    if distributed and world > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        agreed = torch.tensor([worst], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        worst = int(agreed.item())
    return None if worst == 2 * len(names) else (names[worst // 2], worst % 2)


def folder_digests(folder: Path, *, group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """{file name: xxh3_128} of the weights in `folder`, on every rank: a checkpoint's checksums.json as recorded (its
    files were verified against it on loading), else its sizes (saved without one); a Hugging Face folder's
    *.safetensors, hashed now, each rank every world-th file (a collective of `group`). What a run that trains on a
    frozen base records of it, to check on resume that the base is the same (checkpoint/manager.py BaseRecord)."""
    if (folder / ".metadata").is_file():
        files = read_manifest(folder)
        if files is not None:
            return {name: f["hash"] for name, f in files.items()}
        return {f.name: f"size {f.stat().st_size}" for f in sorted(folder.iterdir()) if f.is_file()}
    names = sorted(f.name for f in folder.glob("*.safetensors"))
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    mine = {names[i]: file_digest(folder / names[i])[1] for i in range(rank, len(names), world)}
    if not distributed or world == 1:
        return mine
    everyone: list[dict[str, str]] = [{} for _ in range(world)]
    dist.all_gather_object(everyone, mine, group=group)
    return dict(sorted(item for part in everyone for item in part.items()))
