"""Ulysses context parallelism: an all-to-all trades the sequence split for a head split
(DeepSpeed-Ulysses, Jacobs et al. 2023, §3.1, Fig. 2), and its hybrid with the ring
(USP, Fang & Zhao 2024, §3).

Around attention each rank of a Ulysses group of U ranks holds its own T/cp tokens of
every local head (H/tp of them). One all-to-all over the group gives it every token the
group holds, U T/cp of them, for H/(tp U) heads: send block s is this rank's tokens of
head group s, receive block s is rank s's tokens of this rank's head group. Attention
then needs nothing from the other members, and a second all-to-all turns its output
back. The backward is the same two exchanges, the other way round.

The members' tokens are zigzag chunks (context_parallel/zigzag.py), so the received rows are
not in position order. The U consecutive cp ranks of group g hold the chunks
gU .. gU+U-1 and, mirrored, 2cp-U(g+1) .. 2cp-1-gU: two contiguous runs, which are
exactly chunks g and 2R-1-g of the zigzag split of the sequence over R = cp/U groups.
So `to_heads` puts each received chunk where its positions belong, and the group's
rows form the zigzag part of group g: the ring runs over the R groups (ranks with the
same place in their groups, which hold the same heads) unchanged. U = cp is pure
Ulysses (R = 1: the ring is one step over the whole sequence), U = 1 the ring alone
(both exchanges return their input).
"""

import numpy as np

from numpitron.context_parallel.zigzag import zigzag_chunks


def group_rows(local_len: int, cp: int, ulysses: int, cp_rank: int) -> list[tuple[int, slice, slice]]:
    """Where each member's rows land in the group's position-ordered rows:
    (member s, its local rows, the group's rows) for each of its two chunks."""
    group = cp_rank // ulysses
    targets = zigzag_chunks(ulysses * local_len, cp // ulysses, group)
    moves = []
    for member in range(ulysses):
        for c in zigzag_chunks(local_len, cp, group * ulysses + member):
            home = next(t for t in targets if t.position <= c.position <= t.last_position)
            start = home.start + c.position - home.position
            moves.append((member, slice(c.start, c.stop), slice(start, start + c.stop - c.start)))
    return moves


class HeadExchange:
    """The two all-to-alls of one Ulysses group. Arrays are (..., heads, tokens, d):
    any leading axes (q|k|v stacked, batch) travel along."""

    def __init__(self, comm, cp: int, cp_rank: int):
        self.comm, self.cp, self.cp_rank = comm, cp, cp_rank

    def to_heads(self, x: np.ndarray) -> np.ndarray:
        """(..., h, t, d), this rank's tokens of h heads -> (..., h/U, U t, d), the
        group's tokens of this rank's h/U heads, in position order."""
        U = self.comm.size
        if U == 1:                       # a size-1 all-to-all is the identity
            return x
        *lead, h, t, d = x.shape
        axis = len(lead)
        send = np.ascontiguousarray(np.moveaxis(x.reshape(*lead, U, h // U, t, d), axis, 0))
        received = self.comm.all_to_all(send)            # block s: member s's tokens of my heads
        out = np.empty((*lead, h // U, U * t, d), x.dtype)
        for member, mine, theirs in group_rows(t, self.cp, U, self.cp_rank):
            out[..., theirs, :] = received[member][..., mine, :]
        return out

    def to_tokens(self, y: np.ndarray) -> np.ndarray:
        """The inverse: (..., h/U, U t, d) -> (..., h, t, d)."""
        U = self.comm.size
        if U == 1:
            return y
        *lead, g, n, d = y.shape
        t = n // U
        send = np.empty((U, *lead, g, t, d), y.dtype)
        for member, mine, theirs in group_rows(t, self.cp, U, self.cp_rank):
            send[member][..., mine, :] = y[..., theirs, :]
        received = self.comm.all_to_all(send)            # block s: my tokens of member s's heads
        return np.moveaxis(received, 0, len(lead)).reshape(*lead, U * g, t, d)
