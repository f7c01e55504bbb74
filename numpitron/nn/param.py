"""Parameters that know their logical name, shape and tensor-parallel split.

Checkpoints, gradient norms and initialisation are generic over `Param`; a stage's
parameters live as views into one flat buffer (nn/param_store.py).
"""

import zlib
from dataclasses import dataclass, field

import numpy as np

from numpitron.distributed.sharding import shard_bounds


@dataclass(eq=False)
class Param:
    """One logical parameter; `data` and `grad` hold this rank's slice.

    full_shape is the shape that is split over tp (the vocabulary padded to a
    multiple of tp); logical_shape is the real tensor, saved in checkpoints and drawn
    at initialisation, the padding being zeros that never receive gradient.
    """

    name: str
    full_shape: tuple
    split_axis: int | None = None      # tensor-parallel split axis; None = replicated
    init: str = "normal"               # "normal", "zeros" or "ones"
    std: float = 0.02
    decay: bool = True                 # AdamW weight decay (matrices and embeddings)
    logical_shape: tuple | None = None
    in_norm: bool = True               # False for a copy held elsewhere too (tied head): not in the norm, not saved
    tp_rank: int = 0
    tp_size: int = 1
    data: np.ndarray = field(default=None, repr=False)
    grad: np.ndarray = field(default=None, repr=False)

    def __post_init__(self):
        self.full_shape = tuple(self.full_shape)
        self.logical_shape = tuple(self.logical_shape or self.full_shape)

    def tp_slice(self) -> tuple:
        """Index of this rank's shard within the full (padded) tensor."""
        index = [slice(None)] * len(self.full_shape)
        if self.split_axis is not None:
            start, stop = shard_bounds(self.full_shape[self.split_axis], self.tp_size, self.tp_rank)
            index[self.split_axis] = slice(start, stop)
        return tuple(index)

    def counted_on(self, tp_rank: int) -> bool:
        """Whether tp rank `tp_rank`'s copy is the one counted among its tp peers, in the
        gradient norm and in a checkpoint: a split tensor on every rank (each holds its
        own slice), a tp-replicated one on tp rank 0 only (the others hold the same)."""
        return self.split_axis is not None or tp_rank == 0

    @property
    def local_shape(self) -> tuple:
        # Python ints throughout (not len(range)): a planner may ask about sizes no host holds.
        return tuple(max(0, stop - start) for start, stop, _ in (s.indices(n) for s, n in zip(self.tp_slice(),
                                                                                                self.full_shape)))

    def draw_full(self, seed: int) -> np.ndarray:
        """The full logical tensor at initialisation, identical on every mesh: drawn from
        a generator seeded by (seed, name), then padded with zeros."""
        if self.init == "zeros":
            return np.zeros(self.full_shape)
        if self.init == "ones":
            return np.ones(self.full_shape)
        rng = np.random.default_rng([seed, zlib.crc32(self.name.encode())])
        return pad_to_full(rng.normal(0.0, self.std, self.logical_shape), self.full_shape)


def pad_to_full(logical: np.ndarray, full_shape: tuple) -> np.ndarray:
    if logical.shape == tuple(full_shape):
        return logical
    full = np.zeros(full_shape, dtype=logical.dtype)
    full[tuple(slice(0, n) for n in logical.shape)] = logical
    return full
