"""This rank's experts: each the dense GELU MLP (nn/mlp.py), column-parallel then
row-parallel over tp, run one after another on the tokens routed to it.

Input: every token that chose one of the local experts, whole on every tp rank (the
router is replicated, so every tp rank routes alike), grouped expert by expert
(`counts[e]` rows for local expert e). Each rank computes its 4C/tp slice of every
expert's hidden layer and a partial sum of every output row. Megatron's "g" and "f"
(nn/regions.py) are done once for all the local experts, not once per expert: one
all-reduce over tp of all the output rows in the forward, and one of all the input
gradients in the backward. The row-parallel biases are added after the sum, once.

Parameters are named by the global expert index (blocks.2.mlp.experts.5.fc.weight),
drawn from (seed, name): an expert is the same tensor whichever rank holds it, and a
checkpoint stores it under the same name for any ep.
"""

import numpy as np

from numpitron.nn.functional import bias_gelu_forward, column_sums, gelu_backward_
from numpitron.nn.layer import Layer
from numpitron.nn.param import Param


class LocalExperts(Layer):
    def __init__(self, name: str, d_model: int, experts: range, topo, out_std: float):
        """experts: the global indices of the experts this rank holds."""
        self.tp = topo.tp_comm
        tp = dict(tp_rank=topo.tp_rank, tp_size=topo.tp)
        C, H = d_model, 4 * d_model
        self.fc_w, self.fc_b, self.proj_w, self.proj_b = [], [], [], []
        for e in experts:
            prefix = f"{name}.{e}"
            self.fc_w.append(Param(f"{prefix}.fc.weight", (C, H), split_axis=1, **tp))
            self.fc_b.append(Param(f"{prefix}.fc.bias", (H,), split_axis=0, init="zeros", decay=False, **tp))
            self.proj_w.append(Param(f"{prefix}.proj.weight", (H, C), split_axis=0, std=out_std, **tp))
            self.proj_b.append(Param(f"{prefix}.proj.bias", (C,), init="zeros", decay=False, **tp))

    def parameters(self):
        return [p for e in range(len(self.fc_w)) for p in (self.fc_w[e], self.fc_b[e], self.proj_w[e], self.proj_b[e])]

    @staticmethod
    def bounds(counts):
        """[lo, hi) of each local expert's rows."""
        ends = np.cumsum(counts)
        return list(zip(ends - counts, ends))

    def forward(self, x, counts):
        # x: (R, C) tokens grouped by local expert -> (R, C)
        y = np.empty_like(x)
        cache = {"x": x, "counts": counts, "slope": [], "a": []}
        for e, (lo, hi) in enumerate(self.bounds(counts)):
            h = x[lo:hi] @ self.fc_w[e].data                          # (rows, 4C / tp)
            a, slope = bias_gelu_forward(h, self.fc_b[e].data)          # h += bias, GELU; h then holds gelu'
            y[lo:hi] = a @ self.proj_w[e].data                          # partial sum over tp
            cache["slope"].append(slope)
            cache["a"].append(a)
        self.tp.all_reduce(y)                                           # "g", for every expert at once
        for e, (lo, hi) in enumerate(self.bounds(counts)):
            y[lo:hi] += self.proj_b[e].data                             # once, after the sum
        return y, cache

    def backward_input(self, dy, cache):
        cache["dy"], cache["dh"] = dy, []
        dx = np.empty_like(dy)
        for e, (lo, hi) in enumerate(self.bounds(cache["counts"])):
            da = dy[lo:hi] @ self.proj_w[e].data.T
            dh = gelu_backward_(da, cache["slope"][e])
            dx[lo:hi] = dh @ self.fc_w[e].data.T                       # this rank's share
            cache["dh"].append(dh)
        return self.tp.all_reduce(dx)                                   # "f", for every expert at once

    def backward_weights(self, cache):
        x, dy = cache["x"], cache["dy"]
        for e, (lo, hi) in enumerate(self.bounds(cache["counts"])):
            self.proj_w[e].grad += cache["a"][e].T @ dy[lo:hi]
            self.proj_b[e].grad += column_sums(dy[lo:hi])
            self.fc_w[e].grad += x[lo:hi].T @ cache["dh"][e]
            self.fc_b[e].grad += column_sums(cache["dh"][e])
