"""ZeRO stage 1 (Rajbhandari et al. 2020, §5.1, P_os): optimizer state sharded over dp.

Each dp rank owns one contiguous 1/dp slice [lo, hi) of the stage's flat parameter
buffer, which it pads to a multiple of dp so the slices are equal. Per step:

  1. reduce-scatter the gradients: rank r receives the dp-sum of slice r only;
  2. the global norm from the slices (each element lives on exactly one dp rank);
  3. AdamW on its slice, with that slice's m and v: 1/dp of the optimizer state;
  4. all-gather the updated slices so every rank holds the whole stage again.

A reduce-scatter plus an all-gather move the same bytes as one all-reduce (which
is implemented as exactly those two phases): ZeRO-1 saves memory for free.
"""

import numpy as np

from numpitron.distributed.sharding import shard_bounds
from numpitron.optim.distributed import DistributedOptimizer, GradientGroup
from numpitron.optim.grad_norm import clip_, global_grad_sumsq


class ZeroOneOptimizer(DistributedOptimizer):
    zero_stage = 1

    def __init__(self, store, topo, train_cfg, parallel_cfg=None, group=None):
        # Sharded over the store's replicas: dp and cp together hold the same parameters
        # (an expert store: its dp/ep expert_dp ranks).
        dp = (group or GradientGroup.dense(topo)).comm
        store.pad_to_multiple(dp.size)
        super().__init__(store, topo, train_cfg, *shard_bounds(store.size, dp.size, dp.rank), group)
        self.grad_shard = np.zeros(self.hi - self.lo, store.dtype)

    def reduce_grads(self) -> None:
        self.group.comm.reduce_scatter(self.store.grad, self.grad_shard)     # 1.
        self.grad_shard *= 1.0 / self.group.batch_ranks

    def grad_sumsq(self) -> float:
        # 2. Slices are disjoint over dp and stages over pp; the mask handles tp.
        return global_grad_sumsq(self.grad_shard, self.store.norm_mask[self.lo:self.hi], self.topo.world)

    def update(self, lr: float, norm: float) -> None:
        lo, hi = self.lo, self.hi
        clip_(self.grad_shard, norm, self.train_cfg.grad_clip)
        self.adam.update(self.store.data[lo:hi], self.grad_shard,            # 3.
                         self.store.decay_mask[lo:hi], lr)
        self.group.comm.all_gather(self.store.data)                          # 4.

    def full_moments(self):
        """Gather m and v over dp into full-stage buffers (for checkpoints only)."""
        full = []
        for shard in (self.adam.m, self.adam.v):
            buf = np.zeros(self.store.size, self.store.dtype)
            buf[self.lo:self.hi] = shard
            full.append(self.group.comm.all_gather(buf))
        return tuple(full)
