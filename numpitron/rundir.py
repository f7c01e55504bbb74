"""The run directory (--out-dir): claimed before training, never silently reused.

A fresh run into a directory that already holds a run would mix two runs in one
metrics history and prune the old run's checkpoints, so it is refused unless the user
says what they want: --resume continues it, --overwrite replaces what this library
wrote there (metrics.jsonl and its own checkpoints; anything else is left alone).
Two jobs never share a directory: the first holds a lock on it (`RunLock`) for as
long as it runs, and a second is refused with one line naming the holder. Rank 0
decides and every rank learns the outcome, so an error is one line.
"""

import fcntl
import os
import re
import socket
import stat
import tempfile
import time
from pathlib import Path

from numpitron.checkpoint.load import latest_checkpoint
from numpitron.checkpoint.manifest import LATEST_NAME, is_latest_pointer, iter_dirs, iteration_of
from numpitron.checkpoint.prune import clear_leftovers, remove_tree, written_by_us
from numpitron.errors import UserError

METRICS_NAME = "metrics.jsonl"
LOCK_NAME = ".numpitron-lock"
_METRICS_TEMPORARY = re.compile(r"^\.metrics\.jsonl\.\d+\.tmp$")     # metrics.MetricsLog's rewrite


class RunLock:
    """An exclusive lock on the run directory (flock on its lock file), held until
    `release` or until the process ends, however it ends: the kernel drops the lock
    of a killed process, so a crash never leaves the directory locked."""

    def __init__(self, out_dir: Path):
        self.fd = _open_lock_file(out_dir / LOCK_NAME)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            raise UserError(f"--out-dir {out_dir} is in use by another run ({holder}): wait for it to end "
                            f"or choose another --out-dir") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                           f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)

    def release(self) -> None:
        os.close(self.fd)                 # closing the last descriptor drops the flock


_OUR_LOCK_TEXT = re.compile(rb"^(pid \d+ on .* since [-\d: ]+\n)?$")


def _open_lock_file(path: Path) -> int:
    """The lock file's descriptor, made or reopened; never through a symbolic link, and
    never a file that is not a lock numpitron wrote (a directory, a device, a hard link
    to other data, text of the user's): the lock's text is rewritten, so such a file
    would be a user's data lost. Refused in one line, left as it is."""
    def refuse(what: str):
        raise UserError(f"{path} is {what}, not the lock file numpitron writes: move it away")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as error:
        if os.path.islink(path):
            refuse("a symbolic link")
        if os.path.isdir(path):
            refuse("a directory")
        raise UserError(f"cannot open {path}: {error.strerror or error}") from None
    info = os.fstat(fd)
    problem = ("not a regular file" if not stat.S_ISREG(info.st_mode) else
               "a hard link to another file" if info.st_nlink > 1 else
               "text numpitron did not write" if not _OUR_LOCK_TEXT.match(os.pread(fd, 400, 0)) else None)
    if problem:
        os.close(fd)
        refuse(problem)
    return fd


def checkpoint_roots(out_dir: Path) -> list[Path]:
    """Where a run's checkpoints live: CHECKPOINTS, and a DiLoCo run's replica-K in it
    (one per replica: diloco/replicas.py)."""
    root = out_dir / "checkpoints"
    return [root] + sorted(p for p in root.glob("replica-*") if p.is_dir() and not p.is_symlink())


def previous_run(out_dir: Path) -> list[str]:
    """What of a previous run the directory holds (empty: nothing)."""
    found = []
    metrics = out_dir / METRICS_NAME
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(METRICS_NAME)
    checkpoints = [p for root in checkpoint_roots(out_dir) for p in iter_dirs(root)]
    if checkpoints:
        found.append(f"{len(checkpoints)} checkpoint(s)")
    return found


def claim(out_dir, resume: bool, overwrite: bool) -> tuple[RunLock, list[str]]:
    """Make `out_dir` ready for this run (rank 0 only). Returns the directory's lock
    (keep it for the run) and notes to print; raises UserError with one line when the
    directory cannot be used."""
    out_dir, notes = Path(out_dir), []
    if resume and overwrite:
        raise UserError("--resume and --overwrite contradict each other: choose one")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".numpitron-probe-", dir=out_dir)     # a new name: nothing followed
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise UserError(f"cannot write to --out-dir {out_dir}: {error.strerror or error}") from None
    lock = RunLock(out_dir)
    try:
        notes = _prepare(out_dir, resume, overwrite)
    except BaseException:
        lock.release()
        raise
    return lock, notes


def _prepare(out_dir: Path, resume: bool, overwrite: bool) -> list[str]:
    """Under the lock: refuse a used directory, or clear what --overwrite replaces, and
    the temporaries a killed run of ours left behind."""
    notes = []
    for leftover in (p for p in out_dir.iterdir() if _METRICS_TEMPORARY.match(p.name) and p.is_file()):
        leftover.unlink()
        notes.append(f"removed {leftover}: a metrics rewrite cut short by a kill")
    found = previous_run(out_dir)
    if found and not resume and not overwrite:
        raise UserError(f"--out-dir {out_dir} already holds a run ({', '.join(found)}): pass --resume to continue "
                        f"it, --overwrite to replace it, or choose another --out-dir")
    for root in checkpoint_roots(out_dir):
        # A directory named like a checkpoint this run may write, holding a user's files,
        # would stop the run at that save: refuse now, before anything is touched.
        resumed_from = latest_checkpoint(root) if resume else None
        start = -1 if resumed_from is None else iteration_of(resumed_from)
        theirs = [p for p in iter_dirs(root) if iteration_of(p) > start and not written_by_us(p)]
        if theirs:
            raise UserError(f"{theirs[0]} holds files numpitron did not write, where this run would save a "
                            f"checkpoint: move it away first")
    removed = []
    for root in checkpoint_roots(out_dir) if overwrite and found else []:
        removed += [p for p in iter_dirs(root) if remove_tree(p)]
        if is_latest_pointer(root / LATEST_NAME):
            (root / LATEST_NAME).unlink()
        clear_leftovers(root)
    if overwrite and found:
        (out_dir / METRICS_NAME).unlink(missing_ok=True)
        notes.append(f"--overwrite: removed {METRICS_NAME} and {len(removed)} checkpoint(s) from {out_dir}")
    return notes


def claim_on_every_rank(topo, out_dir, resume: bool, overwrite: bool) -> RunLock | None:
    """Rank 0 claims the directory and prints its notes; every rank raises its error.
    Returns the lock on rank 0 (None elsewhere): hold it until the run ends."""
    outcome, lock = None, None
    if topo.job.rank == 0:
        try:
            lock, notes = claim(out_dir, resume, overwrite)
            for note in notes:
                print(note, flush=True)
            outcome = ("ok", "")
        except UserError as error:
            outcome = ("error", str(error))
    status, message = topo.job.broadcast_object(outcome)
    if status != "ok":
        raise UserError(message)
    return lock
