"""The process mesh: world ranks laid out as a grid [pp, dp, cp, tp], tp fastest.

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

Tensor-parallel peers are neighbouring ranks (on a cluster: one node, the fastest
links), then context-parallel peers, then data replicas; pipeline stages are
outermost. This is Megatron-LM's order.

Expert parallelism adds no axis: the ep group is carved out of dp x cp, the ranks
that hold different tokens of one model replica (Megatron-Core's "MoE parallel
folding", Liu et al. 2025: for an MLP a cp rank is one more data rank). Numbered
dp_cp_rank = dp_rank * cp + cp_rank, ep consecutive of them form an ep group and
split the experts among them; ranks with the same position in their ep group
(dp_cp_rank % ep) hold the same experts and average their gradients (the expert_dp
group, dp x cp / ep ranks). With cp = 1 this is ep inside dp.

Context parallelism may split its group once more (context_parallel/ulysses.py): U consecutive
cp ranks form a Ulysses group (cp_ulysses, an all-to-all over heads), and ranks with
the same place in their Ulysses groups form a ring (cp_ring, cp / U ranks). The ring
alone is U = 1, Ulysses alone U = cp; both groups exist on every mesh.

Hybrid sharding (HSDP) adds no axis either: dp splits into dp / S replicas of S
consecutive dp ranks each (`--data-parallel-shard-size S`, docs/09-zero-2-and-3.md).
ZeRO shards over the cp x S ranks of one replica (dp_shard: on one host when a host
holds tp x cp x S ranks) and the replicas average their shards over dp_replica (the
slow link). S = dp is plain ZeRO (dp_replica has one rank), S = 1 replicates only.
Experts follow: an ep group lies inside one replica (ep divides S x cp, layout.py), the
S x cp / ep expert_dp ranks of a replica shard an expert's state (expert_dp_shard), and
the copies of a slice in the other replicas are dense state's dp_replica group.
"""

import socket
from typing import NamedTuple

import numpy as np

from numpitron.distributed.comm import Comm, CommStats
from numpitron.distributed.groups import GROUPS, axis_sizes, partition
from numpitron.distributed.watchdog import Watchdog
from numpitron.errors import UserError

# Ulysses' two groups count their bytes under the group they split.
COUNTED_AS = {"cp_ulysses": "cp", "cp_ring": "cp"}


class Mesh(NamedTuple):
    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1          # expert parallelism, inside dp
    dp_shard: int = 0    # S: dp ranks that shard ZeRO's state (HSDP), inside dp; 0: dp


def resolve_mesh(world_size: int, tensor: int, pipeline: int, data: int | None, context: int = 1,
                 expert: int = 1, data_shard: int | None = None) -> Mesh:
    """The mesh sizes for this world, with dp derived when not given and S = dp unless
    given. No communication. (That ep divides dp is checked with the model, in
    layout.check_layout.)"""
    for name, value in (("tensor-parallel size", tensor), ("pipeline-parallel size", pipeline),
                        ("data-parallel size", data), ("context-parallel size", context),
                        ("expert-parallel size", expert), ("data-parallel shard size", data_shard)):
        if value is not None and value < 1:
            raise UserError(f"{name} must be positive, got {value}")
    model_parallel = tensor * pipeline * context
    if data is None:
        if world_size % model_parallel:
            raise UserError(
                f"world size {world_size} is not divisible by tensor x context x pipeline parallel size "
                f"({tensor} x {context} x {pipeline} = {model_parallel})")
        data = world_size // model_parallel
    if model_parallel * data != world_size:
        raise UserError(
            f"tensor x context x pipeline x data parallel size ({tensor} x {context} x {pipeline} x {data} = "
            f"{model_parallel * data}) does not match the world size {world_size}")
    data_shard = data_shard or data
    if data % data_shard:
        raise UserError(f"--data-parallel-shard-size {data_shard} must divide the data-parallel size {data}: "
                        f"the dp ranks split into dp / S replicas of S ranks each")
    return Mesh(tensor, pipeline, data, context, expert, data_shard)


