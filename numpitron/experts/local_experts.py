"""This rank's experts: each is the dense GELU MLP (transformer/mlp.py, the same class, of
its own hidden width), column-parallel then row-parallel over tp, run one after
another on the contiguous rows routed to it: grouped compute, no padding.

Input: every token that chose one of the local experts, whole on every tp rank (the
router is replicated, so every tp rank routes alike), grouped expert by expert
(`counts[e]` rows for local expert e). Each rank computes its 4C/tp slice of every
expert's hidden layer and a partial sum of every output row. Megatron's "g" and "f"
(tensor_parallel/regions.py) are done once for all the local experts, not once per expert: one
all-reduce over tp of all the output rows in the forward, and one of all the input
gradients in the backward. The row-parallel biases are added after the sum, once.

Parameters are named by the global expert index (blocks.2.mlp.experts.5.fc.weight),
drawn from (seed, name): an expert is the same tensor whichever rank holds it, and a
checkpoint stores it under the same name for any ep.
"""

import numpy as np

from numpitron.nn.layer import InFlight, Layer
from numpitron.transformer.mlp import ParallelMLP
from numpitron.tensor_parallel.regions import ReplicatedRegion


class DeferredSumRegion(ReplicatedRegion):
    """Activations whole on every tp rank, as in ReplicatedRegion, but the caller makes
    "f" and "g" itself, once for several layers: the experts below, one all-reduce for all
    the local experts' rows. The layers leave their partial sums."""

    def input_grad(self, dx):
        return dx

    def start_input_grad(self, dx) -> InFlight:
        return InFlight(dx)

    def reduce(self, y):
        return y


class LocalExperts(Layer):
    def __init__(self, name: str, d_model: int, experts: range, topo, out_std: float, hidden: int = 0):
        """experts: the global indices of the experts this rank holds; hidden: each
        one's hidden width (4C unless given: finer-grained experts are narrower)."""
        self.tp = topo.tp_comm
        region = DeferredSumRegion(topo.tp_comm)       # "f" and "g" are done below, once for all
        self.mlps = [ParallelMLP(f"{name}.{e}", d_model, topo, out_std, region=region, add_proj_bias=False,
                                 hidden=hidden) for e in experts]

    def parameters(self):
        return [p for mlp in self.mlps for p in mlp.parameters()]

    @staticmethod
    def bounds(counts):
        """[lo, hi) of each local expert's rows."""
        ends = np.cumsum(counts)
        return list(zip(ends - counts, ends))

    def forward(self, x, counts):
        # x: (R, C) tokens grouped by local expert -> (R, C)
        y = np.empty_like(x)
        caches = []
        for mlp, (lo, hi) in zip(self.mlps, self.bounds(counts)):
            y[lo:hi], cache = mlp.forward(x[lo:hi])                    # partial sum over tp
            caches.append(cache)
        self.tp.all_reduce(y)                                           # "g", for every expert at once
        for mlp, (lo, hi) in zip(self.mlps, self.bounds(counts)):
            y[lo:hi] += mlp.proj.bias.data                              # once, after the sum
        return y, {"counts": counts, "experts": caches}

    def backward_input(self, dy, cache):
        dx = np.empty_like(dy)
        for mlp, expert_cache, (lo, hi) in zip(self.mlps, cache["experts"], self.bounds(cache["counts"])):
            dx[lo:hi] = mlp.backward_input(dy[lo:hi], expert_cache)    # this rank's share
        return self.tp.all_reduce(dx)                                   # "f", for every expert at once

    def backward_weights(self, cache):
        for mlp, expert_cache in zip(self.mlps, cache["experts"]):
            mlp.backward_weights(expert_cache)
