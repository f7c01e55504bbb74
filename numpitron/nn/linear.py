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

from numpitron.nn.param import Param


class ColumnParallelLinear:
    """y[:, local outputs] = x @ W[:, local outputs] + b[local outputs].

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

    def forward(self, x):
        # x: (N, in) replicated -> y: (N, out / tp)
        w = self.weight.data.reshape(x.shape[1], -1)
        y = x @ w
        y += self.bias.data.reshape(-1)
        return y, x

    def backward(self, dy, x):
        w = self.weight.data.reshape(x.shape[1], -1)
        self.weight.grad.reshape(w.shape)[...] += x.T @ dy
        self.bias.grad.reshape(-1)[...] += dy.sum(axis=0)
        dx = dy @ w.T              # this rank's share of dL/dx
        self.tp.all_reduce(dx)     # Megatron's "f" in backward: sum the shares over tp
        return dx


class RowParallelLinear:
    """y = sum over tp of x[:, local inputs] @ W[local inputs, :], then + b."""

    def __init__(self, name: str, in_features: int, out_features: int, topo, std: float = 0.02):
        self.tp = topo.tp_comm
        tp = dict(tp_rank=topo.tp_rank, tp_size=topo.tp)
        self.weight = Param(f"{name}.weight", (in_features, out_features), split_axis=0, std=std, **tp)
        self.bias = Param(f"{name}.bias", (out_features,), init="zeros", decay=False, **tp)

    def parameters(self) -> list[Param]:
        return [self.weight, self.bias]

    def forward(self, x):
        # x: (N, in / tp) -> y: (N, out) replicated
        y = x @ self.weight.data   # partial sum over this rank's inputs
        self.tp.all_reduce(y)      # Megatron's "g" in forward: sum the partials over tp
        y += self.bias.data        # once, after the sum
        return y, x

    def backward(self, dy, x):
        self.weight.grad += x.T @ dy
        self.bias.grad += dy.sum(axis=0)
        return dy @ self.weight.data.T   # no communication: dy is replicated
