"""A two-level all-reduce, beside MPI's own (Comm.all_reduce): the q ranks of a host
and the h hosts are two groups, and the sum over all q h ranks goes in three phases.

    1. reduce-scatter inside the host   each rank holds the host's sum of 1/q of x
    2. all-reduce across the hosts      of that 1/q only: the one phase on the slow link
    3. all-gather inside the host       every rank holds the whole sum again

Bytes one rank moves, for a buffer of x bytes (the ring formulas of comm.py):

    inside the host    (q-1)/q x  +  (q-1)/q x      = 2 (q-1)/q x    (as a flat all-reduce there)
    across the hosts   2 (h-1)/h x/q

A flat ring over all q h ranks would send 2 (qh-1)/(qh) x per rank, every step paced
by its slowest hop; the two-level one sends 1/q of the buffer over the slow tier. The
groups are any pair whose product is the whole group: data parallelism uses HSDP's
dp_shard (inner) and dp_replica (outer), on one host each when `--data-parallel-shard-size`
is the dp ranks of a host (docs/09-zero-2-and-3.md).
"""

import numpy as np

from numpitron.distributed.sharding import shard_bounds


def hierarchical_all_reduce(buf: np.ndarray, inner, outer, wire=None) -> np.ndarray:
    """Sum `buf` in place over inner x outer (in a `wire` format if given: comm.py).
    buf.size must be a multiple of inner.size (pad first: `sharding.pad_to_multiple`),
    so the host's slices are equal."""
    lo, hi = shard_bounds(buf.size, inner.size, inner.rank)
    piece = np.empty(hi - lo, buf.dtype)
    inner.reduce_scatter(buf, piece, wire)   # 1. the host's sum of slice `inner.rank`
    outer.all_reduce(piece, wire=wire)       # 2. summed over the hosts: the whole sum of the slice
    buf[lo:hi] = piece
    return inner.all_gather(buf, wire)       # 3. every slice back on every rank of the host


def hierarchical_bytes(nbytes: float, q: int, h: int) -> dict:
    """What `hierarchical_all_reduce` of an nbytes buffer counts on each tier, per rank."""
    return {"inner.reduce_scatter": (q - 1) / q * nbytes, "inner.all_gather": (q - 1) / q * nbytes,
            "outer.all_reduce": 2 * (h - 1) / h * nbytes / q}
