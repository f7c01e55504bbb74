"""ZeRO stage 1 (Rajbhandari et al. 2020, §5.1, P_os): optimizer state sharded over dp.

Each dp rank owns one contiguous 1/dp slice [lo, hi) of the stage's flat parameter
buffer (padded so the slices are equal). Per step:

  1. reduce-scatter the gradients: rank r receives the dp-sum of slice r only;
  2. the global norm from the slices (each element lives on exactly one dp rank);
  3. AdamW on its slice, with that slice's m and v: 1/dp of the optimizer state;
  4. all-gather the updated slices so every rank holds the whole stage again.

A reduce-scatter plus an all-gather move the same bytes as one all-reduce (which
is implemented as exactly those two phases): ZeRO-1 saves memory for free.
"""

import numpy as np

from numpitron.distributed.sharding import shard_bounds
from numpitron.optim.adamw import AdamW
from numpitron.optim.grad_norm import clip_, global_grad_norm


class ZeroOneOptimizer:
    zero_stage = 1

    def __init__(self, store, topo, train_cfg):
        self.store, self.topo, self.cfg = store, topo, train_cfg
        self.lo, self.hi = shard_bounds(store.size, topo.dp, topo.dp_rank)
        self.grad_shard = np.zeros(self.hi - self.lo, store.dtype)
        self.adam = AdamW(self.hi - self.lo, store.dtype, train_cfg.beta1, train_cfg.beta2,
                          train_cfg.eps, train_cfg.weight_decay)

    def step(self, lr: float) -> float:
        dp = self.topo.dp_comm
        lo, hi = self.lo, self.hi
        dp.reduce_scatter(self.store.grad, self.grad_shard)             # 1.
        self.grad_shard *= 1.0 / dp.size
        # 2. Slices are disjoint over dp and stages over pp; the mask handles tp.
        norm = global_grad_norm(self.grad_shard, self.store.norm_mask[lo:hi], self.topo.world)
        clip_(self.grad_shard, norm, self.cfg.grad_clip)
        self.adam.update(self.store.data[lo:hi], self.grad_shard,       # 3.
                         self.store.decay_mask[lo:hi], lr)
        dp.all_gather(self.store.data)                                  # 4.
        return norm

    def full_moments(self):
        """Gather m and v over dp into full-stage buffers (for checkpoints only)."""
        full = []
        for shard in (self.adam.m, self.adam.v):
            buf = np.zeros(self.store.size, self.store.dtype)
            buf[self.lo:self.hi] = shard
            full.append(self.topo.dp_comm.all_gather(buf))
        return tuple(full)

    def load_moments(self, m_full, v_full, step_count: int) -> None:
        """m and v laid out like the stage's flat buffer: keep this rank's slice."""
        self.adam.load_state(m_full[self.lo:self.hi], v_full[self.lo:self.hi], step_count)

    def state_nbytes(self) -> int:
        return self.adam.state_nbytes


def make_optimizer(store, topo, train_cfg, parallel_cfg):
    from numpitron.parallel.data_parallel import DataParallelOptimizer
    if parallel_cfg.zero_stage == 1:
        return ZeroOneOptimizer(store, topo, train_cfg)
    return DataParallelOptimizer(store, topo, train_cfg, parallel_cfg.bucket_size)
