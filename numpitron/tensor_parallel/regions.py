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

With `overlap` (--tp-comm-overlap) the column layer's input-gradient collective is
started without waiting (`start_input_grad`): its weight gradient is computed while
the sum travels (nn/layer.py, `Layer.backward`).
"""

import numpy as np

from numpitron.distributed.sharding import shard_bounds, shard_size
from numpitron.nn.layer import InFlight


class ReplicatedRegion:
    """Plain tensor parallelism: activations outside the tp layers are whole on every rank."""

    sequence_parallel = False

    def __init__(self, tp_comm, overlap: bool = True):
        self.tp = tp_comm
        self.parts = 1                   # how many pieces of the sequence the tp ranks hold
        self.overlap = overlap           # start the input-gradient collective, wait later

    def gather(self, x):
        """The whole input of a column-parallel layer: here, x itself."""
        return x

    def input_grad(self, dx):
        """Megatron's "f" in backward: sum the column layer's input gradient over tp."""
        return self.tp.all_reduce(dx)

    def start_input_grad(self, dx) -> InFlight:
        """input_grad, started: with overlap it is still running when this returns."""
        if not self.overlap:
            return InFlight(self.input_grad(dx))
        return InFlight(dx, self.tp, self.tp.iall_reduce(dx))

    def reduce(self, y):
        """Megatron's "g": sum a row-parallel layer's partial outputs over tp."""
        return self.tp.all_reduce(y)

    def output_grad(self, dy):
        """The gradient at a row-parallel layer's output, whole: here, dy itself."""
        return dy

    def local(self, rows):
        """This rank's share of per-token values along the sequence (axis 0)."""
        return rows

    def sequence_part(self, x):
        """This rank's part of (B, T, ...) along the sequence (axis 1): all of it."""
        return x


class SequenceParallelRegion(ReplicatedRegion):
    """Sequence parallelism: outside the tp layers each rank holds T/tp of the tokens
    (B, T/tp, C); rank r the r-th contiguous part of its sequence."""

    sequence_parallel = True

    def __init__(self, tp_comm, overlap: bool = True):
        super().__init__(tp_comm, overlap)
        self.parts = tp_comm.size

    def gather(self, x):
        """All-gather along the sequence: (B, T/tp, C) -> (B, T, C)."""
        B, t, C = x.shape
        full = np.empty((self.tp.size, B, t, C), x.dtype)
        full[self.tp.rank] = x
        self.tp.all_gather(full)
        return full.transpose(1, 0, 2, 3).reshape(B, self.tp.size * t, C)

    def _scatter_buffers(self, y):
        """(B, T, C) -> its tp parts along the sequence, rank order first, and a
        (B, T/tp, C) buffer for this rank's summed part."""
        B, T, C = y.shape
        t = shard_size(T, self.tp.size)
        parts = np.ascontiguousarray(y.reshape(B, self.tp.size, t, C).transpose(1, 0, 2, 3))
        return parts, np.empty((B, t, C), y.dtype)

    def _reduce_scatter(self, y):
        """Sum (B, T, C) over tp and keep this rank's (B, T/tp, C)."""
        parts, mine = self._scatter_buffers(y)
        return self.tp.reduce_scatter(parts, mine)

    def input_grad(self, dx):
        """"g" in backward: reduce-scatter the column layer's input gradient."""
        return self._reduce_scatter(dx)

    def start_input_grad(self, dx) -> InFlight:
        if not self.overlap:
            return InFlight(self.input_grad(dx))
        parts, mine = self._scatter_buffers(dx)
        return InFlight(mine, self.tp, self.tp.ireduce_scatter(parts, mine, [mine.size] * self.tp.size))

    def reduce(self, y):
        """"g-bar": reduce-scatter a row-parallel layer's partial outputs."""
        return self._reduce_scatter(y)

    def output_grad(self, dy):
        """"g-bar" in backward: all-gather the output gradient along the sequence."""
        return self.gather(dy)

    def local(self, rows):
        start, stop = shard_bounds(len(rows), self.tp.size, self.tp.rank)
        return rows[start:stop]

    def sequence_part(self, x):
        start, stop = shard_bounds(x.shape[1], self.tp.size, self.tp.rank)
        return np.ascontiguousarray(x[:, start:stop])


def make_region(topo, sequence_parallel: bool, overlap: bool = True):
    return (SequenceParallelRegion if sequence_parallel else ReplicatedRegion)(topo.tp_comm, overlap)
