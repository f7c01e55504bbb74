"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, §5.1-5.2): optimizer state, then
also gradients, sharded over dp. (Stage 3, parameters too: zero3.py.)

Each dp rank owns one contiguous 1/dp slice [lo, hi) of the stage's flat parameter
buffer, which it pads to a multiple of dp so the slices are equal. Per step:

  1. reduce-scatter the gradients: rank r receives the dp-sum of slice r only;
  2. the global norm from the slices (each element lives on exactly one dp rank);
  3. AdamW on its slice, with that slice's m and v: 1/dp of the optimizer state;
  4. all-gather the updated slices so every rank holds the whole stage again.

A reduce-scatter plus an all-gather move the same bytes as one all-reduce (which
is implemented as exactly those two phases): ZeRO-1 saves memory for free.

Stage 2 reduce-scatters bucket by bucket during the backward instead of at the
step (step 1 moves into the backward, overlapped like plain data parallelism), and
keeps nothing but its slice of the gradients between steps.
"""

import numpy as np

from numpitron.distributed.sharding import pieces_of_range, shard_bounds
from numpitron.nn.param import mask_runs
from numpitron.optim.distributed import DistributedOptimizer, GradientGroup
from numpitron.optim.grad_norm import clip_, global_grad_sumsq
from numpitron.parallel.data_parallel import GradientBuckets


class ZeroOneOptimizer(DistributedOptimizer):
    zero_stage = 1

    def __init__(self, store, topo, train_cfg, parallel_cfg=None, group=None):
        # Sharded over the store's replicas: dp and cp together hold the same parameters
        # (an expert store: its dp/ep expert_dp ranks).
        dp = (group or GradientGroup.dense(topo)).comm
        store.pad_to_multiple(dp.size)
        super().__init__(store, topo, train_cfg, *shard_bounds(store.size, dp.size, dp.rank), group)
        self.grad_shard = np.zeros(self.hi - self.lo, store.dtype)
        # The mask runs of this rank's slice (ZeRO-3 frees the whole-stage masks).
        self.decay_runs = mask_runs(store.decay_mask[self.lo:self.hi])
        self.norm_runs = mask_runs(store.norm_mask[self.lo:self.hi])

    def memory_bytes(self) -> dict:
        """The whole gradient buffer (freed between steps from stage 2 on) and the slice."""
        memory = super().memory_bytes()
        return {**memory, "grads": memory["grads"] + self.grad_shard.nbytes}

    def reduce_grads(self) -> None:
        self.group.comm.reduce_scatter(self.store.grad, self.grad_shard)     # 1.
        self.grad_shard *= 1.0 / self.group.batch_ranks

    def grad_sumsq(self) -> float:
        # 2. Slices are disjoint over dp and stages over pp; the mask handles tp.
        return global_grad_sumsq(self.grad_shard, self.norm_runs, self.topo.world)

    def update(self, lr: float, norm: float) -> None:
        self.update_shard(self.store.data[self.lo:self.hi], lr, norm)        # 3.
        self.group.comm.all_gather(self.store.data)                          # 4.

    def update_shard(self, params_shard, lr: float, norm: float) -> None:
        """Step 3 on this rank's slice: clip by the global norm, AdamW."""
        clip_(self.grad_shard, norm, self.train_cfg.grad_clip)
        self.adam.update(params_shard, self.grad_shard, self.decay_runs, lr)

    def full_moments(self):
        """Gather m and v over dp into full-stage buffers."""
        full = []
        for shard in (self.adam.m, self.adam.v):
            buf = np.zeros(self.store.size, self.store.dtype)
            buf[self.lo:self.hi] = shard
            full.append(self.group.comm.all_gather(buf))
        return tuple(full)


class ZeroTwoOptimizer(ZeroOneOptimizer):
    """Stage 2 (P_os+g). Gradient accumulation: the m micro-batches' gradients add up
    in the whole-stage buffer, and each bucket is reduce-scattered once, as soon as
    the last micro-batch's backward has finished it. Reduce-scattering after every
    micro-batch instead would keep no whole buffer but move m times the bytes, and
    the tied embedding's and sequence parallelism's gradients are final only after
    finalize_grads anyway. The cost: the whole buffer lives from a step's first
    backward to its last reduce-scatter; between steps (the update, evaluation,
    checkpoints) only this rank's 1/dp slice exists."""

    zero_stage = 2

    def __init__(self, store, topo, train_cfg, parallel_cfg, group=None):
        super().__init__(store, topo, train_cfg, parallel_cfg, group)
        self.buckets = GradientBuckets(store, self.group.comm, parallel_cfg.bucket_size,
                                       parallel_cfg.overlap_grad_reduce, start=self.reduce_scatter_bucket)
        store.free_grads()

    def reduce_scatter_bucket(self, lo: int, hi: int):
        """Start summing grad[lo:hi] over dp; this rank keeps the part in its slice."""
        dp = self.group.comm
        counts = pieces_of_range(lo, hi, self.store.size, dp.size)
        start = max(lo, self.lo) - self.lo
        return dp.ireduce_scatter(self.store.grad[lo:hi], self.grad_shard[start:start + counts[dp.rank]], counts)

    def zero_grad(self) -> None:
        self.store.allocate_grads()

    def memory_bytes(self) -> dict:
        return {**super().memory_bytes(), "backward_grads_peak": self.store.size * self.store.dtype.itemsize}

    def grads_ready(self, params) -> None:
        self.buckets.ready(params)

    def reduce_grads(self) -> None:
        self.buckets.finish()                   # 1. the reduce-scatters the backward started
        self.store.free_grads()
        self.grad_shard *= 1.0 / self.group.batch_ranks
