"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, §5.1-5.2): optimizer state, then
also gradients, sharded over dp. (Stage 3, parameters too: zero3.py.)

Each dp rank owns one contiguous 1/dp slice [lo, hi) of the stage's flat parameter
buffer, which it pads to a multiple of dp so the slices are equal (`OwnedSlice`,
which stage 3 shares). Per step:

  1. reduce-scatter the gradients: rank r receives the dp-sum of slice r only;
  2. the global norm from the slices (each element lives on exactly one dp rank);
  3. AdamW on its slice, with that slice's m and v: 1/dp of the optimizer state;
  4. all-gather the updated slices so every rank holds the whole stage again.

A reduce-scatter plus an all-gather move the same bytes as one all-reduce (which
is implemented as exactly those two phases): ZeRO-1 saves memory for free.

Stage 2 reduce-scatters bucket by bucket during the backward instead of at the
step (step 1 moves into the backward, overlapped like plain data parallelism), and
keeps nothing but its slice of the gradients between steps.

Hybrid sharding (HSDP, docs/09-zero-2-and-3.md): "dp" above is the shard group
(dp_shard, cp x S ranks, inside a host), and between steps 1 and 2 each rank's
gradient slice is all-reduced over its copies in the other replicas (dp_replica,
dp / S ranks, across hosts): 1/(cp S) of the gradients cross the slow link. With
S = dp the replica group has one rank and that all-reduce is a no-op.
"""

import numpy as np

from numpitron.distributed.sharding import piece_in_slice, pieces_of_range, shard_bounds
from numpitron.nn.mask_runs import mask_runs
from numpitron.data_parallel.distributed_optimizer import DistributedOptimizer, GradientGroup
from numpitron.optim.grad_norm import clip_, global_grad_sumsq
from numpitron.optim.training_state import TrainingState
from numpitron.data_parallel.buckets import GradientBuckets


class OwnedSlice:
    """This rank's 1/g slice [lo, hi) of a store's flat buffers, g the shard group's
    size (the store padded so the slices are equal): the summed gradients on it, the
    runs of its elements that the norm counts and weight decay applies to, and where
    any range of the whole buffer falls over the ranks' slices. What ZeRO stages 1, 2
    and 3 share."""

    def __init__(self, store, group: GradientGroup):
        comm = group.shard_comm
        store.pad_to_multiple(comm.size)
        self.size, self.comm, self.group = store.size, comm, group
        self.lo, self.hi = shard_bounds(store.size, comm.size, comm.rank)
        self.grads = np.zeros(self.hi - self.lo, store.dtype)
        self.decay_runs = mask_runs(store.decay_mask[self.lo:self.hi])
        self.norm_runs = mask_runs(store.norm_mask[self.lo:self.hi])

    def split(self, lo: int, hi: int) -> tuple[list[int], slice]:
        """[lo, hi) of the whole buffer over the ranks' slices: each rank's count (of a
        reduce-scatter or an all-gather of the range), and where this rank's piece lies
        within its own slice."""
        return (pieces_of_range(lo, hi, self.size, self.comm.size),
                piece_in_slice(lo, hi, self.size, self.comm.size, self.comm.rank))

    def average(self, wire=None) -> None:
        """The slice, summed over the shard group, summed over the replicas too (the
        one collective of a step that crosses hosts under HSDP; in `wire`, the
        gradients' format), then the mean over the global batch."""
        self.group.copies_comm.all_reduce(self.grads, wire=wire)
        self.grads *= 1.0 / self.group.batch_ranks

    def grad_sumsq(self) -> float:
        """Slices are disjoint over the shard group and stages over pp; the norm mask
        handles tp; the replicas' identical copies are left out (one replica's ranks)."""
        return global_grad_sumsq(self.grads, self.norm_runs, self.group.shard_norm_comm)

    def update(self, adam, params, lr: float, norm: float, max_norm: float) -> None:
        """Clip the slice's gradients by the global norm, AdamW on `params` (the slice)."""
        clip_(self.grads, norm, max_norm)
        adam.update(params, self.grads, self.decay_runs, lr)


class ZeroOneOptimizer(DistributedOptimizer):
    zero_stage = 1

    def __init__(self, store, topo, train_cfg, parallel_cfg=None, group=None, precision=None):
        # Sharded over the shard group: dp and cp together hold the same parameters, S
        # of the dp ranks (HSDP; all of them by default) split them (an expert store:
        # its dp/ep expert_dp ranks).
        group = group or GradientGroup.dense(topo)
        self.owned = OwnedSlice(store, group)
        super().__init__(store, topo, train_cfg, self.owned.lo, self.owned.hi, group, precision)
        self.state = TrainingState(store, group.shard_comm, self.adam, self.lo, store.data, copies=group.copies_comm)

    def kept_grads(self) -> list[np.ndarray]:
        """The whole gradient buffer (freed between steps from stage 2 on) and the slice."""
        return super().kept_grads() + [self.owned.grads]

    def reduced_grads(self) -> np.ndarray:
        return self.owned.grads

    def reduce_grads(self) -> None:
        self.group.shard_comm.reduce_scatter(self.low_grads(self.store.grad), self.owned.grads, self.grad_wire)  # 1.
        self.owned.average(self.grad_wire)

    def grad_sumsq(self) -> float:
        return self.owned.grad_sumsq()                                       # 2.

    def update(self, lr: float, norm: float) -> None:
        self.owned.update(self.adam, self.store.data[self.lo:self.hi], lr, norm, self.train_cfg.grad_clip)  # 3.
        self.group.shard_comm.all_gather(self.store.data, self.param_wire)   # 4.


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

    def __init__(self, store, topo, train_cfg, parallel_cfg, group=None, precision=None):
        super().__init__(store, topo, train_cfg, parallel_cfg, group, precision)
        self.buckets = GradientBuckets(store, self.group.shard_comm, parallel_cfg.bucket_size,
                                       parallel_cfg.overlap_grad_reduce, start=self.reduce_scatter_bucket)
        store.free_grads()

    def reduce_scatter_bucket(self, lo: int, hi: int):
        """Start summing grad[lo:hi] over the shard group; this rank keeps the part in its slice."""
        counts, mine = self.owned.split(lo, hi)
        return self.group.shard_comm.ireduce_scatter(self.low_grads(self.store.grad[lo:hi]), self.owned.grads[mine],
                                                     counts, self.grad_wire)

    def zero_grad(self) -> None:
        self.store.allocate_grads()

    def pass_peaks(self) -> tuple[int, int]:
        return 0, self.store.size

    def grads_ready(self, params) -> None:
        self.buckets.ready(params)

    def reduce_grads(self) -> None:
        self.buckets.finish()                   # 1. the reduce-scatters the backward started
        self.store.free_grads()
        self.owned.average(self.grad_wire)
