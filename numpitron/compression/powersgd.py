"""PowerSGD (Vogels, Karimireddy and Jaggi 2019): each matrix-shaped gradient M (n x m)
is sent as two thin factors, found by one step of power iteration warm-started from
the last step's:

    P = M Q                  n x r, Q (m x r) the last step's
    P = sum of P over dp     all-reduce (the first)
    P^ = orthonormal basis of P's columns
    Q = M^T P^               m x r
    Q = mean of Q over dp    all-reduce (the second); kept as the next step's Q
    M ~ P^ Q^T

Vectors (biases, LayerNorm's gains, the padding: segments.py) are sent as they are, in the second
all-reduce. All matrices' P travel in one buffer and all Q and vectors in another, so a
step makes two all-reduces. Bytes per step and rank, p ranks, r' = min(r, n, m) for
each matrix, V the vectors' elements, b the dtype's bytes:

    bytes = 2 (p - 1) / p (sum over the matrices of (n + m) r' + V) b

Two choices of ours. A matrix is oriented so that n <= m (transposed if taller than
wide): the bytes do not change, and at full rank (r' = n) P^ is a square orthogonal
matrix, so P^ P^T = I and the approximation is M itself to rounding, whatever Q was:
the full-rank identity holds without depending on the gradients' conditioning. And P^
comes from a Householder QR (numpy's), orthogonal to rounding however ill-conditioned
P is, where the paper's Gram-Schmidt loses orthogonality with P's condition number.

Every rank starts with the same Q, drawn from (seed, parameter name), and ends each
step with the same averaged Q, so P^ and the result are identical on every rank.
This rank's own decompression, P^ Q_own^T, is what error feedback subtracts.
"""

import zlib

import numpy as np

from numpitron.compression.segments import segments


class PowerSGD:
    def __init__(self, store, rank: int, seed: int):
        self.matrices, self.vectors, self.q = [], [], {}
        for piece in segments(store):
            if not piece.matrix:
                self.vectors.append(piece)
                continue
            n, m = piece.shape[0], int(np.prod(piece.shape[1:]))
            transpose = n > m
            short, long = (m, n) if transpose else (n, m)
            self.matrices.append((piece, transpose, short, long))
            rng = np.random.default_rng([seed, zlib.crc32(piece.name.encode())])
            self.q[piece.name] = rng.standard_normal((long, min(rank, short))).astype(store.dtype)

    def _matrix(self, grads, piece, transpose, short, long):
        x = grads[piece.lo:piece.hi].reshape(piece.shape[0], -1)
        return x.T if transpose else x                  # short x long, a view

    def reduce(self, grads: np.ndarray, comm, batch_ranks: int) -> tuple[np.ndarray, np.ndarray]:
        """(the mean over the group of every rank's approximation, this rank's own)."""
        ms = [self._matrix(grads, *entry) for entry in self.matrices]
        ps = [m @ self.q[entry[0].name] for m, entry in zip(ms, self.matrices)]
        p_buf = comm.all_reduce(np.concatenate([p.ravel() for p in ps]) if ps else np.zeros(0, grads.dtype))
        bases, at = [], 0
        for p in ps:
            bases.append(np.linalg.qr(p_buf[at:at + p.size].reshape(p.shape))[0])
            at += p.size
        qs = [m.T @ basis for m, basis in zip(ms, bases)]
        vec = [grads[v.lo:v.hi] for v in self.vectors]
        second = np.concatenate([q.ravel() for q in qs] + vec) if qs or vec else np.zeros(0, grads.dtype)
        own_second = second.copy()
        comm.all_reduce(second)
        second /= batch_ranks
        mean, own, at = np.empty_like(grads), np.empty_like(grads), 0
        for (piece, transpose, short, long), basis, q in zip(self.matrices, bases, qs):
            q_mean = second[at:at + q.size].reshape(q.shape)
            at += q.size
            self.q[piece.name] = q_mean.copy()           # the warm start of the next step
            for out, factor in ((mean, q_mean), (own, q)):
                approx = basis @ factor.T               # short x long
                out[piece.lo:piece.hi] = (approx.T if transpose else approx).ravel()
        for v in self.vectors:
            mean[v.lo:v.hi] = second[at:at + v.hi - v.lo]
            own[v.lo:v.hi] = own_second[at:at + v.hi - v.lo]
            at += v.hi - v.lo
        return mean, own

    def state(self) -> dict:
        return {f"q/{name}": q for name, q in self.q.items()}

    def load(self, arrays: dict) -> None:
        for name in self.q:
            self.q[name][...] = arrays[f"q/{name}"]

    def bytes_per_step(self, store, ranks: int) -> float:
        elements = sum((short + long) * self.q[piece.name].shape[1] for piece, _, short, long in self.matrices)
        elements += sum(v.hi - v.lo for v in self.vectors)
        return 2 * (ranks - 1) / ranks * elements * store.dtype.itemsize
