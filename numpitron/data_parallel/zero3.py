"""ZeRO stage 3 (Rajbhandari et al. 2020, §5.3, P_os+g+p; PyTorch calls it FSDP):
parameters sharded over dp too.

Each dp rank keeps only its 1/dp slice [lo, hi) of the stage's flat buffers: the
parameters, their gradients and Adam's moments. A layer's parameters exist whole
only while the layer runs:

  forward   all-gather the layer's parameters, run it, free them; the next layer's
            all-gather is already in flight (prefetch) while this one computes;
  backward  all-gather them again (and prefetch the layer before), run the backward
            into a gradient buffer for this layer alone, free the parameters, start
            reduce-scattering the gradients: each rank adds the piece in its slice
            to its gradient slice, and the layer's gradient buffer is freed.

The units are FSDP's usual wrapping: each transformer block is one, and the rest
(embeddings, positions, final LayerNorm: the "root", which the first and last
layers share through the tied embedding) is one that stays gathered from the
first forward of a step to its update. A layer's parameters are cut where the
ranks' slices of the whole stage fall (`OwnedSlice.split`), so one rank may hold all
of a small layer and another none: the bytes a pass moves add up to the whole
stage all the same.

Gradient accumulation: every micro-batch's backward reduce-scatters each block
(nothing whole survives a layer's backward); the root's gradients, like its
parameters, stay whole for the step. Traffic per step, with N the stage's elements
and R the root's: all-gathers of N + (2m - 1)(N - R) and reduce-scatters of
R + m(N - R), each times (dp-1)/dp; with m = 1 about 1.5 all-reduces.

Hybrid sharding (HSDP): "dp" above is the shard group (dp_shard, inside a host);
the gathers and reduce-scatters stay in it, and once per step each rank's gradient
slice is all-reduced over the replicas (dp_replica, across hosts): `OwnedSlice.average`.

Pipeline parallelism would regather every layer for every micro-batch on every
stage; config.py refuses it (as Megatron-LM and DeepSpeed do).

Experts: only the dense store is gathered layer by layer. A MoE block's experts live in
the other store, whole on the ranks that hold them (their ep rank's share, E/ep
experts), with ZeRO-2's sharded gradients and state over expert_dp (build.py).
"""

import numpy as np

from numpitron.data_parallel.distributed_optimizer import DistributedOptimizer, GradientGroup
from numpitron.optim.training_state import TrainingState
from numpitron.data_parallel.zero import OwnedSlice

ROOT = -1


class Unit:
    """The parameters gathered together, as contiguous ranges of the flat buffer."""

    def __init__(self, params, offsets, numel: int, size: int):
        spans = sorted(offsets[p.name] for p in params)
        self.params, self.ranges = params, []
        for start, stop in spans:
            if self.ranges and self.ranges[-1][1] == start:
                self.ranges[-1][1] = stop
            else:
                self.ranges.append([start, stop])
        for r in self.ranges:
            if r[1] == numel:
                r[1] = size            # the padding rides with the stage's last parameter
        self.ranges = [tuple(r) for r in self.ranges]
        self.nelements = sum(b - a for a, b in self.ranges)


