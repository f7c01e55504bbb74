"""The two ways activations meet the tensor-parallel layers: Megatron's conjugate
communication operators, in one place.

A column-parallel layer needs its whole input on every tp rank; a row-parallel layer
produces partial sums that must be added over tp. Between them (LayerNorm, residual,
dropout in Megatron) activations are either

* replicated (plain tensor parallelism, Shoeybi et al. 2019, §3): the column layer's
  input is used as it is ("f": identity forward, all-reduce of the input gradient in
  backward), and the row layer's output is all-reduced ("g"); or
* split along the sequence (sequence parallelism, Korthikanti et al. 2022, §4.2.2):
  each tp rank keeps T/tp of the tokens; the column layer's input is all-gathered
  along the sequence ("g": all-gather forward, reduce-scatter backward) and the row
  layer's output reduce-scattered ("g-bar": reduce-scatter forward, all-gather
  backward). An all-reduce is a reduce-scatter plus an all-gather, so the same bytes
  move; the activations between the layers take 1/tp of the memory.

Every layer asks its region, so there is one code path: with tp = 1 both are no-ops.
"""

import numpy as np


class ReplicatedRegion:
    """Plain tensor parallelism: activations outside the tp layers are whole on every rank."""

    sequence_parallel = False

    def __init__(self, tp_comm):
        self.tp = tp_comm
        self.parts = 1                   # how many pieces of the sequence the tp ranks hold

    def gather(self, x):
        """The whole input of a column-parallel layer: here, x itself."""
        return x

    def input_grad(self, dx):
        """Megatron's "f" in backward: sum the column layer's input gradient over tp."""
        return self.tp.all_reduce(dx)

    def reduce(self, y):
        """Megatron's "g": sum a row-parallel layer's partial outputs over tp."""
        return self.tp.all_reduce(y)

    def output_grad(self, dy):
        """The gradient at a row-parallel layer's output, whole: here, dy itself."""
        return dy

    def local(self, rows):
        """This rank's share of per-token values along the sequence (axis 0)."""
        return rows


class SequenceParallelRegion(ReplicatedRegion):
    """Sequence parallelism: outside the tp layers each rank holds T/tp of the tokens
    (B, T/tp, C); rank r the r-th contiguous part of its sequence."""

    sequence_parallel = True

    def __init__(self, tp_comm):
        super().__init__(tp_comm)
        self.parts = tp_comm.size

    def gather(self, x):
        """All-gather along the sequence: (B, T/tp, C) -> (B, T, C)."""
        B, t, C = x.shape
        full = np.empty((self.tp.size, B, t, C), x.dtype)
        full[self.tp.rank] = x
        self.tp.all_gather(full)
        return full.transpose(1, 0, 2, 3).reshape(B, self.tp.size * t, C)

    def _reduce_scatter(self, y):
        """Sum (B, T, C) over tp and keep this rank's (B, T/tp, C)."""
        B, T, C = y.shape
        t = T // self.tp.size
        parts = np.ascontiguousarray(y.reshape(B, self.tp.size, t, C).transpose(1, 0, 2, 3))
        mine = np.empty((B, t, C), y.dtype)
        self.tp.reduce_scatter(parts, mine)
        return mine

    def input_grad(self, dx):
        """"g" in backward: reduce-scatter the column layer's input gradient."""
        return self._reduce_scatter(dx)

    def reduce(self, y):
        """"g-bar": reduce-scatter a row-parallel layer's partial outputs."""
        return self._reduce_scatter(y)

    def output_grad(self, dy):
        """"g-bar" in backward: all-gather the output gradient along the sequence."""
        return self.gather(dy)

    def local(self, rows):
        t = len(rows) // self.tp.size
        return rows[self.tp.rank * t:(self.tp.rank + 1) * t]


class DeferredSumRegion(ReplicatedRegion):
    """Activations whole on every tp rank, as in ReplicatedRegion, but the caller makes
    "f" and "g" itself, once for several layers: the experts of nn/experts.py, one
    all-reduce for all the local experts' rows. The layers leave their partial sums."""

    def input_grad(self, dx):
        return dx

    def reduce(self, y):
        return y


def make_region(topo, sequence_parallel: bool):
    return (SequenceParallelRegion if sequence_parallel else ReplicatedRegion)(topo.tp_comm)