class Topology:
    """Coordinates of this rank and a communicator for each group of the table in
    distributed/groups.py (`tp_comm`, `cp_comm`, ..., `expert_dp_shard_comm`), plus
    `embedding_comm`: the first and the last stage, which hold the tied embedding. A
    group of this rank alone has no MPI communicator, and every collective on it is a
    no-op, so one process runs the code a mesh runs.
    """

    def __init__(self, world, tp: int, pp: int, dp: int, stats: CommStats | None = None, cp: int = 1, ep: int = 1,
                 watchdog: Watchdog | None = None, ulysses: int = 1, dp_shard: int = 0):
        self.stats = stats or CommStats()
        self.watchdog = watchdog or Watchdog()          # one deadline for every group's collectives
        self.tp, self.pp, self.dp, self.cp, self.ep = tp, pp, dp, cp, ep
        self.ulysses = ulysses           # cp ranks per Ulysses all-to-all group (must divide cp)
        self.dp_shard = dp_shard or dp   # S: dp ranks ZeRO shards over (hybrid sharding)
        self.dp_replicas = dp // self.dp_shard
        self.world_size = tp * pp * dp * cp
        self.rank = 0 if world is None else world.Get_rank()
        self.pp_rank, rest = divmod(self.rank, dp * cp * tp)
        self.dp_rank, rest = divmod(rest, cp * tp)
        self.cp_rank, self.tp_rank = divmod(rest, tp)
        self.dp_cp_rank = self.dp_rank * cp + self.cp_rank
        self.expert_dp_rank, self.ep_rank = divmod(self.dp_cp_rank, ep)
        self.dp_replica_rank, in_shard = divmod(self.dp_rank, self.dp_shard)
        self.dp_shard_rank = in_shard * cp + self.cp_rank
        # expert_dp ranks in one replica: its S x cp dp_cp ranks are contiguous, and ep divides them
        self.expert_dp_shard = max(self.dp_shard * cp // ep, 1)
        self.expert_dp_shard_rank = self.expert_dp_rank % self.expert_dp_shard
        self.world = Comm(world, self.stats, "world")
        # DiLoCo (diloco/replicas.py) builds one Topology per replica over the replica's
        # ranks and tells it the others: their count, its index, the group joining them.
        self.replicas = None
        # Each rank's host, gathered once at set-up: the printout names them, and a
        # group whose ranks sit on several hosts crosses the network (docs/17-many-hosts.md).
        self.hostnames = [socket.gethostname()] if world is None else world.allgather(socket.gethostname())
        if world is None:
            for name in (*GROUPS, "embedding"):
                setattr(self, f"{name}_comm", Comm(None, self.stats, COUNTED_AS.get(name, name)))
        else:
            self._check_shard_placement()
            self._split(world)
        for comm in [self.world, self.embedding_comm] + [getattr(self, f"{name}_comm") for name in GROUPS]:
            comm.watchdog = self.watchdog

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    def _split(self, world) -> None:
        """A communicator for every group of the table (distributed/groups.py) that holds
        more than this rank, made once: a group with the same ranks as one made before
        (hybrid sharding off: dp_shard is dp_cp; no Ulysses: cp_ring is cp) shares its
        communicator. Every rank decides alike from the sizes alone, so every rank makes
        the same Split calls in the same order."""
        sizes = axis_sizes(self.tp, self.pp, self.dp, self.cp, self.ep, self.ulysses, self.dp_shard)
        made = {}
        for name in GROUPS:
            groups = partition(name, sizes)
            key = (groups.shape, groups.tobytes())
            if groups.shape[1] > 1 and key not in made:
                row, place = np.argwhere(groups == self.rank)[0]
                made[key] = world.Split(int(row), int(place))
            setattr(self, f"{name}_comm", Comm(made.get(key), self.stats, COUNTED_AS.get(name, name)))
        self.embedding_comm = self._embedding(world, self.pp_comm.mpi)

    def _embedding(self, world, pp_comm) -> Comm:
        """The first and the last stage, which hold the two copies of the token embedding:
        no one else with one stage, the pipeline itself with two; others pass UNDEFINED."""
        if self.pp <= 2:
            return Comm(pp_comm, self.stats, "embedding")
        from mpi4py import MPI
        on_ends = self.is_first_stage or self.is_last_stage
        color = (self.dp_rank * self.cp + self.cp_rank) * self.tp + self.tp_rank if on_ends else MPI.UNDEFINED
        ends = world.Split(color, self.pp_rank)
        return Comm(ends if on_ends else None, self.stats, "embedding")

    @classmethod
    def serial(cls) -> "Topology":
        """One process: every communicator has size 1 and every collective is a no-op."""
        return cls(None, 1, 1, 1)

    @classmethod
    def from_world(cls, tensor: int = 1, pipeline: int = 1, data: int | None = None, world=None,
                   context: int = 1, expert: int = 1, ulysses: int = 1, data_shard: int | None = None) -> "Topology":
        from mpi4py import MPI
        world = world or MPI.COMM_WORLD
        return cls.from_mesh(world, resolve_mesh(world.Get_size(), tensor, pipeline, data, context, expert, data_shard),
                             ulysses=ulysses)

    @classmethod
    def from_mesh(cls, world, mesh: Mesh, collective_timeout: float | None = None, ulysses: int = 1) -> "Topology":
        """collective_timeout: seconds a rank may wait in one collective before it ends
        the job (None: forever); ulysses: the Ulysses group size inside cp
        (ParallelConfig.ulysses_group)."""
        return cls(world, mesh.tp, mesh.pp, mesh.dp, cp=mesh.cp, ep=mesh.ep,
                   watchdog=Watchdog(collective_timeout, world.Get_rank()), ulysses=ulysses, dp_shard=mesh.dp_shard)

    @property
    def mesh(self) -> Mesh:
        return Mesh(self.tp, self.pp, self.dp, self.cp, self.ep, self.dp_shard)

    def alone(self, name: str) -> Comm:
        """A group of this rank alone: every collective on it is a no-op that counts nothing."""
        return Comm(None, self.stats, name)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_stage(self) -> int | None:
        """Rank of the previous stage in this rank's pp communicator."""
        return None if self.is_first_stage else self.pp_rank - 1

    @property
    def next_stage(self) -> int | None:
        return None if self.is_last_stage else self.pp_rank + 1

    def world_rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    @property
    def job(self) -> Comm:
        """Every rank of the job: the world, or with DiLoCo every replica's ranks."""
        return self.world if self.replicas is None else self.replicas.job

    @property
    def is_logger(self) -> bool:
        """Exactly one rank of the job prints and writes files."""
        return self.job.rank == 0

    def __str__(self) -> str:
        experts = f" (experts split over ep={self.ep} of the dp x cp ranks)" if self.ep > 1 else ""
        lines = [f"mesh: tp={self.tp} x cp={self.cp} x dp={self.dp} x pp={self.pp} ({self.world_size} ranks){experts}"]
        if self.ulysses > 1:
            lines[0] += f" (cp: all-to-all in groups of {self.ulysses}, ring over {self.cp // self.ulysses})"
        if self.dp_shard < self.dp:
            lines[0] += f" (ZeRO shards over {self.dp_shard} of the dp ranks, {self.dp_replicas} replicas)"
        for s in range(self.pp):
            replicas = ["[" + " | ".join(" ".join(str(self.world_rank_of(s, d, t, c)) for t in range(self.tp))
                                         for c in range(self.cp)) + "]" for d in range(self.dp)]
            lines.append(f"  stage {s}: data replicas [sequence parts | ...] of tp groups {' '.join(replicas)}")
        hosts = dict.fromkeys(self.hostnames)
        lines.append("  hosts: " + ", ".join(
            f"{host} [{' '.join(str(r) for r, h in enumerate(self.hostnames) if h == host)}]" for host in hosts))
        if len(hosts) > 1:
            lines.append("  groups that cross hosts: " + (", ".join(self.groups_across_hosts()) or "none"))
        return "\n".join(lines)

    def groups_across_hosts(self) -> list[str]:
        """The mesh axes (tp, cp, dp, pp) some of whose groups hold ranks of more than
        one host: their collectives cross the network."""
        strides = {"tp": (self.tp, 1), "cp": (self.cp, self.tp), "dp": (self.dp, self.tp * self.cp),
                   "pp": (self.pp, self.tp * self.cp * self.dp)}
        crossing = []
        for axis, (size, stride) in strides.items():
            for rank in range(self.world_size):
                if (rank // stride) % size == 0 and len({self.hostnames[rank + i * stride] for i in range(size)}) > 1:
                    crossing.append(axis)
                    break
        return crossing

    def _check_shard_placement(self) -> None:
        """Hybrid sharding keeps a shard group's gathers and reduce-scatters inside one
        host. Its ranks span tp x cp x S consecutive ranks (tp fastest, then cp, then dp):
        with S < dp, a group that crosses hosts although that many ranks fit on the
        smallest host is a placement mistake, refused on every rank alike."""
        span = self.tp * self.cp * self.dp_shard
        smallest_host = min(self.hostnames.count(h) for h in set(self.hostnames))
        if self.dp_shard == self.dp or span > smallest_host:
            return
        for first in range(0, self.world_size, span):
            hosts = sorted(set(self.hostnames[first:first + span]))
            if len(hosts) > 1:
                raise UserError(
                    f"--data-parallel-shard-size {self.dp_shard}: ranks {first}-{first + span - 1} (tp x cp x S = "
                    f"{span} consecutive ranks) would shard across hosts {', '.join(hosts)}, though a host holds "
                    f"{smallest_host} ranks; place a multiple of {span} consecutive ranks on each host")
