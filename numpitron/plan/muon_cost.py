"""What Muon adds to a step (docs/10-muon.md): the
Newton-Schulz iterations on the owner ranks, how unevenly the owners share them, and
the bytes of the gathers and scatters that bring each matrix to its owner and its
step back, from the configs and the mesh alone.

FLOPs. muon/muon.py iterates on X of shape m x n with m <= n (a tall matrix is
transposed first, so that the Gram matrix is the smaller one). One quintic step is
three matrix products and two element-wise combinations:

    A = X X^T                 (m x n)(n x m):  2 m^2 n
    B = b A + c A A           (m x m)(m x m):  2 m^3
    X <- a X + B X            (m x m)(m x n):  2 m^2 n

so 4 m^2 n + 2 m^3 FLOPs a step and NS_STEPS = 5 steps a matrix (the norm and the
element-wise terms, O(m n), are left out). On the default model's four blocks that is
2.35 GFLOP a step, whatever the batch.

Owners: `balanced_owners` deals the matrices over the tp x g ranks of a stage (g the
ZeRO group, 1 without ZeRO) by elements, as muon/owners.py does, so the
FLOPs, which grow as m^2 n, may be shared less evenly: `imbalance` is the busiest
owner's FLOPs over the mean. Every rank waits for the busiest owner in the scatter.

Bytes, per rank, as `Comm` counts them (what a rank sends to another rank): in the
ZeRO gather a rank sends its piece of each matrix whose owner is another ZeRO rank;
in the ZeRO scatter an owner's ZeRO rank sends each matrix's shard but its own piece;
in the tp gather the owner's tp peers send their shards, and in the tp scatter the
owner sends tp - 1 shards. Summed over a stage's ranks that is the formula of
muon/owners.py, 2 b sum_k [(E_k - tp c_k) + E_k (tp - 1) / tp].
"""

from numpitron.distributed.sharding import pad_to_multiple, pieces_of_range
from numpitron.muon.muon import NS_STEPS
from numpitron.muon.owners import balanced_owners
from numpitron.plan.accounting import Rank, parameter_elements
from numpitron.plan.kernels import Work
from numpitron.plan.layer_sizes import stage_matrices


def newton_schulz_flops(shape: tuple[int, int], steps: int = NS_STEPS) -> int:
    """FLOPs of orthogonalising one A x B matrix: steps x (4 m^2 n + 2 m^3), m <= n."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


def newton_schulz_work(shapes: list, steps: int = NS_STEPS) -> Work:
    """The iterations' BLAS calls, each filed under its own size (predict.price)."""
    work = Work()
    for shape in shapes:
        m, n = sorted(shape)
        work.mm(m, n, m, times=steps)           # X X^T
        work.mm(m, m, m, times=steps)           # A A
        work.mm(m, m, n, times=steps)           # (b A + c A A) X
    return work


def muon_cost(model, parallel, rank: Rank) -> dict:
    """Muon's owners on this rank's stage: the FLOPs each owner iterates, the shapes
    this rank owns and the busiest owner's, and the bytes this rank moves per kind."""
    tp, g = rank.tp, (rank.shard_group if parallel.zero_stage else 1)
    matrices = stage_matrices(model, rank)
    owners = balanced_owners([a * b for _, _, (a, b) in matrices], tp * g)
    flops, owned = [0] * (tp * g), [[] for _ in range(tp * g)]
    for (_, _, shape), owner in zip(matrices, owners):
        flops[owner] += newton_schulz_flops(shape)
        owned[owner].append(shape)
    me = (rank.shard_rank if g > 1 else 0) * tp + rank.tp_rank       # owner o: tp rank o % tp, ZeRO rank o // tp
    padded = pad_to_multiple(parameter_elements(model, rank)[0], g)
    moved = {"dp_shard.gather": 0, "dp_shard.scatter": 0, "tp.gather": 0, "tp.scatter": 0}
    t, d = me % tp, me // tp
    for (lo, hi, _), owner in zip(matrices, owners):
        t_owner, d_owner = owner % tp, owner // tp
        mine = pieces_of_range(lo, hi, padded, g)[d]
        if d != d_owner:
            moved["dp_shard.gather"] += mine                # this rank's piece, to the owner's ZeRO rank
            continue
        moved["dp_shard.scatter"] += (hi - lo) - mine       # the step's other pieces, back
        if t != t_owner:
            moved["tp.gather"] += hi - lo                   # this tp shard, to the owner
        else:
            moved["tp.scatter"] += (tp - 1) * (hi - lo)     # the other shards of the step
    comm = {kind: n * model.itemsize for kind, n in moved.items() if n}
    busiest = max(range(tp * g), key=lambda o: (flops[o], -o))
    return {"owner_flops": flops, "flops_total": sum(flops), "imbalance": max(flops) * len(flops) / max(1, sum(flops)),
            "owned_shapes": owned[me], "busiest_shapes": owned[busiest], "comm_bytes": comm}
