"""The process mesh: world ranks laid out as a grid [pp, dp, tp], tp fastest.

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

Tensor-parallel peers are neighbouring ranks (on a cluster: one node, the fastest
links); pipeline stages are outermost. This is Megatron-LM's default order.
"""

from numpitron.distributed.comm import Comm, CommStats
from numpitron.errors import UserError


def resolve_mesh(world_size: int, tensor: int, pipeline: int, data: int | None) -> tuple[int, int, int]:
    """(tp, pp, dp) for this world, with dp derived when not given. No communication."""
    for name, value in (("tensor-parallel size", tensor), ("pipeline-parallel size", pipeline), ("data-parallel size", data)):
        if value is not None and value < 1:
            raise UserError(f"{name} must be positive, got {value}")
    model_parallel = tensor * pipeline
    if data is None:
        if world_size % model_parallel:
            raise UserError(
                f"world size {world_size} is not divisible by tensor x pipeline parallel size "
                f"({tensor} x {pipeline} = {model_parallel})")
        data = world_size // model_parallel
    if tensor * pipeline * data != world_size:
        raise UserError(
            f"tensor x pipeline x data parallel size ({tensor} x {pipeline} x {data} = "
            f"{tensor * pipeline * data}) does not match the world size {world_size}")
    return tensor, pipeline, data


class Topology:
    """Coordinates of this rank and the communicators of its groups.

    Groups: tp (same stage and data replica), dp (same stage and tp slice), pp (one
    pipeline: same data replica and tp slice), model (tp x pp: one full model replica,
    for the gradient norm), embedding (first and last stage: the tied embedding).
    """

    def __init__(self, world, tp: int, pp: int, dp: int, stats: CommStats | None = None):
        self.stats = stats or CommStats()
        self.tp, self.pp, self.dp = tp, pp, dp
        self.world_size = tp * pp * dp
        self.rank = 0 if world is None else world.Get_rank()
        self.pp_rank, rest = divmod(self.rank, dp * tp)
        self.dp_rank, self.tp_rank = divmod(rest, tp)
        self.world = Comm(world, self.stats, "world")
        if world is None:
            for name in ("tp", "dp", "pp", "model", "embedding"):
                setattr(self, f"{name}_comm", Comm(None, self.stats, name))
        else:
            self._split(world)

    def _split(self, world) -> None:
        # Every rank makes the same Split calls in the same order; a rank outside a
        # group (embedding group on a middle stage) passes UNDEFINED and gets None.
        from mpi4py import MPI
        pp, dp, tp = self.pp_rank, self.dp_rank, self.tp_rank
        self.tp_comm = Comm(world.Split(pp * self.dp + dp, tp), self.stats, "tp")
        self.dp_comm = Comm(world.Split(pp * self.tp + tp, dp), self.stats, "dp")
        self.pp_comm = Comm(world.Split(dp * self.tp + tp, pp), self.stats, "pp")
        self.model_comm = Comm(world.Split(dp, self.rank), self.stats, "model")
        on_ends = self.is_first_stage or self.is_last_stage
        color = dp * self.tp + tp if on_ends else MPI.UNDEFINED
        emb = world.Split(color, pp)
        self.embedding_comm = Comm(emb if on_ends else None, self.stats, "embedding")

    @classmethod
    def serial(cls) -> "Topology":
        """One process: every communicator has size 1 and every collective is a no-op."""
        return cls(None, 1, 1, 1)

    @classmethod
    def from_world(cls, tensor: int = 1, pipeline: int = 1, data: int | None = None, world=None) -> "Topology":
        from mpi4py import MPI
        world = world or MPI.COMM_WORLD
        tp, pp, dp = resolve_mesh(world.Get_size(), tensor, pipeline, data)
        return cls(world, tp, pp, dp)

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

    def world_rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    @property
    def is_logger(self) -> bool:
        """Exactly one rank in the world prints and writes files."""
        return self.rank == 0

    def __str__(self) -> str:
        lines = [f"mesh: tp={self.tp} x dp={self.dp} x pp={self.pp} ({self.world_size} ranks)"]
        for s in range(self.pp):
            replicas = ["[" + " ".join(str(self.world_rank_of(s, d, t)) for t in range(self.tp)) + "]"
                        for d in range(self.dp)]
            lines.append(f"  stage {s}: data replicas (tp groups) {' '.join(replicas)}")
        return "\n".join(lines)