class ZeroThreeOptimizer(DistributedOptimizer):
    """ZeRO-1's slice (`OwnedSlice`: its gradients, its norm, its update), but the
    slice of the parameters is all this rank keeps: the stage's whole buffers are freed
    and the residency gathers each layer while it runs."""

    zero_stage = 3

    def __init__(self, store, topo, train_cfg, parallel_cfg, group=None, precision=None):
        group = group or GradientGroup.dense(topo)
        self.owned = OwnedSlice(store, group)
        super().__init__(store, topo, train_cfg, self.owned.lo, self.owned.hi, group, precision)
        self.param_shard = store.data[self.lo:self.hi].copy()
        self.overlap = parallel_cfg.overlap_grad_reduce
        self.gatherer = None
        self.state = TrainingState(store, group.shard_comm, self.adam, self.lo, self.param_shard, params_lo=self.lo,
                                   after_load=lambda: self.gatherer.release_root(), copies=group.copies_comm)
        store.free_buffers()          # from now on only the slices above exist

    @property
    def params(self) -> np.ndarray:
        return self.param_shard

    def kept_grads(self) -> list[np.ndarray]:
        return [self.owned.grads]

    def reduced_grads(self) -> np.ndarray:
        return self.owned.grads

    def pass_peaks(self) -> tuple[int, int]:
        return self.gatherer.peak_params, self.gatherer.peak_grads

    def install(self, model) -> None:
        """Every layer's parameters gathered while it runs: hooks on the model's passes."""
        self.gatherer = LayerGatherer(model, self)
        model.residency = self.gatherer

    def zero_grad(self) -> None:
        self.owned.grads.fill(0)

    def reduce_grads(self) -> None:
        self.gatherer.finish_backward()        # the root's reduce-scatter, the last blocks'
        self.owned.average(self.grad_wire)     # over the replicas (HSDP), and the mean

    def grad_sumsq(self) -> float:
        return self.owned.grad_sumsq()

    def update(self, lr: float, norm: float) -> None:
        self.owned.update(self.adam, self.param_shard, lr, norm, self.train_cfg.grad_clip)
        self.gatherer.release_root()           # its values just changed: gather afresh


