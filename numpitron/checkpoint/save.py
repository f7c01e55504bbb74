"""Writing checkpoints atomically: every rank its own shard, in parallel.

All ranks write into `ROOT/.tmp-<name>-<pid>` and fsync; world rank 0 writes the
manifest last, then renames the directory into place: a crash at any moment leaves
either the previous checkpoint or the new one, never half of one. Leftover
temporaries are removed by the next save, and old checkpoints pruned (prune.py) only
when this library can show it wrote them; a directory or `latest` file of the same
name that it cannot show it wrote is never replaced.
"""

import os
import shutil
import time
from pathlib import Path

import numpy as np

from numpitron.checkpoint.load import routing_bias
from numpitron.checkpoint.manifest import (FORMAT_VERSION, LATEST_NAME, MANIFEST_NAME, TMP_PREFIX, is_latest_pointer,
                                           iter_dir_name, write_json_synced)
from numpitron.checkpoint.rank_state import write_rank_state
from numpitron.checkpoint.prune import OWNER_MARKER, prune_checkpoints, written_by_us
from numpitron.checkpoint.sharded import SHARDS, merge_rank_tables, write_rank_shard, write_shard
from numpitron.config import to_dict
from numpitron.errors import UserError


def save_checkpoint(root, trainer, keep: int = 2, protect: Path | None = None, extra: dict | None = None) -> Path | None:
    """Collective over the world: every rank calls it and gets the checkpoint's path.

    Every rank writes its own shard file into one temporary directory (sharded.py;
    across hosts that directory must be on a filesystem they share); world rank 0
    then writes the manifest and renames the directory into place. Keeps the newest
    `keep` checkpoints, plus `protect` (the best one so far) and the one just written.
    `extra` (JSON-able) is stored in the manifest as it is: the training loop records
    the tokenizer and why the checkpoint was saved. If any rank cannot write, every
    rank raises UserError and the previous checkpoints stay as they were.
    """
    if keep < 1:
        raise UserError(f"keep must be at least 1 checkpoint, got {keep}")
    root, world = Path(root), trainer.topo.world
    tmp = None
    if world.rank == 0:
        try:
            tmp = str(_fresh_temporary(root, iter_dir_name(trainer.iteration)))
        except OSError as error:
            tmp = OSError(f"cannot write checkpoint to {root}: {error}")
    tmp = world.broadcast_object(tmp)
    if isinstance(tmp, OSError):
        raise UserError(str(tmp))
    try:
        table = write_rank_shard(Path(tmp), trainer)
        write_rank_state(Path(tmp), trainer)         # error-feedback residuals: one file a rank
    except OSError as error:
        table = f"cannot write checkpoint to {root} (rank {world.rank}): {error}"
    except Exception as error:       # a bug: the others learn of it instead of hanging
        table = f"checkpoint save failed on rank {world.rank}: {error!r}"
    tables = world.gather_object(table)
    status = None
    if world.rank == 0:
        status = _finish(root, Path(tmp), trainer, tables, keep, protect, extra)
    # Doubles as the barrier: nobody returns before rank 0 has installed the checkpoint.
    outcome, detail = world.broadcast_object(status)
    if outcome != "ok":
        raise UserError(detail)
    return Path(detail)


def _fresh_temporary(root: Path, name: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{TMP_PREFIX}{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / SHARDS).mkdir(parents=True)
    (tmp / OWNER_MARKER).touch()            # proves to a later prune that this library made it
    return tmp


def _finish(root: Path, tmp: Path, trainer, tables: list, keep: int, protect, extra) -> tuple:
    """World rank 0, once every rank's shard is on disk: the manifest, the rename."""
    failures = [t for t in tables if isinstance(t, str)]
    if failures:
        shutil.rmtree(tmp, ignore_errors=True)
        return ("error", failures[0])
    try:
        final = _complete(root, tmp, trainer.iteration, {**checkpoint_fields(trainer), **(extra or {})}, tables)
        prune_checkpoints(root, keep, keep_also=(final, protect))
        return ("ok", str(final))
    except UserError as error:
        return ("error", str(error))
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        return ("error", f"cannot write checkpoint to {root}: {error}")
    except Exception as error:       # a bug: the others learn of it instead of hanging
        shutil.rmtree(tmp, ignore_errors=True)
        return ("error", f"checkpoint save failed on rank 0: {error!r}")


def _complete(root: Path, tmp: Path, iteration: int, fields: dict, tables: list) -> Path:
    """The manifest (written last: it marks the directory complete), the rename into
    place, then `latest`. Returns the checkpoint's directory."""
    manifest = {"format_version": FORMAT_VERSION, **fields, **merge_rank_tables(tables), "created_unix": time.time()}
    _fsync_dir(tmp / SHARDS)
    write_json_synced(tmp / MANIFEST_NAME, manifest)
    _fsync_dir(tmp)
    final = root / iter_dir_name(iteration)
    _install(tmp, final)
    write_latest(root, final.name)
    return final


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
        # Aux-loss-free balancing's bias: no optimizer state, the same on every rank and
        # for any mesh, small (n_layers x E): stored here whole (JSON floats round-trip).
        "moe_routing_bias": routing_bias(trainer.model).tolist(),
        # Mixed precision's dynamic loss scale (docs/07-numbers.md): a resumed fp16 run
        # scales, skips and doubles as the uninterrupted one would.
        "loss_scaler": trainer.scaler.checkpoint() if trainer.scaler else None,
        # FP8's amax histories (precision/fp8.py): agreed over the world, so the same on every
        # rank, by layer name: any mesh finds its layers' histories.
        "fp8_amax_history": trainer.fp8.state() if trainer.fp8 else {},
    }


def write_serial_checkpoint(root: Path, iteration: int, fields: dict, sources) -> Path:
    """One process, no MPI: write `sources` (sharded.write_shard's) as the one shard of
    checkpoint ROOT/iter_NNNNNN, atomically like save_checkpoint; point ROOT/latest at
    it. Returns the directory. `convert import` writes its checkpoints this way."""
    tmp = _fresh_temporary(root, iter_dir_name(iteration))
    try:
        return _complete(root, tmp, iteration, fields, [write_shard(tmp, 0, sources)])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)      # e.g. a full disk: give the space back now
        raise


def _install(tmp: Path, final: Path) -> None:
    """Rename tmp to final. POSIX cannot rename onto a non-empty directory, so a
    re-save of the same iteration moves the old one aside first and deletes it after;
    a directory of that name this library cannot show it wrote (a user's file inside)
    is refused instead, and the new checkpoint given up."""
    if final.exists() or final.is_symlink():
        if not written_by_us(final):
            shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(f"cannot write checkpoint {final}: a directory of that name holds files numpitron "
                            f"did not write; move it away")
        old = final.parent / f"{TMP_PREFIX}old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_latest(root: Path, name: str) -> None:
    """ROOT/latest names the newest checkpoint; replaced atomically, never half-written,
    and only if it is what this library writes there (a file holding an iter_ name)."""
    latest = root / LATEST_NAME
    if (latest.exists() or latest.is_symlink()) and not is_latest_pointer(latest):
        raise UserError(f"cannot point {latest} at {name}: it is not a file numpitron wrote; move it away")
    tmp = root / f"{TMP_PREFIX}{LATEST_NAME}-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, latest)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    """Make the directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

