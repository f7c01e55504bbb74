"""Causal attention of query chunks to one block of key/value chunks, with an online
softmax, so that blocks may arrive one at a time (around a context-parallel ring, or
all at once on one rank) and the full T x T scores never need to exist together.

A chunk carries the global positions of its rows (`context_parallel.zigzag.Chunk`), which is
all the causal mask needs: a key is visible to a query when its position is not later.
Queries go in tiles of at most QUERY_TILE rows (`query_tiles`), and for each tile the
keys it can see form one softmax group: a prefix of the block's rows (its chunks are
in position order), cut where the tile's last query stops seeing (`visible_keys`).
Keys entirely in a tile's future are skipped, not masked: with tiles of t rows a
sequence of T computes about T (T + t) / 2 scores instead of T^2, skipping the blocks
a causal flash attention skips too. Each group's normalised output O_g and
log-sum-exp L_g are folded into the running result with the online-softmax rule
(Milakov & Gimelshein 2018; flash attention, Dao et al. 2022, Alg. 1):

    L = log(exp(L) + exp(L_g)),   O = O exp(L_old - L) + O_g exp(L_g - L)

The backward needs, per group, its probabilities P_g (kept) rescaled to the final
normaliser, P = P_g exp(L_g - L), and D = rowsum(dO * O) (flash attention, Alg. 2):

    dV += P^T dO,   dS = P * (dO V^T - D),   dQ += dS K,   dK += dS^T Q

Every group adds into zeroed buffers, whatever order the groups and blocks come in.
The whole computation at once, with no tiles or blocks, is
numpitron.reference.causal_attention (and _backward); the tests hold these kernels to it.
"""

from typing import NamedTuple

import numpy as np

from numpitron.context_parallel.zigzag import Chunk
from numpitron.nn.functional import softmax_lastdim_with_lse_
from numpitron.nn.matmul import PLAIN

_MASKS = {}
# Query rows per tile. Smaller tiles skip more of the masked triangle but make the
# batched matmuls smaller, and BLAS pays per matrix (the speed appendix of docs/ gives the sizes tried).
QUERY_TILE = 64


def query_tiles(chunks, rows: int | None = None) -> list:
    """The chunks cut into tiles of at most `rows` (QUERY_TILE) consecutive rows."""
    rows = rows or QUERY_TILE
    return [Chunk(c.start + i, min(c.start + i + rows, c.stop), c.position + i)
            for c in chunks for i in range(0, c.stop - c.start, rows)]


def visible_keys(q_chunk, k_chunks) -> list:
    """The part of each key chunk that the last query of q_chunk may see (positions
    not after its own), dropping chunks it cannot see at all."""
    seen = []
    for kc in k_chunks:
        n = min(kc.stop - kc.start, q_chunk.last_position - kc.position + 1)
        if n > 0:
            seen.append(Chunk(kc.start, kc.start + n, kc.position))
    return seen


def _mask(q_chunk, k_chunks, dtype):
    """Additive causal mask of a group by positions, or None when every key is visible."""
    if all(k.last_position <= q_chunk.position for k in k_chunks):
        return None
    key = (q_chunk, tuple(k_chunks), np.dtype(dtype))
    if key not in _MASKS:
        if len(_MASKS) > 256:            # generation visits many shapes: keep the cache small
            _MASKS.clear()
        q_pos = np.arange(q_chunk.position, q_chunk.last_position + 1)[:, None]
        k_pos = np.concatenate([np.arange(k.position, k.last_position + 1) for k in k_chunks])[None, :]
        _MASKS[key] = np.where(k_pos > q_pos, -np.inf, 0.0).astype(dtype)
    return _MASKS[key]


class AttentionState:
    """The running output O (B, H, T, hd) and log-sum-exp L (B, H, T, 1) of the queries,
    how many groups each query chunk has folded in, and the layer's products (nn/matmul.py)."""

    def __init__(self, q, precision, matmul=PLAIN):
        self.precision, self.matmul = precision, matmul     # the run's format: the probabilities are rounded to it
        self.out = np.empty_like(q)     # every query row is written by its first group
        self.lse = np.full(q.shape[:-1] + (1,), -np.inf, q.dtype)
        self.groups = {}


class SoftmaxGroup(NamedTuple):
    """What the backward needs of one softmax group: a query tile and the keys it saw."""
    queries: Chunk          # the tile's rows of q
    key_end: int            # it saw the block's key rows [0, key_end)
    probs: np.ndarray | None    # P_g (B, H, tq, key_end), normalised by the group's own L_g;
    #                             None under selective recomputation (transformer/attention.py)
    lse: np.ndarray         # L_g (B, H, tq, 1)


def attend_block(q, q_chunks, k, v, k_chunks, state: AttentionState) -> list[SoftmaxGroup]:
    """Fold the attention of q's chunks to the visible chunks of (k, v) into `state`.
    q holds the 1/sqrt(hd) scale already. Returns the block's softmax groups, for the
    backward."""
    groups = []
    for qc in q_chunks:
        visible = visible_keys(qc, k_chunks)
        if not visible:
            continue
        end = visible[-1].stop                      # the visible chunks are rows [0, end)
        rows = slice(qc.start, qc.stop)
        probs = state.matmul.product(q[:, :, rows], k[:, :, :end].transpose(0, 1, 3, 2))   # S = q k^T, (B, H, tq, tk)
        mask = _mask(qc, visible, q.dtype)
        if mask is not None:
            probs += mask
        lse = softmax_lastdim_with_lse_(probs)      # now P_g = softmax(S), in place
        state.precision.round_(probs)               # the softmax kernel writes the low format
        seen = state.groups.get(qc, 0)
        if seen == 0:                               # the first group of these queries: write in place
            state.matmul.product(probs, v[:, :, :end], out=state.out[:, :, rows])
            state.lse[:, :, rows] = lse
        else:
            out = state.matmul.product(probs, v[:, :, :end])
            old = state.lse[:, :, rows]
            new = np.logaddexp(old, lse)
            state.out[:, :, rows] *= np.exp(old - new)
            state.out[:, :, rows] += out * np.exp(lse - new)
            state.lse[:, :, rows] = new
        state.groups[qc] = seen + 1
        groups.append(SoftmaxGroup(qc, end, probs, lse))
    return groups


def attend_block_backward(groups: list[SoftmaxGroup], q, k, v, dout, d_rowsum, state: AttentionState,
                          dq, dk, dv) -> None:
    """Add one block's contribution to dq (unscaled: the caller applies the scale) and
    to this block's dk and dv. Every buffer accumulates: the caller zeroes them first."""
    product, add_product = state.matmul.product, state.matmul.add_product
    for group in groups:
        rows, end = slice(group.queries.start, group.queries.stop), group.key_end
        probs = group.probs
        if state.groups[group.queries] > 1:         # the group's own normaliser was not the final one
            probs = probs * np.exp(group.lse - state.lse[:, :, rows])
        do = dout[:, :, rows]
        add_product(probs.transpose(0, 1, 3, 2), do, dv[:, :, :end])
        ds = product(do, v[:, :, :end].transpose(0, 1, 3, 2))
        ds -= d_rowsum[:, :, rows]
        ds *= probs
        add_product(ds, k[:, :, :end], dq[:, :, rows])
        add_product(ds.transpose(0, 1, 3, 2), q[:, :, rows], dk[:, :, :end])
