"""DiLoCo's replicas: the world's data-parallel ranks cut into R blocks, each a whole
training job of its own, plus the one group that joins them.

The world's grid is Megatron's (docs/architecture.md, "The mesh"):

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

and replica k is the block of dp ranks [k dp/R, (k+1) dp/R): every pipeline stage,
sequence part and tp slice of those dp ranks. Consecutive dp ranks sit on neighbouring
ranks, so a replica fills whole hosts (with pp = 1, its tp x cp x dp/R ranks are one
run of consecutive ranks) and only the replicas' rare exchange crosses between them,
as INTELLECT-1 placed one replica per datacenter. Seen as a grid:

    (pp, R, dp/R, cp, tp)

a replica is one index of the R axis, and its ranks, kept in world order, number
themselves exactly as a mesh of (pp, dp/R, cp, tp) does. So each replica gets an
ordinary `Topology` over its own communicator, and tp, pp, cp, dp, ZeRO and hybrid
sharding inside it are today's code, unchanged. The `diloco` group is the R ranks that
differ only along the R axis: the same place in every replica, which hold the same
slice of the same parameters and average their pseudo-gradients.
"""

from typing import NamedTuple

import numpy as np

from numpitron.distributed.comm import Comm
from numpitron.distributed.topology import Mesh, Topology
from numpitron.distributed.watchdog import Watchdog


class Replicas(NamedTuple):
    count: int      # R
    index: int      # this rank's replica, k
    comm: Comm      # the diloco group: this rank's peers at the same place in the other replicas
    job: Comm       # every rank of every replica (the world)


def replica_grid(mesh: Mesh, count: int) -> np.ndarray:
    """The world's ranks as the grid (pp, R, dp/R, cp, tp)."""
    return np.arange(mesh.pp * mesh.dp * mesh.cp * mesh.tp).reshape(mesh.pp, count, mesh.dp // count,
                                                                     mesh.cp, mesh.tp)


def replica_topology(world, mesh: Mesh, count: int, collective_timeout: float | None = None,
                     ulysses: int = 1) -> Topology:
    """This rank's replica as a Topology of dp/R data-parallel ranks (R divides dp and
    hybrid sharding's S divides dp/R: layout.py), told its replicas (`topo.replicas`).
    Every rank makes the same two Split calls."""
    rank = world.Get_rank()
    grid = replica_grid(mesh, count)
    index = int(np.argwhere(grid == rank)[0][1])
    place = int(np.flatnonzero(grid[:, index].reshape(-1) == rank)[0])   # its rank inside its replica
    replica_world = world.Split(index, rank)                            # world order inside the replica
    across = world.Split(place, index) if count > 1 else None           # the diloco group
    shard = mesh.dp_shard if 0 < mesh.dp_shard < mesh.dp else 0        # HSDP inside a replica, else none
    inner = Mesh(mesh.tp, mesh.pp, mesh.dp // count, mesh.cp, mesh.ep, shard)
    topo = Topology.from_mesh(replica_world, inner, collective_timeout, ulysses=ulysses)
    watchdog = Watchdog(collective_timeout, rank)
    topo.replicas = Replicas(count, index, Comm(across, topo.stats, "diloco", watchdog),
                             Comm(world, topo.stats, "job", watchdog))
    return topo


def replicas_of(topo: Topology) -> Replicas:
    """The replicas a topology is one of: one, itself, when no DiLoCo split it."""
    return topo.replicas or Replicas(1, 0, topo.alone("diloco"), topo.world)
