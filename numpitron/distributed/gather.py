"""Moving between a mesh's shards and full logical tensors.

`gather_full` collects any flat buffer laid out like a stage's parameters
(the parameters themselves, Adam's m or v) into one full tensor per parameter
name on world rank 0: a gather over tp within data replica 0 of every stage,
then each stage's leader sends its tensors to rank 0. `fill_from_full` is the
inverse: each rank cuts its own shard out of full tensors (memory-mapped files,
typically), so any full set of tensors loads onto any mesh.
"""

import numpy as np

from numpitron.nn.param import pad_to_full

GATHER_TAG = 77


def saved_params(model):
    """The stage's parameters that are saved: all but the last stage's copy of the
    tied token embedding (the first stage's copy is the same tensor)."""
    from numpitron.model import TOKEN_EMBEDDING
    return [p for p in model.store.params if model.first or p.name != TOKEN_EMBEDDING]


def _gather_over_tp(param, local, tp_comm):
    """Full logical tensor on tp rank 0 (None elsewhere)."""
    if param.split_axis is None:
        full = local
    else:
        moved = np.ascontiguousarray(np.moveaxis(local, param.split_axis, 0))
        stacked = np.empty((tp_comm.size * moved.shape[0],) + moved.shape[1:], local.dtype) if tp_comm.rank == 0 else None
        tp_comm.gather(moved, stacked)
        full = None if tp_comm.rank != 0 else np.moveaxis(stacked, 0, param.split_axis)
    if tp_comm.rank != 0:
        return None
    return np.ascontiguousarray(full[tuple(slice(0, n) for n in param.logical_shape)])


def gather_full(model, topo, flats: dict) -> dict | None:
    """flats: {kind: flat buffer laid out like model.store.data}. Collective over the
    world. Returns {kind: {param name: full logical array}} on world rank 0."""
    local = {}
    if topo.dp_cp_rank == 0:
        for kind, flat in flats.items():
            tensors = {p.name: _gather_over_tp(p, model.store.view(flat, p.name), topo.tp_comm)
                       for p in saved_params(model)}
            local[kind] = tensors
    world = topo.world
    is_stage_leader = topo.dp_cp_rank == 0 and topo.tp_rank == 0
    if topo.rank != 0:
        if is_stage_leader:
            index = [(kind, name, a.shape, a.dtype.str) for kind, t in local.items() for name, a in t.items()]
            world.mpi.send(index, dest=0, tag=GATHER_TAG)        # small control data
            for kind, name, _, _ in index:
                world.send(local[kind][name], 0, GATHER_TAG)
        return None
    for stage in range(1, topo.pp):
        leader = topo.world_rank_of(stage, 0, 0)
        for kind, name, shape, dtype in world.mpi.recv(source=leader, tag=GATHER_TAG):
            local.setdefault(kind, {})[name] = world.recv(np.empty(shape, np.dtype(dtype)), leader, GATHER_TAG)
    return local


def fill_from_full(model, flat, get_full) -> None:
    """Write this rank's shard of every parameter into `flat` (laid out like
    model.store.data); get_full(name) returns the full logical tensor (array-like)."""
    for p in model.store.params:
        full = np.asarray(get_full(p.name))
        if full.shape != p.logical_shape:
            raise ValueError(f"{p.name}: expected shape {p.logical_shape}, got {full.shape}")
        model.store.view(flat, p.name)[...] = pad_to_full(full, p.full_shape)[p.tp_slice()]
