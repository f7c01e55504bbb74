"""Megatron's tensor-parallel linear layers (Shoeybi et al. 2019, §3, Fig. 3).

A column-parallel layer splits its weight along the output dimension: each rank
computes its own slice of the output from the full input. Its backward must sum the
input gradient over ranks: that all-reduce is Megatron's "f".

A row-parallel layer splits its weight along the input dimension: each rank holds a
slice of the input and produces a partial sum of the output, which is all-reduced
in forward: Megatron's "g". Its bias is replicated and added once, after the sum.

Put together (column then row), an MLP or an attention layer costs one all-reduce
forward and one backward. With sequence parallelism the same two points become an
all-gather and a reduce-scatter each (tensor_parallel/regions.py decides which; the layers ask it).
"""

from numpitron.nn.layer import Layer
from numpitron.nn.matmul import PLAIN, column_sums, rows
from numpitron.nn.param import Param
from numpitron.tensor_parallel.regions import ReplicatedRegion


class ColumnParallelLinear(Layer):
    """y[..., local outputs] = x @ W[:, local outputs] + b[local outputs].

    With `groups` > 1 the output is `groups` concatenated blocks (attention's
    q|k|v) and every rank takes its slice of each block, so rank r holds the q, k
    and v of its own heads. The weight's logical shape is then (in, groups, out).
    """

    def __init__(self, name: str, in_features: int, out_features: int, topo, groups: int = 1, std: float = 0.02,
                 region=None, add_bias: bool = True):
        self.region = region or ReplicatedRegion(topo.tp_comm)
        # False: the caller adds the bias itself, fused into its next element-wise
        # pass (Megatron's skip_bias_add; the MLP's bias-GELU). Its gradient is the same.
        self.add_bias = add_bias
        shape = (in_features, groups, out_features) if groups > 1 else (in_features, out_features)
        bias_shape = (groups, out_features) if groups > 1 else (out_features,)
        tp = dict(tp_rank=topo.tp_rank, tp_size=topo.tp)
        self.weight = Param(f"{name}.weight", shape, split_axis=len(shape) - 1, std=std, **tp)
        self.bias = Param(f"{name}.bias", bias_shape, split_axis=len(bias_shape) - 1, init="zeros", decay=False, **tp)
        self.matmul = PLAIN             # --precision fp8 installs its own (precision/fp8.py)

    def parameters(self) -> list[Param]:
        return [self.weight, self.bias]

    def _w(self):
        return self.weight.data.reshape(self.weight.data.shape[0], -1)

    def forward(self, x):
        # x: (B, T, in) (or (B, T/tp, in) sequence-parallel) -> y: (B, T, out / tp)
        full = self.region.gather(x)   # identity, or the all-gather along the sequence
        y = self.matmul.forward(rows(full), self._w())
        if self.add_bias:
            y += self.bias.data.reshape(-1)
        y = self.precision.round(y)    # a GEMM writes its output in the low format
        # Keep x as it came: sequence-parallel, that is 1/tp of the input (gathered
        # again for the weight gradient). It holds the low format's values already.
        return y.reshape(*full.shape[:-1], y.shape[-1]), {"x": self.precision.keep(x)}

    def start_backward_input(self, dy, cache):
        cache["dy"] = dy
        dx = self.matmul.input_grad(rows(dy), self._w()).reshape(dy.shape[:-1] + (self.weight.data.shape[0],))  # this rank's share
        # Megatron's "f" (all-reduce) or reduce-scatter, perhaps still running when
        # backward_weights starts: nothing there reads dx.
        return self.region.start_input_grad(dx)

    def backward_weights(self, cache):
        dy = rows(cache["dy"])
        x = rows(self.region.gather(self.precision.widen(cache["x"])))
        self.matmul.add_weight_grad(x, dy, self.weight.grad.reshape(-1, dy.shape[1]))
        self.bias.grad.reshape(-1)[...] += column_sums(dy)


class RowParallelLinear(Layer):
    """y = sum over tp of x[..., local inputs] @ W[local inputs, :], then + b."""

    def __init__(self, name: str, in_features: int, out_features: int, topo, std: float = 0.02, region=None,
                 add_bias: bool = True):
        self.region = region or ReplicatedRegion(topo.tp_comm)
        # False: the caller adds the bias after its own sum over tp (the experts, whose
        # region defers the sum). Its gradient is the same.
        self.add_bias = add_bias
        tp = dict(tp_rank=topo.tp_rank, tp_size=topo.tp)
        self.weight = Param(f"{name}.weight", (in_features, out_features), split_axis=0, std=std, **tp)
        self.bias = Param(f"{name}.bias", (out_features,), init="zeros", decay=False, **tp)
        self.matmul = PLAIN

    def parameters(self) -> list[Param]:
        return [self.weight, self.bias]

    def forward(self, x):
        # x: (B, T, in / tp) -> y: (B, T, out) (or (B, T/tp, out) sequence-parallel)
        y = self.matmul.forward(rows(x), self.weight.data)    # partial sum over this rank's inputs
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        y = self.region.reduce(y)        # Megatron's "g" (all-reduce) or reduce-scatter
        if self.add_bias:
            y += self.bias.data          # once, after the sum
        return self.precision.round(y), {"x": self.precision.keep(x)}

    def backward_input(self, dy, cache):
        cache["dy"] = dy                 # this rank's tokens (all of them unless sequence-parallel)
        full = self.region.output_grad(dy)      # identity, or the all-gather along the sequence
        cache["dy_full"] = full
        return self.matmul.input_grad(rows(full), self.weight.data).reshape(cache["x"].shape)

    def backward_weights(self, cache):
        x = self.precision.widen(cache["x"])
        self.matmul.add_weight_grad(rows(x), rows(cache["dy_full"]), self.weight.grad)
        # The bias met only this rank's tokens: under sequence parallelism a partial
        # sum, completed over tp in GPTStage.finalize_grads.
        self.bias.grad += column_sums(rows(cache["dy"]))
