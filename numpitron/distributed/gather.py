"""Moving between a mesh's shards and full logical tensors.

`gather_full` collects any flat buffer laid out like a stage's parameters
(the parameters themselves, Adam's m or v) into one full tensor per parameter
name on world rank 0: a gather over tp within data replica 0 of every stage,
then each stage's leader sends its tensors to rank 0. Experts are held by the ep
ranks of a data replica, each its own: `gather_stores` gathers them from the ep
ranks of replica 0 as well. (The inverse, cutting a rank's shard out of full
tensors, is `checkpoint.sharded.cut_range`.)
"""

import numpy as np

GATHER_TAG = 77


def saved_params(model, store=None):
    """The parameters of `store` (default: the dense one) that are saved: all but a copy
    of a tensor held elsewhere too, which the model marks by leaving it out of the norm
    (`Param.in_norm`): the last stage's copy of the tied token embedding, the first
    stage's being the same tensor."""
    return [p for p in (store or model.store).params if p.in_norm]


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


def _gather(store, params, topo, flats: dict, holder: bool, leaders) -> dict | None:
    """The holders (one copy of the store's tensors between them) gather over tp; their
    tp rank 0, the leader, sends to world rank 0, which receives from `leaders`."""
    local = {}
    if holder:
        for kind, flat in flats.items():
            local[kind] = {p.name: _gather_over_tp(p, store.view(flat, p.name), topo.tp_comm) for p in params}
    world = topo.world
    if topo.rank != 0:
        if holder and topo.tp_rank == 0:
            index = [(kind, name, a.shape, a.dtype.str) for kind, t in local.items() for name, a in t.items()]
            world.mpi.send(index, dest=0, tag=GATHER_TAG)        # small control data
            for kind, name, _, _ in index:
                world.send(local[kind][name], 0, GATHER_TAG)
        return None
    for leader in leaders:
        if leader == 0:
            continue
        for kind, name, shape, dtype in world.mpi.recv(source=leader, tag=GATHER_TAG):
            local.setdefault(kind, {})[name] = world.recv(np.empty(shape, np.dtype(dtype)), leader, GATHER_TAG)
    return local


def gather_full(model, topo, flats: dict) -> dict | None:
    """flats: {kind: flat buffer laid out like model.store.data}. Collective over the
    world. Returns {kind: {param name: full logical array}} on world rank 0."""
    leaders = [topo.world_rank_of(stage, 0, 0) for stage in range(topo.pp)]
    return _gather(model.store, saved_params(model), topo, flats, topo.dp_cp_rank == 0, leaders)


def gather_stores(model, topo, flats: list[dict]) -> dict | None:
    """flats: one {kind: flat buffer} per store of model.stores. Like gather_full, over
    every store: the experts come from ep group 0."""
    full = gather_full(model, topo, flats[0])
    for store, store_flats in zip(model.stores[1:], flats[1:]):
        # ep group 0 holds every expert: dp x cp ranks 0 .. ep - 1 (topology.py)
        leaders = [topo.world_rank_of(stage, e // topo.cp, 0, e % topo.cp) for stage in range(topo.pp)
                   for e in range(topo.ep)]
        experts = _gather(store, store.params, topo, store_flats, topo.expert_dp_rank == 0, leaders)
        for kind, tensors in (experts or {}).items():
            full[kind].update(tensors)
    return full
