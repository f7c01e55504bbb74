"""Parameters that know their logical name, shape and tensor-parallel split,
living as views into one flat buffer per pipeline stage.

The flat buffers are what make the parallel machinery simple: data parallelism
all-reduces a few large slices (buckets) of the gradient buffer, ZeRO-1 hands each rank one
contiguous slice of it, and AdamW is a single vectorised update over the whole
buffer (or a slice). Checkpoints and gradient norms are generic over `Param`.
"""

import zlib
from dataclasses import dataclass, field

import numpy as np

from numpitron.distributed.sharding import pad_to_multiple, shard_bounds


def mask_runs(mask) -> list[tuple[int, int]]:
    """[(start, stop), ...] in order, covering exactly the nonzero elements of a mask over
    a flat buffer. A mask fixed per parameter is a handful of such runs (one per tensor,
    merged where neighbours agree), so work over the masked elements can go run by run
    instead of through a masked copy."""
    on = np.concatenate([[False], np.asarray(mask) != 0, [False]])
    edges = np.flatnonzero(on[1:] != on[:-1])       # alternately a start and a stop
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


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


class ParamStore:
    """One stage's parameters as views into a flat data buffer and a flat grad buffer.

    `size` may exceed the parameters' `numel`: an optimizer that shards the buffers
    over dp pads them (`pad_to_multiple`) so every rank owns an equal slice.
    """

    def __init__(self, params: list[Param], dtype, tp_rank: int = 0):
        names = [p.name for p in params]
        self.by_name = {p.name: p for p in params}
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate parameter names in {names}")
        self.params = params
        self.dtype = np.dtype(dtype)
        self.offsets = {}
        offset = 0
        for p in params:
            n = int(np.prod(p.local_shape))
            self.offsets[p.name] = (offset, offset + n)
            offset += n
        self.numel = offset                      # real elements
        self.tp_rank = tp_rank
        self._allocate(self.numel)

    def _allocate(self, size: int, old_data=None) -> None:
        self.size = size
        self.data = np.zeros(size, self.dtype)
        self.grad = np.zeros(size, self.dtype)
        if old_data is not None:
            self.data[:self.numel] = old_data[:self.numel]
        self.decay_mask = np.zeros(size, self.dtype)
        self.norm_mask = np.zeros(size, self.dtype)
        for p in self.params:
            start, stop = self.offsets[p.name]
            p.data = self.data[start:stop].reshape(p.local_shape)
            p.grad = self.grad[start:stop].reshape(p.local_shape)
            self.decay_mask[start:stop] = p.decay
            self.norm_mask[start:stop] = p.in_norm and p.counted_on(self.tp_rank)
        self.norm_runs = mask_runs(self.norm_mask)      # what the gradient norm sums over
        self.decay_runs = mask_runs(self.decay_mask)    # what AdamW's weight decay applies to

    def pad_to_multiple(self, multiple: int) -> None:
        """Grow the buffers with zeros to a multiple of `multiple` elements, keeping the
        parameters' values (every Param is pointed at the new buffers)."""
        size = pad_to_multiple(self.numel, multiple)
        if size != self.size:
            self._allocate(size, old_data=self.data)

    def initialize(self, seed: int) -> None:
        for p in self.params:
            p.data[...] = p.draw_full(seed)[p.tp_slice()]

    def zero_grad(self) -> None:
        self.grad.fill(0)

    def allocate_grads(self) -> None:
        """A fresh zeroed gradient buffer, every Param.grad a view of it (ZeRO-2 frees
        the whole-stage gradients between steps and allocates them again here)."""
        self.grad = np.zeros(self.size, self.dtype)
        for p in self.params:
            start, stop = self.offsets[p.name]
            p.grad = self.grad[start:stop].reshape(p.local_shape)

    def free_buffers(self) -> None:
        """Drop every whole-stage buffer: ZeRO-3 keeps its own 1/dp slices instead and
        points the Params at gathered layers only while they run."""
        self.free_grads()
        self.data = self.decay_mask = self.norm_mask = None
        for p in self.params:
            p.data = None

    def free_grads(self) -> None:
        """Drop the whole-stage gradient buffer; a gradient written before the next
        allocate_grads fails loudly instead of landing nowhere."""
        self.grad = None
        for p in self.params:
            p.grad = None

    def view(self, flat: np.ndarray, name: str) -> np.ndarray:
        """The slice of any flat buffer laid out like `data` (Adam m or v) for one param."""
        start, stop = self.offsets[name]
        param = self.by_name[name]
        return flat[start:stop].reshape(param.local_shape)
