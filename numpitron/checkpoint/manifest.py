"""The on-disk format of a checkpoint: its layout and its manifest.json.

    ROOT/latest                      text: the name of the newest checkpoint directory
    ROOT/iter_000123/manifest.json   written last: a directory without it is incomplete

Format 2 (sharded.py): ROOT/iter_000123/shards/rank-NNNNN.bin, one file per writing
rank, and a manifest that maps their bytes to slices of logical tensors and records
every file's size and CRC-32; a reader checks them before trusting a byte. Format 1
(one .npy per logical tensor, written by numpitron 0.1's first checkpoints and its
`convert import`) is no longer read: docs/16-checkpoints-and-sampling.md says how to
convert one.
"""

import json
import os
import re
from pathlib import Path

from numpitron.errors import UserError

FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
TMP_PREFIX = ".tmp-"                 # anything named so in ROOT is a leftover of a crash
REQUIRED_KEYS = ("format_version", "model_config", "iteration", "adam_step", "tensors")
_ITER_DIR = re.compile(r"^iter_(\d+)$")


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:06d}"


def iteration_of(path: Path) -> int | None:
    """The iteration in an `iter_NNNNNN` directory name, None for any other name."""
    match = _ITER_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def iter_dirs(root: Path) -> list[Path]:
    """Every iter_ directory in root (complete or not), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and iteration_of(p) is not None]
    return sorted(found, key=iteration_of)


def is_latest_pointer(path: Path) -> bool:
    """Whether `path` is what this library writes as ROOT/latest: a small regular file
    holding one iter_ name."""
    path = Path(path)
    if path.is_symlink() or not path.is_file() or path.stat().st_size > 64:
        return False
    try:
        return _ITER_DIR.match(path.read_text().strip()) is not None
    except (OSError, UnicodeDecodeError):
        return False


def is_complete(path: Path) -> bool:
    # The manifest is the last file written into the temporary directory before the
    # rename, so its presence means every tensor file is already there.
    return (Path(path) / MANIFEST_NAME).is_file()


def write_json_synced(path: Path, obj) -> None:
    """Write JSON and fsync it, so a rename that follows never exposes a partial file."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path) -> dict:
    """The validated manifest of the checkpoint directory `path`."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"checkpoint not found: {path} is not a directory")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise UserError(f"incomplete checkpoint {path}: {MANIFEST_NAME} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"unreadable checkpoint manifest {manifest_path}: {error}") from None
    if not isinstance(manifest, dict):
        raise UserError(f"corrupt checkpoint manifest {manifest_path}: not a JSON object")
    missing = [key for key in REQUIRED_KEYS if key not in manifest]
    if missing:
        raise UserError(f"corrupt checkpoint manifest {manifest_path}: missing {', '.join(missing)}")
    version = manifest["format_version"]
    if not isinstance(version, int) or version < 1:
        raise UserError(f"corrupt checkpoint manifest {manifest_path}: format_version {version!r}")
    if version < FORMAT_VERSION:
        raise UserError(f"checkpoint {path} is in format {version} (one .npy per tensor), which this numpitron "
                        f"no longer reads: convert it as docs/16-checkpoints-and-sampling.md says (older checkpoints)")
    if version > FORMAT_VERSION:
        raise UserError(f"checkpoint format version {version} is newer than this numpitron supports "
                        f"({FORMAT_VERSION}); upgrade numpitron")
    if not isinstance(manifest["model_config"], dict) or not isinstance(manifest["tensors"], dict):
        raise UserError(f"corrupt checkpoint manifest {manifest_path}: model_config and tensors must be objects")
    if not all(isinstance(entry, dict) for entry in manifest["tensors"].values()):
        raise UserError(f"corrupt checkpoint manifest {manifest_path}: every tensor entry must be an object")
    return manifest
