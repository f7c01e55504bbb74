"""The run directory (--out-dir): claimed before training, never silently reused.

A fresh run into a directory that already holds a run would mix two runs in one
metrics history and prune the old run's checkpoints, so it is refused unless the user
says what they want: --resume continues it, --overwrite replaces what this library
wrote there (metrics.jsonl and its own checkpoints; anything else is left alone).
Rank 0 decides and every rank learns the outcome, so an error is one line.
"""

import os
from pathlib import Path

from numpitron.checkpoint.manifest import LATEST_NAME, iter_dirs
from numpitron.checkpoint.prune import clear_leftovers, partial_leftover, remove_tree, written_by_us
from numpitron.errors import UserError

METRICS_NAME = "metrics.jsonl"


def previous_run(out_dir: Path) -> list[str]:
    """What of a previous run the directory holds (empty: nothing)."""
    found = []
    metrics = out_dir / METRICS_NAME
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(METRICS_NAME)
    checkpoints = iter_dirs(out_dir / "checkpoints")
    if checkpoints:
        found.append(f"{len(checkpoints)} checkpoint(s)")
    return found


def claim(out_dir, resume: bool, overwrite: bool) -> list[str]:
    """Make `out_dir` ready for this run (rank 0 only). Returns notes to print; raises
    UserError with one line when the directory cannot be used."""
    out_dir, notes = Path(out_dir), []
    if resume and overwrite:
        raise UserError("--resume and --overwrite contradict each other: choose one")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".numpitron-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise UserError(f"cannot write to --out-dir {out_dir}: {error.strerror or error}") from None
    found = previous_run(out_dir)
    if found and not resume and not overwrite:
        raise UserError(f"--out-dir {out_dir} already holds a run ({', '.join(found)}): pass --resume to continue "
                        f"it, --overwrite to replace it, or choose another --out-dir")
    root = out_dir / "checkpoints"
    if overwrite and found:
        removed = [p for p in iter_dirs(root) if (written_by_us(p) or partial_leftover(p)) and remove_tree(p)]
        (out_dir / METRICS_NAME).unlink(missing_ok=True)
        (root / LATEST_NAME).unlink(missing_ok=True)
        clear_leftovers(root)
        notes.append(f"--overwrite: removed {METRICS_NAME} and {len(removed)} checkpoint(s) from {out_dir}")
    if resume:
        for leftover in [p for p in iter_dirs(root) if partial_leftover(p)]:
            if remove_tree(leftover):
                notes.append(f"removed {leftover}: a checkpoint whose deletion was interrupted (no manifest)")
    return notes


def claim_on_every_rank(topo, out_dir, resume: bool, overwrite: bool) -> None:
    """Rank 0 claims the directory and prints its notes; every rank raises its error."""
    outcome = None
    if topo.rank == 0:
        try:
            for note in claim(out_dir, resume, overwrite):
                print(note, flush=True)
            outcome = ("ok", "")
        except UserError as error:
            outcome = ("error", str(error))
    status, message = topo.world.broadcast_object(outcome)
    if status != "ok":
        raise UserError(message)
