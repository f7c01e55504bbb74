"""Megatron's tensor-parallel linear layers (Shoeybi et al. 2019, §3, Fig. 3).

A column-parallel layer splits its weight along the output dimension: each rank
computes its own slice of the output from the full, replicated input. Its backward
must sum the input gradient over ranks: that all-reduce is Megatron's "f".

A row-parallel layer splits its weight along the input dimension: each rank holds a
slice of the input and produces a partial sum of the output, which is all-reduced
in forward: Megatron's "g". Its bias is replicated and added once, after the sum.

Put together (column then row), an MLP or an attention layer costs one all-reduce
forward and one backward.
"""

from numpitron.nn.layer import Layer, rows
from numpitron.nn.param import Param


class ColumnParallelLinear(Layer):
    """y[..., local outputs] = x @ W[:, local outputs] + b[local outputs].

    With `groups` > 1 the output is `groups` concatenated blocks (attention's
    q|k|v) and every rank takes its slice of each block, so rank r holds the q, k
    and v of its own heads. The weight's logical shape is then (in, groups, out).
    """

    def __init__(self, name: str, in_features: int, out_features: int, topo, groups: int = 1, std: float = 0.02):
        self.tp = topo.tp_comm
        shape = (in_features, groups, out_features) if groups > 1 else (in_features, out_features)
        bias_shape = (groups, out_features) if groups > 1 else (out_features,)
        tp = dict(tp_rank=topo.tp_rank, tp_size=topo.tp)
        self.weight = Param(f"{name}.weight", shape, split_axis=len(shape) - 1, std=std, **tp)
        self.bias = Param(f"{name}.bias", bias_shape, split_axis=len(bias_shape) - 1, init="zeros", decay=False, **tp)

    def parameters(self) -> list[Param]:
        return [self.weight, self.bias]

    def _w(self):
        return self.weight.data.reshape(self.weight.local_shape[0], -1)

    def forward(self, x):
        # x: (B, T, in) replicated over tp -> y: (B, T, out / tp)
        y = rows(x) @ self._w()
        y += self.bias.data.reshape(-1)
        return y.reshape(*x.shape[:-1], -1), {"x": x}

    def backward_input(self, dy, cache):
        cache["dy"] = dy
        dx = rows(dy) @ self._w().T    # this rank's share of dL/dx
        self.tp.all_reduce(dx)         # Megatron's "f" in backward: sum the shares over tp
        return dx.reshape(cache["x"].shape)

    def backward_weights(self, cache):
        dy = rows(cache["dy"])
        self.weight.grad.reshape(-1, dy.shape[1])[...] += rows(cache["x"]).T @ dy
        self.bias.grad.reshape(-1)[...] += dy.sum(axis=0)


class RowParallelLinear(Layer):
    """y = sum over tp of x[..., local inputs] @ W[local inputs, :], then + b."""

    def __init__(self, name: str, in_features: int, out_features: int, topo, std: float = 0.02):
        self.tp = topo.tp_comm
        tp = dict(tp_rank=topo.tp_rank, tp_size=topo.tp)
        self.weight = Param(f"{name}.weight", (in_features, out_features), split_axis=0, std=std, **tp)
        self.bias = Param(f"{name}.bias", (out_features,), init="zeros", decay=False, **tp)

    def parameters(self) -> list[Param]:
        return [self.weight, self.bias]

    def forward(self, x):
        # x: (B, T, in / tp) -> y: (B, T, out) replicated over tp
        y = rows(x) @ self.weight.data   # partial sum over this rank's inputs
        self.tp.all_reduce(y)            # Megatron's "g" in forward: sum the partials over tp
        y += self.bias.data              # once, after the sum
        return y.reshape(*x.shape[:-1], -1), {"x": x}

    def backward_input(self, dy, cache):
        cache["dy"] = dy                 # no communication: dy is replicated over tp
        return (rows(dy) @ self.weight.data.T).reshape(cache["x"].shape)

    def backward_weights(self, cache):
        dy = rows(cache["dy"])
        self.weight.grad += rows(cache["x"]).T @ dy
        self.bias.grad += dy.sum(axis=0)