class LayerGatherer:
    """The residency hooks (nn/residency.py) of ZeRO-3 for one GPTStage."""

    def __init__(self, model, optimizer):
        store = model.store
        self.opt, self.dp, self.store = optimizer, optimizer.group.shard_comm, store
        # --no-overlap-grad-reduce: no prefetch, and each reduce-scatter waited for at once
        # (the reference against which benchmarks/zero_stages.py measures the overlap).
        self.overlap = optimizer.overlap
        block_layers = [layer for chunk in model.chunk_blocks for layer in chunk]
        in_blocks = {id(p) for layer in block_layers for p in layer.parameters()}
        self.units = {ROOT: Unit([p for p in store.params if id(p) not in in_blocks], store.offsets,
                                 store.numel, store.size)}
        for k, block in enumerate(block_layers):
            # a MoE block's experts are in the other store, never gathered (build.py)
            mine = [p for p in block.parameters() if p.name in store.offsets]
            self.units[k] = Unit(mine, store.offsets, store.numel, store.size)
        self.unit_of_layer = [block_layers.index(layer) if layer in block_layers else ROOT
                              for layer in model.layers]
        self.params = {}            # unit -> (buffers, pending all-gathers)
        self.grads = {}             # unit -> gradient buffers
        self.reducing = []          # (pending reduce-scatter, piece received, where in the slice it adds, buffer sent)
        self.peak_params = self.peak_grads = 0

    # -- the hooks ---------------------------------------------------------------

    def before_forward(self, index: int) -> None:
        self._use(self.unit_of_layer[index])
        self._prefetch(index + 1)

    def after_forward(self, index: int) -> None:
        self._free(self.unit_of_layer[index])

    def before_backward(self, index: int) -> None:
        unit = self.unit_of_layer[index]
        self._use(unit)
        self._prefetch(index - 1)
        if unit not in self.grads:
            self.grads[unit] = self._whole_grads(unit)
        self._track_peaks()

    def after_backward(self, index: int) -> None:
        unit = self.unit_of_layer[index]
        self._free(unit)
        if unit != ROOT:
            started = self._reduce_scatter(self.grads.pop(unit), self.units[unit])
            self._drain(keep=started if self.overlap else 0)   # at most one layer's in flight

    # -- parameters ----------------------------------------------------------------

    def _gather(self, unit: int) -> None:
        """Start the all-gathers of a unit's ranges into fresh buffers."""
        buffers, pending = [], []
        for a, b in self.units[unit].ranges:
            counts, mine = self.opt.owned.split(a, b)
            buffers.append(np.empty(b - a, self.store.dtype))
            pending.append(self.dp.iall_gather(self.opt.param_shard[mine], buffers[-1], counts, self.opt.param_wire))
        self.params[unit] = (buffers, pending)

    def _prefetch(self, index: int) -> None:
        if self.overlap and 0 <= index < len(self.unit_of_layer) and self.unit_of_layer[index] not in self.params:
            self._gather(self.unit_of_layer[index])

    def _use(self, unit: int) -> None:
        """Wait for the unit's all-gathers (started now if not prefetched) and point its
        Params' data at the gathered buffers."""
        if unit not in self.params:
            self._gather(unit)
        buffers, pending = self.params[unit]
        self.dp.wait_all(pending)
        self._point(unit, buffers, "data")
        self._track_peaks()

    def _free(self, unit: int) -> None:
        if unit != ROOT:                       # the root stays until the update
            self.params.pop(unit)
            self._point(unit, None, "data")

    def release_root(self) -> None:
        if ROOT in self.params:
            self.params.pop(ROOT)
            self._point(ROOT, None, "data")

    def _point(self, unit: int, buffers, attribute: str) -> None:
        """Make each Param's `attribute` a view of the unit's buffers (None: freed)."""
        ranges = self.units[unit].ranges
        for p in self.units[unit].params:
            start, stop = self.store.offsets[p.name]
            view = None
            if buffers is not None:
                k = next(k for k, (a, b) in enumerate(ranges) if a <= start < b)
                view = buffers[k][start - ranges[k][0]:stop - ranges[k][0]].reshape(p.local_shape)
            setattr(p, attribute, view)

    # -- gradients -----------------------------------------------------------------

    def _whole_grads(self, unit: int) -> list:
        buffers = [np.zeros(b - a, self.store.dtype) for a, b in self.units[unit].ranges]
        self._point(unit, buffers, "grad")
        return buffers

    def _reduce_scatter(self, buffers, unit: Unit) -> None:
        """Start summing a unit's gradients over dp; each rank's piece is added to its
        gradient slice when the reduce-scatter completes (`_drain`)."""
        for buffer, (a, b) in zip(buffers, unit.ranges):
            counts, mine = self.opt.owned.split(a, b)
            piece = np.empty(counts[self.dp.rank], self.store.dtype)
            pending = self.dp.ireduce_scatter(self.opt.low_grads(buffer), piece, counts, self.opt.grad_wire)
            self.reducing.append((pending, piece, mine, buffer))
        for p in unit.params:
            p.grad = None
        return len(buffers)

    def _drain(self, keep: int = 0) -> None:
        """Complete all but the newest `keep` reduce-scatters, adding each received piece
        into this rank's gradient slice, and let their buffers go."""
        done, self.reducing = self.reducing[:len(self.reducing) - keep], self.reducing[len(self.reducing) - keep:]
        for pending, piece, mine, _ in done:
            self.dp.wait(pending)
            self.opt.owned.grads[mine] += piece
        self.dp.test([pending for pending, *_ in self.reducing])

    def finish_backward(self) -> None:
        """Before the update: the root's gradients reduce-scattered too, and every
        piece added into the gradient slice."""
        if ROOT in self.grads:
            self._reduce_scatter(self.grads.pop(ROOT), self.units[ROOT])
        self._drain()

    def _track_peaks(self) -> None:
        """Elements held whole at once: gathered parameters (in use or prefetched), and
        gradient buffers (being written or being reduce-scattered)."""
        self.peak_params = max(self.peak_params, sum(self.units[u].nelements for u in self.params))
        in_flight = sum(buffer.size for *_, buffer in self.reducing)
        self.peak_grads = max(self.peak_grads, sum(self.units[u].nelements for u in self.grads) + in_flight)
