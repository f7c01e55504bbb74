"""Ring attention (Liu et al. 2023): each context-parallel rank holds two chunks of every
sequence (the zigzag split, zigzag.py), and its queries must see every earlier key, so
the key/value blocks travel around the cp ring: at step s a rank attends to the block
of rank (r - s) mod cp while passing it on to rank r + 1, and folds each partial result
in with the online softmax (blockwise_attention.py). The backward sends the blocks
around again, with their gradients travelling beside them, home to their owners after
the last step. With cp = 1 the ring is one step over the rank's own block.

With Ulysses (ulysses.py) the ring runs over the cp / U groups, each of whose ranks
already holds all of its group's tokens for H / (tp U) heads.
"""

import numpy as np

from numpitron.context_parallel.blockwise_attention import AttentionState, attend_block, attend_block_backward, query_tiles
from numpitron.context_parallel.zigzag import zigzag_chunks

KV_TAG, GRAD_TAG = 10, 20


class RingAttention:
    """Causal attention of this rank's queries to every ring rank's keys and values."""

    def __init__(self, ring_comm):
        self.ring, self.rank = ring_comm, ring_comm.rank
        self.chunks = zigzag_chunks          # which positions each ring rank holds

    def forward(self, q, k, v, state: AttentionState) -> list:
        """Fold every block into `state`; the softmax groups of each ring step, one list per step."""
        T, cp = q.shape[2], self.ring.size
        mine = query_tiles(self.chunks(T, cp, self.rank))
        groups, block = [], [k, v]
        for step in range(cp):
            owner = (self.rank - step) % cp
            if step + 1 < cp:                            # pass this block on while using it
                incoming, pending = self.ring.ring_pass(block, KV_TAG)
            groups.append(attend_block(q, mine, *block, self.chunks(T, cp, owner), state))
            if step + 1 < cp:
                self.ring.wait_all(pending)
                block = incoming
        return groups

    def backward(self, steps: list, q, k, v, dout, d_rowsum, state: AttentionState, probs_of):
        """dq, dk, dv (dq without the scale q held). steps: the forward's groups per ring
        step; probs_of(step, groups, block) gives a step's groups with their probabilities
        (widened from the kept ones, or recomputed under selective recomputation)."""
        dq, dk, dv = dqkv = np.zeros((3,) + q.shape, dout.dtype)     # every group adds into them
        block, grads, n = [k, v], [dk, dv], len(steps)
        for step, groups in enumerate(steps):
            if step + 1 < n:
                incoming, pending = self.ring.ring_pass(block, KV_TAG)
            attend_block_backward(probs_of(step, groups, block), q, *block, dout, d_rowsum, state, dq, *grads)
            # The block's gradients travel with it; after the last step, home to its owner.
            grads, grad_pending = self.ring.ring_pass(grads, GRAD_TAG)
            self.ring.wait_all(grad_pending)
            if step + 1 < n:
                self.ring.wait_all(pending)
                block = incoming
        for own, arrived in zip((dk, dv), grads):
            if arrived is not own:                       # came home around the ring
                own[...] = arrived
        return dqkv

    def recompute(self, step: int, q, block, state: AttentionState) -> list:
        """A step's softmax groups again, probabilities included (selective recomputation)."""
        T, cp = q.shape[2], self.ring.size
        owner = (self.rank - step) % cp
        return attend_block(q, query_tiles(self.chunks(T, cp, self.rank)), *block, self.chunks(T, cp, owner),
                            AttentionState(q, state.precision, state.matmul))
