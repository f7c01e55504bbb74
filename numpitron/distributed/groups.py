"""The mesh's groups from one table: each group is the ranks that differ only along some
axes of a view of the world's grid (picotron's process group manager is the model).

The world's ranks form a grid, tp fastest (docs/architecture.md, "The mesh"):

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

Every group below is that grid seen with some axes split further (cp into the Ulysses
rings and groups, dp into hybrid sharding's replicas and shards, dp x cp into expert
parallelism's groups): the ranks of one group share every axis of the view but the ones
named, which vary inside it. Views only ever split an axis into a slower and a faster
part, so every view is a reshape of the same grid.
"""

import math

import numpy as np

# The views: axis names, slowest first, each a reshape of (pp, dp, cp, tp).
VIEWS = {
    "mesh": ("pp", "dp", "cp", "tp"),
    "ulysses": ("pp", "dp", "cp_ring", "cp_ulysses", "tp"),
    "experts": ("pp", "expert_dp", "ep", "tp"),
    "hybrid": ("pp", "dp_replica", "dp_in_shard", "cp", "tp"),
    "hybrid_experts": ("pp", "dp_replica", "expert_dp_in_shard", "ep", "tp"),
}

# group: (view, the axes that vary inside one group of it)
GROUPS = {
    "tp": ("mesh", ("tp",)),                       # one layer's shards (chapter 4)
    "cp": ("mesh", ("cp",)),                       # the parts of one sequence (chapter 12)
    "cp_ulysses": ("ulysses", ("cp_ulysses",)),    # Ulysses' all-to-all over heads
    "cp_ring": ("ulysses", ("cp_ring",)),          # the ring between Ulysses groups
    "dp": ("mesh", ("dp",)),                       # the data replicas (chapter 3)
    "dp_cp": ("mesh", ("dp", "cp")),               # every rank whose gradients average with this one's
    "pp": ("mesh", ("pp",)),                       # one pipeline (chapter 5)
    "model": ("mesh", ("pp", "tp")),               # one whole replica: the gradient norm
    "ep": ("experts", ("ep",)),                    # ranks that split the experts (chapter 13)
    "expert_dp": ("experts", ("expert_dp",)),      # ranks holding the same experts
    "expert_model": ("experts", ("pp", "ep", "tp")),  # one copy of every expert: its norm
    "dp_shard": ("hybrid", ("dp_in_shard", "cp")),    # ZeRO's shards inside one replica (chapter 9)
    "dp_replica": ("hybrid", ("dp_replica",)),        # the replicas of one shard, across hosts
    "dp_shard_model": ("hybrid", ("pp", "dp_in_shard", "cp", "tp")),   # one copy of every shard: the norm
    "expert_dp_shard": ("hybrid_experts", ("expert_dp_in_shard",)),    # an expert's shards in a replica
}


def axis_sizes(tp: int, pp: int, dp: int, cp: int, ep: int, ulysses: int, dp_shard: int) -> dict:
    """Every axis of every view. ep divides dp x cp and the shard's S x cp, U divides cp,
    S divides dp (layout.py and resolve_mesh check it before any group is made)."""
    return {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "cp_ring": cp // ulysses, "cp_ulysses": ulysses,
            "ep": ep, "expert_dp": dp * cp // ep, "dp_replica": dp // dp_shard, "dp_in_shard": dp_shard,
            "expert_dp_in_shard": max(dp_shard * cp // ep, 1)}


def partition(group: str, sizes: dict) -> np.ndarray:
    """The group's ranks: one row per group, its members in rank order."""
    view, varying = GROUPS[group]
    axes = VIEWS[view]
    grid = np.arange(math.prod(sizes[a] for a in axes)).reshape([sizes[a] for a in axes])
    order = [a for a in axes if a not in varying] + [a for a in axes if a in varying]
    grid = grid.transpose([axes.index(a) for a in order])
    return grid.reshape(-1, math.prod(sizes[a] for a in varying))
