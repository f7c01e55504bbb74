"""Deleting old checkpoints safely: only what this library wrote, never half of one.

A checkpoint to delete is first renamed to `.trash-iter_NNNNNN-<pid>` (one atomic
step), then removed: a crash in between leaves a trash directory, never an iter_
directory without its manifest, and the next save clears the trash. Nothing is
deleted that this library cannot show it wrote:

* an iter_ directory only if its manifest reads and every file in it is the manifest,
  a shard file the manifest lists, or the owner marker (a user's note dropped inside
  keeps it alive);
* a temporary directory only if it holds the owner marker, the first file written
  into every checkpoint directory;
* a temporary or trash name only if it matches the names this library makes.
"""

import os
import re
import shutil
from pathlib import Path

from numpitron.checkpoint.manifest import MANIFEST_NAME, TMP_PREFIX, iter_dirs, read_manifest
from numpitron.errors import UserError

TRASH_PREFIX = ".trash-"
OWNER_MARKER = ".numpitron-checkpoint"    # first file of every checkpoint directory we write
_OUR_TEMP = re.compile(r"^\.tmp-(iter_\d+|old-iter_\d+|latest)-\d+$")
_OUR_TRASH = re.compile(r"^\.trash-iter_\d+-\d+$")


def written_by_us(path: Path) -> bool:
    """A complete checkpoint directory holding nothing but what its manifest lists."""
    try:
        manifest = read_manifest(path)
    except UserError:
        return False
    listed = set(manifest.get("files") or {}) | {MANIFEST_NAME, OWNER_MARKER}
    found = {str(p.relative_to(path)) for p in path.rglob("*") if not p.is_dir()}
    return found <= listed


def remove_tree(path: Path) -> bool:
    """Rename to a trash name, then delete. False if it could not be removed (disk
    space is lost, never correctness)."""
    trash = path.parent / f"{TRASH_PREFIX}{path.name}-{os.getpid()}"
    try:
        os.replace(path, trash)
    except OSError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def clear_leftovers(root: Path) -> list[Path]:
    """Remove this library's temporary and trash entries from a crashed save or prune."""
    removed = []
    for entry in Path(root).iterdir() if Path(root).is_dir() else ():
        ours_dir = entry.is_dir() and not entry.is_symlink() and (
            _OUR_TRASH.match(entry.name) or (_OUR_TEMP.match(entry.name) and (entry / OWNER_MARKER).exists())
            or (entry.name.startswith(f"{TMP_PREFIX}old-") and written_by_us(entry)))
        ours_file = entry.is_file() and _OUR_TEMP.match(entry.name) and "latest" in entry.name
        if ours_dir:
            shutil.rmtree(entry, ignore_errors=True)
        elif ours_file:
            try:
                entry.unlink()
            except OSError:
                continue
        else:
            continue
        removed.append(entry)
    return removed


def prune_checkpoints(root: Path, keep: int, keep_also=()) -> list[Path]:
    """Delete all but the newest `keep` checkpoints this library wrote (never those in
    keep_also), and its crash leftovers. Returns what was deleted."""
    root = Path(root)
    spared = {Path(p).resolve() for p in keep_also if p is not None}
    ours = [p for p in iter_dirs(root) if written_by_us(p)]
    newest = {p.resolve() for p in ours[-keep:]}
    removed = [p for p in ours if p.resolve() not in spared | newest and remove_tree(p)]
    return removed + clear_leftovers(root)
