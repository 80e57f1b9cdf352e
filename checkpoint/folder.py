"""The run's folder on disk: one run at a time (its lock), complete checkpoints found, the debris of a crash
recovered or set aside, and a save that runs out of space stopped in one line (checkpoint/__init__.py tells the
whole story)."""

from __future__ import annotations

import atexit
import errno
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from checkpoint.checksums import MANIFEST
from checkpoint.verify import verify, verify_contents
from config import Checkpoint
from errors import ConfigError, DiskFull, warn, writable_folder

_STEP_DIR = re.compile(r"^step-(\d+)$")
_PARTIAL_DIR = re.compile(r"^step-(\d+)\.partial$")
_DAMAGED_DIR = re.compile(r"^step-(\d+)\.damaged(-\d+)?$")
_PRUNED_DIR = re.compile(r"^step-(\d+)\.pruned$")  # being deleted by pruning (manager.py): a kill left it
GiB = 2**30


def is_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file()


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every published checkpoint in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        if (match := _STEP_DIR.match(child.name)) and is_checkpoint(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def refuse_folder_of_steps(path: Path, *, key: str) -> None:
    """`key` names a folder that holds step folders rather than being one: a checkpoint folder (step-<N> inside) or a
    run folder (train.py's dump folder, whose checkpoint folder holds them). One line naming its newest step."""
    if not path.is_dir() or is_checkpoint(path):
        return
    try:
        if found := complete_checkpoints(path):
            kind, newest = "a checkpoint folder", found[-1][1]
        else:
            inner = [steps[-1][1] for child in sorted(path.iterdir()) if (steps := complete_checkpoints(child))]
            if not inner:
                return
            kind, newest = "a run folder", inner[0]
    except OSError:  # an unreadable folder: the caller's own checks say what is wrong
        return
    raise ConfigError(f"{key}: {path} is {kind}; point it at one of its step folders, e.g. {newest}")


# ------------------------------------------------------------------ the dump folder


LEASE_RENEW_S = 10.0  # the living run touches its lock this often
LEASE_EXPIRY_S = 60.0  # a lock untouched this long is a dead run's, whatever host it names


class DumpFolderLock:
    """`<dump_folder>/.lock` names the run that owns the folder: "host pid", and the scheduler's job and attempt where
    there is one ("job=slurm:123 attempt=0.0": SLURM_JOB_ID with SLURM_RESTART_COUNT, TORCHELASTIC_RUN_ID with
    TORCHELASTIC_RESTART_COUNT). The run holding it renews it, a daemon thread touching it every `renew_every` seconds
    (a lease), and removes it at exit.

    A lock is a dead run's, and taken over, when its process is gone (this host), when it names an earlier attempt of
    this same job (Slurm requeues a job, and torchrun restarts one, only once every process of the attempt before has
    ended, on whatever node it ran), or when its lease expired (not renewed for LEASE_EXPIRY_S: its host died, froze or
    lost the filesystem). So a job requeued onto another node after its node died restarts without a person; two live
    runs in one folder are still refused. Ages are read on the filesystem's clock, not this host's: the hosts sharing a
    folder need not agree on the time."""

    def __init__(self, folder: Path, *, environ: Mapping[str, str] | None = None, renew_every: float = LEASE_RENEW_S):
        self.path, self.renew_every = folder / ".lock", renew_every
        self.job, self.attempt = job_attempt(os.environ if environ is None else environ)
        job = f" job={self.job} attempt={'.'.join(map(str, self.attempt))}" if self.job else ""
        self.owner = f"{socket.gethostname()} {os.getpid()}{job}"
        self.released = threading.Event()

    def acquire(self) -> None:
        for _ in range(3):  # a holder may release (or another run take over) between the two steps
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                self._take_over_or_refuse()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self.owner + "\n")
            atexit.register(self.release)
            threading.Thread(target=self._renew, name="dump-folder-lease", daemon=True).start()
            return
        raise ConfigError(f"job.dump_folder: {self.path} keeps changing hands; is another run starting in it?")

    def _take_over_or_refuse(self) -> None:
        try:
            text, age = self.path.read_text().strip(), filesystem_now(self.path.parent) - self.path.stat().st_mtime
        except FileNotFoundError:
            return
        host, _, rest = text.partition(" ")
        pid, *extra = rest.split() or [""]
        fields = dict(item.partition("=")[::2] for item in extra)
        if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
            why = "its process is gone"
        elif self.job and fields.get("job") == self.job and _attempt(fields.get("attempt", "")) < self.attempt:
            why = f"an earlier attempt ({fields['attempt']}) of this job ({self.job})"
        elif age >= LEASE_EXPIRY_S:
            why = f"not renewed for {age:.0f} s"
        else:
            raise ConfigError(
                f"job.dump_folder: {self.path.parent} is in use by the run with pid {pid} on host {host} (see "
                f"{self.path}, renewed {max(age, 0):.0f} s ago); wait for it or choose another job.dump_folder (a run "
                f"that is gone stops renewing it: it expires {LEASE_EXPIRY_S - max(age, 0):.0f} s from now)"
            ) from None
        self.path.unlink(missing_ok=True)
        log(f"took over {self.path} of the run with pid {pid} on host {host}: {why}")

    def _renew(self) -> None:
        while not self.released.wait(self.renew_every):
            try:
                if self.path.read_text().strip() != self.owner:
                    warn(
                        f"job.dump_folder: {self.path} was taken over by another run; two runs now write in this folder"
                    )
                    return
                os.utime(self.path)
            except OSError:  # the folder was removed, or the filesystem is away: the next renewal tries again
                pass

    def release(self) -> None:
        self.released.set()
        if self.path.is_file() and self.path.read_text().strip() == self.owner:
            self.path.unlink()


