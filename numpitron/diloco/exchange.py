"""One fragment's pseudo-gradient on its way to the other replicas, in the format
`--diloco-outer-dtype` names, and what lands: the replicas' mean.

    fp32   an all-reduce of Δ as it is:            2 (R - 1) / R · n b bytes
    bf16   an all-reduce on a bf16 wire:           2 (R - 1) / R · n 2
           (distributed/wire.py: every addition in fp32, rounded to bf16, as a
           16-bit sum on a device; the format mixed precision reduces gradients in)
    int8   an all-gather of int8 values with one   (R - 1) (n + ⌈n / CHUNK⌉ b)
           scale per chunk of CHUNK elements
    int4   the same, two 4-bit values a byte       (R - 1) (⌈n / 2⌉ + ⌈n / CHUNK⌉ b)

int8 gathers rather than reduces for compression/int8.py's reason: each replica's
integers mean something only with its own scales, which a sum would mix. Its scale
is per chunk, not per parameter, because a fragment cuts parameters anywhere. The
paper sends its outer gradients in 4-bit floats (Douillard et al. 2025); our int4
is evenly spaced integers, q in [-7, 7] times the chunk's scale, a coarser grid near
zero than a float's. Nothing the rounding drops is carried to the next round: the paper
keeps no residual either, and the outer momentum is the memory it has.

A non-blocking exchange (τ > 0) is a `Pending` collective that `settle` completes:
the mean lands in `mean`, where a checkpoint finds it (diloco/outer.py).
"""

import ml_dtypes
import numpy as np

CHUNK = 4096
LEVELS = {"int8": 127, "int4": 7}          # the largest |q|: symmetric, so 0 is exact
WIRES = {"fp32": None, "bf16": np.dtype(ml_dtypes.bfloat16)}


class Exchange:
    """Fragment `fragment`'s piece [a, b) of one optimizer's slice: sent at an
    iteration, applied when the iteration `lands` ends."""

    def __init__(self, fragment: int, a: int, b: int, lands: int, comm, mean=None):
        self.fragment, self.a, self.b, self.lands, self.comm = fragment, a, b, lands, comm
        self.pending, self.finish, self.mean = None, None, mean

    def settle(self) -> np.ndarray:
        """Wait for the collective (if it is still in flight) and return the mean Δ."""
        if self.mean is None:
            if self.pending is not None:
                self.comm.wait(self.pending)
            self.mean, self.pending, self.finish = self.finish(), None, None
        return self.mean

    def progress(self) -> None:
        if self.pending is not None:
            self.comm.test([self.pending])


def send(exchange: Exchange, delta: np.ndarray, outer_dtype: str, blocking: bool) -> Exchange:
    """Start averaging `delta` (this rank's Δ on [a, b), a buffer of its own) over the
    replicas; blocking: complete it now (τ = 0: the plain DiLoCo all-reduce)."""
    comm, replicas = exchange.comm, exchange.comm.size
    if outer_dtype in LEVELS:
        packed = pack(delta, outer_dtype)
        gathered = np.empty(replicas * packed.size, np.uint8)
        exchange.pending = comm.iall_gather(packed, gathered, [packed.size] * replicas)

        def finish():
            total = np.zeros_like(delta)
            for k in range(replicas):
                total += unpack(gathered[k * packed.size:(k + 1) * packed.size], delta.size, delta.dtype, outer_dtype)
            return total * (1.0 / replicas)
    else:
        wire = WIRES[outer_dtype]
        if blocking:
            comm.all_reduce(delta, wire=wire)
        else:
            exchange.pending = comm.iall_reduce(delta, wire=wire)

        def finish():
            delta[...] *= 1.0 / replicas     # as diloco/outer.py always averaged: one multiplication
            return delta
    exchange.finish = finish
    if blocking:
        exchange.settle()
    return exchange


def pack(x: np.ndarray, dtype: str = "int8") -> np.ndarray:
    """x as bytes: integers q = round(x / s) in [-L, L], then each chunk's scale
    s = max|x| / L in x's dtype (b bytes each); int4 packs two q + 8 into a byte."""
    top_level = LEVELS[dtype]
    chunks = -(-x.size // CHUNK)
    padded = np.zeros(chunks * CHUNK, x.dtype)
    padded[:x.size] = x
    top = np.abs(padded.reshape(chunks, CHUNK)).max(axis=1)
    scales = np.where(top > 0, top / top_level, 1.0).astype(x.dtype)
    q = np.clip(np.rint(padded.reshape(chunks, CHUNK) / scales[:, None]), -top_level, top_level).astype(np.int8)
    q = q.ravel()[:x.size]
    if dtype == "int4":
        nibbles = np.zeros(2 * -(-x.size // 2), np.uint8)
        nibbles[:x.size] = q + 8
        q = nibbles[0::2] | (nibbles[1::2] << 4)
    return np.concatenate([q.view(np.uint8), scales.view(np.uint8)])


def unpack(packed: np.ndarray, n: int, dtype, kind: str = "int8") -> np.ndarray:
    size = message_bytes(n, 0, kind)
    if kind == "int4":
        q = np.empty(2 * size, np.int8)
        q[0::2], q[1::2] = packed[:size] & 15, packed[:size] >> 4
        q = q[:n] - 8
    else:
        q = packed[:n].view(np.int8)
    return q * np.repeat(packed[size:].view(dtype), CHUNK)[:n]


def message_bytes(n: int, itemsize: int, kind: str = "int8") -> int:
    """One replica's message for a fragment piece of n elements: its values, its scales."""
    return (n if kind == "int8" else -(-n // 2)) + -(-n // CHUNK) * itemsize
