"""What one rank alone keeps between steps, saved beside the shards: compressed
gradients' error-feedback residuals and PowerSGD's Q (compression/optimizer.py's
`rank_state`). Unlike every other buffer of a checkpoint these differ from one
data-parallel rank to the next, so they are not laid out like the parameters but saved
as they are, one file per world rank (rank_state/rank-NNNNN.npz), and read back only
on the same mesh: a run on another mesh is refused with one line.

A checkpoint of a run without compression holds none: a compressed run resumed from it
starts with zero residuals. A compressed run resumed without compression drops them."""

import os
from pathlib import Path

import numpy as np

from numpitron.errors import UserError

RANK_STATE = "rank_state"


def _holders(trainer) -> list:
    return [(i, opt) for i, opt in enumerate(trainer.optimizers) if hasattr(opt, "rank_state")]


def _file(directory: Path, rank: int) -> Path:
    return Path(directory) / RANK_STATE / f"rank-{rank:05d}.npz"


def write_rank_state(directory: Path, trainer) -> None:
    holders = _holders(trainer)
    if not holders:
        return
    arrays = {f"{i}__{key}": value for i, opt in holders for key, value in opt.rank_state().items()}
    path = _file(directory, trainer.topo.world.rank)
    path.parent.mkdir(exist_ok=True)
    with open(path, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())


def read_rank_state(path: Path, manifest: dict, trainer):
    """A function that puts the saved state in (call it once everything is read), after
    checking the checkpoint was written by the same compression on the same mesh."""
    holders, saved = _holders(trainer), manifest["parallel_config"].get("grad_compression", "none")
    if not holders or saved == "none":
        return lambda: None
    topo, mine = trainer.topo, trainer.parallel_cfg
    mesh = {"tensor": topo.tp, "pipeline": topo.pp, "data": topo.dp, "context": topo.cp}
    was = (saved, manifest["parallel_config"].get("powersgd_rank"), manifest["mesh"])
    if was != (mine.grad_compression, mine.powersgd_rank, mesh):
        raise UserError(f"{path} holds each rank's error-feedback residual of --grad-compression {saved} "
                        f"(PowerSGD rank {was[1]}) on mesh {was[2]}: resume with the same compression on the same "
                        f"mesh, or with --grad-compression none to drop the residuals")
    try:
        with np.load(_file(path, topo.world.rank)) as f:
            arrays = {key: f[key] for key in f.files}
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read {_file(path, topo.world.rank)}: {error}") from None

    def restore():
        for i, opt in holders:
            prefix = f"{i}__"
            opt.load_rank_state({k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)})
    return restore