def job_attempt(environ: Mapping[str, str]) -> tuple[str | None, tuple[int, int]]:
    """The scheduler's job this process belongs to (None outside one) and its attempt: Slurm's requeues, then
    torchrun's restarts. torchrun's default rendezvous id, "none", names no job."""
    parts = [f"slurm:{environ['SLURM_JOB_ID']}"] if environ.get("SLURM_JOB_ID") else []
    if environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
        parts.append(f"torchrun:{environ['TORCHELASTIC_RUN_ID']}")
    attempt = (int(environ.get("SLURM_RESTART_COUNT") or 0), int(environ.get("TORCHELASTIC_RESTART_COUNT") or 0))
    return ("+".join(parts) or None), attempt


def _attempt(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in text.split("."))
    except ValueError:
        return (1 << 62,)  # unreadable: never earlier than ours


def filesystem_now(folder: Path) -> float:
    """The current time on `folder`'s filesystem: the mtime of a file created there (a network filesystem stamps files
    with its server's clock)."""
    probe = folder / f".clock-{socket.gethostname()}-{os.getpid()}"
    try:
        probe.touch()
        return probe.stat().st_mtime
    except OSError:
        return time.time()
    finally:
        probe.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def prepare_dump_folder(dump_folder: str, cfg: Checkpoint, *, checkpoint_bytes: int) -> DumpFolderLock:
    """Rank 0, before any compute: the dump folder exists, is ours (lock), and can take a checkpoint.

    Publishes checkpoints a crash left complete but unpublished, and removes `.partial` debris.
    checkpoint_bytes: what one checkpoint of this model and optimizer takes on disk (an estimate).
    """
    folder = Path(dump_folder)
    writable_folder(folder, key="job.dump_folder")
    lock = DumpFolderLock(folder)
    lock.acquire()
    if cfg.enable or cfg.create_seed_checkpoint:
        ckpt = folder / cfg.folder
        writable_folder(ckpt, key="checkpoint.folder")
        free = shutil.disk_usage(ckpt).free
        if free < checkpoint_bytes:
            raise ConfigError(
                f"checkpoint.folder: {ckpt} has {free / GiB:.2f} GiB free, but a checkpoint of this model and "
                f"optimizer takes about {checkpoint_bytes / GiB:.2f} GiB; free space or point job.dump_folder "
                "elsewhere"
            )
        recover_partial_checkpoints(ckpt)
        if cfg.enable and cfg.load_step == -1:
            set_aside_damaged(ckpt)
    return lock


