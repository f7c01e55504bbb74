"""Writing checkpoints: gather full tensors to world rank 0, write them atomically.

Rank 0 writes into `ROOT/.tmp-<name>-<pid>`, fsyncs every file, writes the manifest
last, then renames the directory into place: a crash at any moment leaves either
the previous checkpoint or the new one, never half of one. Leftover temporaries
are removed by the next save, and old checkpoints pruned (prune.py) only when this
library can show it wrote them.
"""

import os
import shutil
import time
from pathlib import Path

import numpy as np

from numpitron.checkpoint.manifest import (FORMAT_VERSION, LATEST_NAME, MANIFEST_NAME, TMP_PREFIX,
                                           describe_tensor_file, iter_dir_name, tensor_relpath, write_json_synced)
from numpitron.checkpoint.prune import OWNER_MARKER, prune_checkpoints
from numpitron.config import to_dict
from numpitron.distributed.gather import gather_stores
from numpitron.errors import UserError


def save_checkpoint(root, trainer, keep: int = 2, protect: Path | None = None, extra: dict | None = None) -> Path | None:
    """Collective over the world: every rank calls it and gets the checkpoint's path.

    Keeps the newest `keep` checkpoints, plus `protect` (the best one so far) and the
    one just written. `extra` (JSON-able) is stored in the manifest as it is: the
    training loop records the tokenizer and why the checkpoint was saved. If rank 0 cannot write, every rank raises UserError.
    """
    if keep < 1:
        raise UserError(f"keep must be at least 1 checkpoint, got {keep}")
    root, topo = Path(root), trainer.topo
    flats = []
    for store, optimizer in zip(trainer.model.stores, trainer.optimizers):   # experts are a second store
        m, v = optimizer.full_moments()              # collective over dp (ZeRO-1)
        flats.append({"params": store.data, "adam_m": m, "adam_v": v})
    full = gather_stores(trainer.model, topo, flats)
    status = None
    if topo.rank == 0:
        try:
            path = write_checkpoint(root, trainer.iteration, full, {**checkpoint_fields(trainer), **(extra or {})})
            prune_checkpoints(root, keep, keep_also=(path, protect))
            status = ("ok", str(path))
        except OSError as error:
            status = ("error", f"cannot write checkpoint to {root}: {error}")
        except Exception as error:
            # A bug: the other ranks learn of it instead of hanging; rank 0 keeps the traceback.
            topo.world.broadcast_object(("error", f"checkpoint save failed on rank 0: {error!r}"))
            raise
    # Doubles as the barrier: nobody returns before rank 0 has finished writing.
    outcome, detail = topo.world.broadcast_object(status)
    if outcome != "ok":
        raise UserError(detail)
    return Path(detail)


def checkpoint_fields(trainer) -> dict:
    """Everything in the manifest except the tensor table."""
    topo, seed = trainer.topo, trainer.train_cfg.seed
    best = trainer.best_val_loss
    return {
        "model_config": to_dict(trainer.model_cfg),
        "parallel_config": to_dict(trainer.parallel_cfg),
        "mesh": {"tensor": topo.tp, "pipeline": topo.pp, "data": topo.dp, "context": topo.cp},     # informative: any mesh loads it
        "train_config": to_dict(trainer.train_cfg),
        "iteration": int(trainer.iteration),
        "adam_step": int(trainer.optimizer.adam.step_count),
        # JSON has no infinity: "no evaluation yet" is stored as null.
        "best_val_loss": float(best) if best is not None and np.isfinite(best) else None,
        "seed": seed,
        # Batches are a pure function of (seed, iteration): no generator state to save.
        "data_state": {"sampler": "seeded-per-iteration", "seed": seed, "next_iteration": int(trainer.iteration)},
    }


def write_checkpoint(root: Path, iteration: int, tensors: dict, fields: dict) -> Path:
    """Write {kind: {name: full array}} and the manifest as ROOT/iter_NNNNNN; point
    ROOT/latest at it. Returns the directory. Needs no MPI (used by import_npz too)."""
    root.mkdir(parents=True, exist_ok=True)
    name = iter_dir_name(iteration)
    tmp = root / f"{TMP_PREFIX}{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    (tmp / OWNER_MARKER).touch()            # proves to a later prune that this library made it
    try:
        _write_contents(tmp, tensors, fields)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)      # e.g. a full disk: give the space back now
        raise
    final = root / name
    _install(tmp, final)
    write_latest(root, name)
    return final


def _write_contents(directory: Path, tensors: dict, fields: dict) -> None:
    table = {}
    for kind, arrays in tensors.items():
        (directory / kind).mkdir()
        for param_name, array in arrays.items():
            relpath = tensor_relpath(kind, param_name)
            _write_npy_synced(directory / relpath, array)
            table[relpath] = describe_tensor_file(directory / relpath, array)
        _fsync_dir(directory / kind)
    manifest = {"format_version": FORMAT_VERSION, **fields, "tensors": table, "created_unix": time.time()}
    write_json_synced(directory / MANIFEST_NAME, manifest)      # last: marks the directory complete
    _fsync_dir(directory)


def _install(tmp: Path, final: Path) -> None:
    """Rename tmp to final. POSIX cannot rename onto a non-empty directory, so a
    re-save of the same iteration moves the old one aside first and deletes it after."""
    if final.exists():
        old = final.parent / f"{TMP_PREFIX}old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_latest(root: Path, name: str) -> None:
    """ROOT/latest names the newest checkpoint; replaced atomically, never half-written."""
    tmp = root / f"{TMP_PREFIX}{LATEST_NAME}-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST_NAME)
    _fsync_dir(root)


def _write_npy_synced(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make the directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

