"""The on-disk format of a checkpoint: its layout, manifest.json and per-file checks.

    ROOT/latest                      text: the name of the newest checkpoint directory
    ROOT/iter_000123/manifest.json   written last: a directory without it is incomplete

Format 2 (what training writes; sharded.py): ROOT/iter_000123/shards/rank-NNNNN.bin,
one file per writing rank, and a manifest that maps their bytes to slices of logical
tensors. Format 1 (what import_npz writes, and older versions did; still read):
ROOT/iter_000123/params/<name>.npy, adam_m/<name>.npy, adam_v/<name>.npy, one full
logical tensor each. Either way the manifest records every file's size and CRC-32,
and a reader checks them before trusting a byte of it.
"""

import json
import os
import re
from pathlib import Path

import numpy as np

from numpitron.checksum import file_crc32 as file_checksum
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


def is_complete(path: Path) -> bool:
    # The manifest is the last file written into the temporary directory before the
    # rename, so its presence means every tensor file is already there.
    return (Path(path) / MANIFEST_NAME).is_file()


def tensor_relpath(kind: str, name: str) -> str:
    return f"{kind}/{name}.npy"


def describe_tensor_file(path: Path, array: np.ndarray) -> dict:
    """The manifest entry of a freshly written tensor file."""
    return {"shape": list(array.shape), "dtype": array.dtype.name,
            "bytes": Path(path).stat().st_size, "crc32": file_checksum(path)}


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
    if version > FORMAT_VERSION:
        raise UserError(f"checkpoint format version {version} is newer than this numpitron supports "
                        f"({FORMAT_VERSION}); upgrade numpitron")
    if not isinstance(manifest["model_config"], dict) or not isinstance(manifest["tensors"], dict):
        raise UserError(f"corrupt checkpoint manifest {manifest_path}: model_config and tensors must be objects")
    if not all(isinstance(entry, dict) for entry in manifest["tensors"].values()):
        raise UserError(f"corrupt checkpoint manifest {manifest_path}: every tensor entry must be an object")
    return manifest


def verify_tensor_file(directory: Path, relpath: str, entry: dict) -> np.ndarray:
    """Check one tensor file against its manifest entry and map it read-only.

    Order matters for the messages: existence, size and checksum say whether the
    bytes are the ones that were written; the header then says whether they could
    be loaded without pickle and have the promised shape and dtype.
    """
    path = Path(directory) / relpath
    if not path.is_file():
        raise UserError(f"corrupt checkpoint {directory}: {relpath} is missing")
    size = path.stat().st_size
    if size != entry.get("bytes"):
        raise UserError(f"corrupt checkpoint {directory}: {relpath} has {size} bytes, "
                        f"the manifest says {entry.get('bytes')} (truncated or overwritten?)")
    if "crc32" not in entry:
        raise UserError(f"corrupt checkpoint manifest in {directory}: {relpath} has no checksum")
    if file_checksum(path) != entry["crc32"]:
        raise UserError(f"corrupt checkpoint {directory}: {relpath} fails its crc32 checksum")
    dtype, shape = _npy_header(path, directory, relpath)
    if dtype.hasobject:
        raise UserError(f"checkpoint {directory}: {relpath} holds Python objects and would need pickle; "
                        f"refusing to load")
    if list(shape) != list(entry.get("shape", [])) or dtype.name != entry.get("dtype"):
        raise UserError(f"corrupt checkpoint {directory}: {relpath} is {dtype.name}{list(shape)}, "
                        f"the manifest says {entry.get('dtype')}{entry.get('shape')}")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as error:
        raise UserError(f"corrupt checkpoint {directory}: cannot load {relpath}: {error}") from None


def _npy_header(path: Path, directory: Path, relpath: str):
    """(dtype, shape) from a .npy header, read without touching the data."""
    fmt = np.lib.format
    try:
        with open(path, "rb") as f:
            major, _ = fmt.read_magic(f)
            read_header = fmt.read_array_header_1_0 if major == 1 else fmt.read_array_header_2_0
            shape, _, dtype = read_header(f)
    except (OSError, ValueError) as error:
        raise UserError(f"corrupt checkpoint {directory}: {relpath} is not a .npy file ({error})") from None
    return np.dtype(dtype), shape