def recover_partial_checkpoints(folder: Path) -> None:
    """Publish each complete `step-<N>.partial` (it has .metadata) and remove the others, and what a pruning
    left half deleted (`step-<N>.pruned`)."""
    for child in sorted(folder.iterdir()):
        if _PRUNED_DIR.match(child.name):
            shutil.rmtree(child, ignore_errors=True)
            log(f"removed {child}: a pruned checkpoint, partly deleted")
            continue
        if not (match := _PARTIAL_DIR.match(child.name)):
            continue
        final = folder / f"step-{match.group(1)}"
        if is_checkpoint(child) and not final.exists():
            os.replace(child, final)
            log(f"published {final}: a run stopped after writing it, before it was published")
        else:
            shutil.rmtree(child, ignore_errors=True)
            log(f"removed {child}: an unfinished save")


def set_aside_damaged(folder: Path) -> None:
    """Rename the newest checkpoints that fail `verify` (a filesystem, not a crash, damaged them) to
    `step-<N>.damaged`, newest first until one passes, warning about each: the resume then continues
    from the newest complete one, and no later save or pruning touches them. Nothing is deleted."""
    for step, path in reversed(complete_checkpoints(folder)):
        try:
            verify(path, key="checkpoint.folder", fix="")
            return
        except ConfigError as e:
            set_aside(path, step, problem=e.problems[0].removeprefix("checkpoint.folder: "))


def set_aside(path: Path, step: int, *, problem: str) -> None:
    aside, again = path.with_name(f"step-{step}.damaged"), 1
    while aside.exists():
        aside, again = path.with_name(f"step-{step}.damaged-{again}"), again + 1
    os.replace(path, aside)
    warn(
        f"checkpoint.folder: skipped step {step}, it is damaged ({problem}); kept as {aside} (delete it once "
        "looked at), resuming from the newest complete checkpoint before it"
    )


def refuse_all_damaged(folder: Path) -> None:
    """A folder whose checkpoints were all set aside as damaged had progress: starting again from step 0 (or from
    initial_load_path) would lose it without a word, so the run stops and says what to do."""
    damaged = sorted(p.name for p in folder.iterdir() if _DAMAGED_DIR.match(p.name)) if folder.is_dir() else []
    if damaged and not complete_checkpoints(folder):
        raise ConfigError(
            f"checkpoint.folder: every checkpoint in {folder} is damaged ({', '.join(damaged)}); not starting again "
            f"from step 0. Copy a whole checkpoint there to resume from it, or move {folder} aside to start afresh"
        )


class OutOfSpace:
    """Turn a full disk during a save into one line, after removing what the save left behind."""

    def __init__(self, partial: Path):
        self.partial = partial

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, error: BaseException | None, tb: Any) -> bool:
        # torch.save's zip writer reports a full disk as "unexpected pos ...", not ENOSPC (2.13):
        # so a failed save next to an (almost) full disk counts as one too.
        if error is None or not (_is_out_of_space(error) or _free_bytes(self.partial) < 16 * 2**20):
            return False
        if rank() == 0:
            if self.partial.is_dir():
                shutil.rmtree(self.partial, ignore_errors=True)
            else:
                self.partial.unlink(missing_ok=True)
        raise DiskFull(
            f"checkpoint.folder: no space left on the device while writing {self.partial} (removed); free space or "
            "point job.dump_folder elsewhere, then rerun to resume from the last checkpoint"
        ) from None


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _is_out_of_space(error: BaseException | None) -> bool:
    """ENOSPC/EDQUOT anywhere in the exception, its causes, or the per-rank failures DCP collects."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return False


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def log(message: str) -> None:
    if rank() == 0:
        print(f"[checkpoint] {message}", flush=True)


def check_folder(path: Path) -> list[tuple[Path, str | None]]:
    """(step folder, None or what is damaged) for a step folder, or for every step of a checkpoint folder (set-aside
    ones included), without loading anything: what `verify` and `verify_contents` check, in one process."""
    steps = [path]
    if path.is_dir() and not is_checkpoint(path):
        named = [(m, p) for p in path.iterdir() if (m := _STEP_DIR.match(p.name) or _DAMAGED_DIR.match(p.name))]
        steps = [p for _, p in sorted(named, key=lambda mp: (int(mp[0].group(1)), mp[1].name))]
    checked = []
    for step in steps:
        try:
            verify(step, key="verify", fix="")
            if (step / MANIFEST).is_file():  # else sizes only, which `main` says
                verify_contents(step, key="verify", fix="")
            checked.append((step, None))
        except ConfigError as e:
            checked.append((step, e.problems[0].removeprefix("verify: ")))
    return checked
