"""Collectives in a format MPI has no type for (bf16, fp16: docs/07-numbers.md), for
`Comm`'s reductions and gathers. Values travel as integers of the format's size, so a
bf16 gradient costs 2 bytes on the wire and the byte count says so; a sum adds in fp32
and rounds to the format after every addition, as a 16-bit add on a device does.
"""

import numpy as np


_LOW_SUMS = {}


def low_format_sum(wire: np.dtype):
    """MPI's sum for values in `wire`, a format MPI has no type for: each addition in
    fp32, its result rounded to the format (so a sum over n ranks rounds n - 1 times)."""
    if wire not in _LOW_SUMS:
        from mpi4py import MPI

        def add(inbuf, inoutbuf, datatype):
            a, b = np.frombuffer(inbuf, wire), np.frombuffer(inoutbuf, wire)
            with np.errstate(over="ignore"):              # fp16 overflows to inf, as on the device
                b[...] = (a.astype(np.float32) + b.astype(np.float32)).astype(wire)
        _LOW_SUMS[wire] = MPI.Op.Create(add, commute=True)
    return _LOW_SUMS[wire]


def on_wire(buf: np.ndarray, wire: np.dtype | None):
    """(what MPI moves for `buf`, a function that writes the moved values back into buf):
    buf itself when there is no wire format, else a copy cast to it, seen as integers of
    its size (MPI moves them untouched; only `low_format_sum` reads them as numbers)."""
    if wire is None or wire == buf.dtype:
        return buf, lambda: None
    with np.errstate(over="ignore", invalid="ignore"):
        packed = buf.astype(wire).view(f"u{wire.itemsize}")

    def unpack():
        buf[...] = packed.view(wire)
    return packed, unpack


def sum_op(packed: np.ndarray, buf: np.ndarray, wire):
    """MPI's own sum when `buf` travels as it is, else the wire format's."""
    from mpi4py import MPI
    return MPI.SUM if packed is buf else low_format_sum(wire)
