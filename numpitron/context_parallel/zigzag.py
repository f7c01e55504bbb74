"""Context parallelism: every sequence split over the cp ranks of a group.

The zigzag split (as in Megatron-LM's and picotron's context parallelism): a sequence
of T tokens is cut into 2*cp chunks of T/(2cp), and rank r holds chunk r and chunk
2cp-1-r. Causal attention makes late queries cost more than early ones (a query
attends to every earlier key); pairing one early and one late chunk on every rank
gives each rank the same work: 2cp + 1 (query chunk, key chunk) pairs over a whole
ring, where a plain split into cp contiguous parts gives rank r the r + 1 blocks of ranks
0..r, each twice as long both ways (4r + 2 of the zigzag's chunk squares against 2cp).
With cp = 1 the rank holds both halves of the sequence, in order.

It sits with the mesh, below the layers, because attention, the model's position
embedding and the trainer's batches all ask it which positions a rank holds.
"""

from typing import NamedTuple

import numpy as np

from numpitron.distributed.sharding import shard_size


class Chunk(NamedTuple):
    """Rows [start, stop) of a local array hold positions position..position+stop-start."""
    start: int
    stop: int
    position: int

    @property
    def last_position(self) -> int:
        return self.position + self.stop - self.start - 1


def zigzag_chunks(local_len: int, cp: int, rank: int) -> list[Chunk]:
    """The two chunks rank `rank` of a cp group holds, in its local row order. (With
    cp = 1 the length may be odd: the second half is the longer.)"""
    size = local_len // 2
    return [Chunk(0, size, rank * size), Chunk(size, local_len, (2 * cp - 1 - rank) * size)]


def contiguous_chunks(local_len: int, cp: int, rank: int) -> list[Chunk]:
    """The plain split, for comparison only: rank r holds part r of cp, whole."""
    return [Chunk(0, local_len, rank * local_len)]


def local_positions(seq_len: int, cp: int, rank: int) -> np.ndarray:
    """Global positions of the tokens rank `rank` holds, in its local order: (T/cp,)."""
    return np.concatenate([np.arange(c.position, c.last_position + 1)
                           for c in zigzag_chunks(shard_size(seq_len, cp), cp, rank)])
