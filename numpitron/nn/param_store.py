"""A stage's parameters as views into one flat buffer (and their gradients into another).

The flat buffers are what make the parallel machinery simple: data parallelism
all-reduces a few large slices (buckets) of the gradient buffer, ZeRO-1 hands each rank one
contiguous slice of it, and AdamW is a single vectorised update over the whole
buffer (or a slice).
"""

import numpy as np

from numpitron.distributed.sharding import pad_to_multiple
from numpitron.nn.mask_runs import mask_runs
from numpitron.nn.param import Param


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
