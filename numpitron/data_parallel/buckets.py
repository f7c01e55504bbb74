"""Plain data parallelism (ZeRO stage 0): every dp rank keeps the whole optimizer,
and gradients are averaged over dp in buckets that overlap the backward. (Over dp
and cp together: context-parallel ranks hold the same parameters and each computed
the gradient of its own part of every sequence, so their gradients are averaged too.)

The flat gradient buffer is cut into buckets of about `bucket_size` elements, along
parameter boundaries, from the end of the buffer: the backward produces the last
layers' gradients first. During the last micro-batch's backward the model reports
each layer's finished gradients (`grads_ready`); once every parameter of a bucket is
in, its all-reduce starts, non-blocking, while the backward of earlier layers goes
on. `step` waits for them next to the math that needs the sum. This is what
PyTorch DDP, Megatron-LM and picotron do; across hosts it hides most of the reduce.
"""

from dataclasses import replace

from numpitron.data_parallel.hierarchical import hierarchical_all_reduce
from numpitron.data_parallel.distributed_optimizer import DistributedOptimizer, GradientGroup
from numpitron.optim.grad_norm import clip_, global_grad_sumsq
from numpitron.optim.training_state import TrainingState


class GradientBuckets:
    """`start(lo, hi)` begins the non-blocking reduction of grad[lo:hi] over the group
    and returns its Pending: an all-reduce under plain dp, a reduce-scatter under ZeRO-2."""

    def __init__(self, store, dp_comm, bucket_size: int, overlap: bool, start):
        self.store, self.dp, self.overlap, self.start = store, dp_comm, overlap, start
        self.buckets = []                 # [lo, hi) of the flat buffer, last first
        names, hi = [], store.size        # the padding, if any, rides in the first bucket
        for p in reversed(store.params):
            names.append(p.name)
            lo = store.offsets[p.name][0]
            if hi - lo >= bucket_size or lo == 0:
                self.buckets.append((lo, hi, frozenset(names)))
                names, hi = [], lo
        self.reset()

    def reset(self) -> None:
        self.reported, self.pending = set(), {}

    def ready(self, params) -> None:
        """Start the all-reduce of every bucket whose gradients are now all final."""
        if not self.overlap or self.dp.size == 1:
            return
        self.reported.update(p.name for p in params)
        for index, (lo, hi, names) in enumerate(self.buckets):
            if index not in self.pending and names <= self.reported:
                self.pending[index] = self.start(lo, hi)
        self.dp.test(list(self.pending.values()))

    def finish(self) -> None:
        """Every bucket reduced over the group: wait for those in flight, start and
        wait for the rest (all of them without overlap)."""
        for index, (lo, hi, _) in enumerate(self.buckets):
            self.dp.wait(self.pending[index] if index in self.pending else self.start(lo, hi))
        self.reset()


class DataParallelOptimizer(DistributedOptimizer):
    """Average gradients over dp, clip by the global norm, AdamW on the full stage."""

    zero_stage = 0

    def __init__(self, store, topo, train_cfg, parallel_cfg, group=None, precision=None):
        super().__init__(store, topo, train_cfg, 0, store.size, group, precision)
        self.state = TrainingState(store, self.group.comm, self.adam, 0, store.data)
        self.buckets = GradientBuckets(store, self.group.comm, parallel_cfg.bucket_size,
                                       parallel_cfg.overlap_grad_reduce, start=self.all_reduce_bucket)

    def all_reduce_bucket(self, lo: int, hi: int):
        """Start summing grad[lo:hi] over dp, in the low format or fp32 (docs/07-numbers.md)."""
        return self.group.comm.iall_reduce(self.low_grads(self.store.grad[lo:hi]), self.grad_wire)

    def grads_ready(self, params) -> None:
        self.buckets.ready(params)

    def reduce_grads(self) -> None:
        self.buckets.finish()
        # The sum becomes the global batch's mean: divided by the data-parallel ranks it
        # covers (the group's size, but for experts: docs/13-experts.md).
        self.store.grad *= 1.0 / self.group.batch_ranks

    def grad_sumsq(self) -> float:
        # Gradients are now identical across dp: the norm spans one model replica.
        return global_grad_sumsq(self.store.grad, self.store.norm_runs, self.group.whole_copy_comm)

    def update(self, lr: float, norm: float) -> None:
        clip_(self.store.grad, norm, self.train_cfg.grad_clip)
        self.adam.update(self.store.data, self.store.grad, self.store.decay_runs, lr)


class HierarchicalDataParallelOptimizer(DataParallelOptimizer):
    """`--hierarchical-all-reduce`: plain data parallelism whose gradients are summed in
    two levels (data_parallel/hierarchical.py) over HSDP's groups, dp_shard inside a host
    and dp_replica across hosts, in one call after the backward instead of MPI's
    all-reduce bucket by bucket during it. The store is padded to a multiple of the
    shard group so the host's slices are equal."""

    def __init__(self, store, topo, train_cfg, parallel_cfg, group=None, precision=None):
        group = group or GradientGroup.dense(topo)
        store.pad_to_multiple(group.shard_comm.size)
        super().__init__(store, topo, train_cfg, replace(parallel_cfg, overlap_grad_reduce=False), group, precision)

    def reduce_grads(self) -> None:
        hierarchical_all_reduce(self.low_grads(self.store.grad), self.group.shard_comm, self.group.copies_comm,
                                self.grad_wire)
        self.store.grad *= 1.0 / self.group.batch_ranks
