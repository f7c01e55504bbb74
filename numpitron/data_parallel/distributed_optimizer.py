"""What every optimizer of a training run does, whatever it shards: average the
gradients over the ranks that share the parameters, and update the slice [lo, hi)
of the store's flat buffer this rank owns.

    zero_grad()              before the first backward of a step
    grads_ready(params)      the backward reports gradients that are final: an
                             optimizer may start reducing them over dp at once
    step(lr) -> grad norm    finish averaging gradients over dp, clip by the global
                             norm, apply AdamW to the slice [lo, hi) this rank updates
    install(model)           hooks of its own on the model's passes (ZeRO-3 gathers layers)

`step` is three phases, so that optimizers of several stores (the dense parameters
and the experts, averaged over different groups) clip by one global norm together
(`step_together`): reduce_grads(), grad_sumsq() (the squared norm of the store's
gradient over every rank), update(lr, norm).

Two other jobs live beside it, each in its own object: `optimizer.state`
(optim/training_state.py) says which ranges of the flat buffers the optimizer keeps,
for checkpoints and exports; `memory_bytes(optimizer)` (optim/memory_report.py)
counts what it keeps, from `params`, `kept_grads()` and `pass_peaks()`.

Implementations: `buckets.DataParallelOptimizer` (ZeRO stage 0), `zero.ZeroOneOptimizer`
and `ZeroTwoOptimizer`, `zero3.ZeroThreeOptimizer`; `build.py` picks them.
"""

import math
from typing import NamedTuple

import numpy as np

from numpitron.optim.adamw import AdamW


class Unrounded:
    """A run without a low number format: parameters and gradients are used as they
    are. A mixed-precision run gives the optimizer its `LowFormat` instead
    (precision/master_weights.py): fp32 master weights under the update rule, the stage's
    parameters and gradients rounded, both sent over dp in the format's bytes."""

    mixed = False
    wires = (None, None)            # (gradients', parameters') wire format: as they are

    def round_(self, x) -> None:
        """Nothing to round."""

    def master_rule(self, rule, params):
        return rule


class GradientGroup(NamedTuple):
    """Who shares a store's parameters, and so its gradient reduction."""
    comm: object          # the replicas, averaged over (dp x cp; for experts the dp x cp / ep expert_dp ranks)
    batch_ranks: int      # data-parallel ranks whose tokens the summed gradient covers: the divisor
    whole_copy_comm: object  # ranks holding one whole copy of the store between them: the ZeRO-0 norm
    # ZeRO, hybrid sharding (docs/09-zero-2-and-3.md): `comm` is shard_comm x copies_comm.
    shard_comm: object    # the ranks that split the state between them (dp_shard)
    copies_comm: object   # the ranks holding the same shard, which average it (dp_replica)
    shard_norm_comm: object  # one copy of every shard between them: the ZeRO norm (dp_shard_model)

    @classmethod
    def dense(cls, topo) -> "GradientGroup":
        return cls(topo.dp_cp_comm, topo.dp_cp, topo.model_comm, topo.dp_shard_comm, topo.dp_replica_comm,
                   topo.dp_shard_model_comm)

    @classmethod
    def experts(cls, topo) -> "GradientGroup":
        """An expert's gradient already sums the tokens of its ep group (they came to it
        by all-to-all); summed over expert_dp it covers all dp x cp ranks' tokens. Under
        hybrid sharding experts shard like the dense state: over the S / ep expert_dp
        ranks of one replica, each slice averaged with its copies in the other replicas
        (dp_replica); one replica's ranks hold one copy of every expert slice."""
        return cls(topo.expert_dp_comm, topo.dp_cp, topo.expert_model_comm, topo.expert_dp_shard_comm,
                   topo.dp_replica_comm, topo.dp_shard_model_comm)


class DistributedOptimizer:
    zero_stage = None

    def __init__(self, store, topo, train_cfg, lo: int, hi: int, group: GradientGroup | None = None,
                 precision=None):
        self.store, self.topo, self.train_cfg = store, topo, train_cfg
        self.group = group or GradientGroup.dense(topo)
        self.lo, self.hi = lo, hi
        # Mixed precision (docs/07-numbers.md): the rule moves an fp32 master copy of the
        # slice; the stage's parameters, which the layers use, are rounded from here on.
        self.precision = precision or Unrounded()
        self.adam = self.precision.master_rule(AdamW(hi - lo, store.dtype, train_cfg.beta1, train_cfg.beta2,
                                                     train_cfg.eps, train_cfg.weight_decay), store.data[lo:hi])
        self.precision.round_(store.data)
        # What the gradients and the parameters travel in over dp (Comm's `wire`).
        self.grad_wire, self.param_wire = self.precision.wires
        self.state = None           # a TrainingState, set by each implementation

    def use_rule(self, rule) -> None:
        """Replace AdamW by another rule with its interface over the same slice (Muon:
        muon/owners.py); the checkpoint layout follows it. A mixed-precision run
        keeps its fp32 master copy: the new rule moves it."""
        if self.precision.mixed:
            self.adam.adam = rule
        else:
            self.adam = self.state.adam = rule

    @property
    def params(self) -> np.ndarray:
        """The parameter values this rank keeps between passes: the whole stage (ZeRO-3
        keeps only its slice)."""
        return self.store.data

    def kept_grads(self) -> list[np.ndarray]:
        """The gradient buffers this rank keeps between steps."""
        return [] if self.store.grad is None else [self.store.grad]

    def low_grads(self, grads: np.ndarray) -> np.ndarray:
        """Gradients about to be reduced over dp, in the low format: a mixed run's backward
        produces them in it (Micikevicius et al. 2018, §3), whatever they are summed in."""
        self.precision.round_(grads)
        return grads

    def reduced_grads(self) -> np.ndarray:
        """After reduce_grads: the averaged gradients this rank's update reads."""
        return self.store.grad

    def pass_peaks(self) -> tuple[int, int]:
        """Elements that exist only during a pass, at their peak: parameters gathered
        whole (ZeRO-3) and whole gradient buffers (ZeRO-2 and 3)."""
        return 0, 0

    def install(self, model) -> None:
        """Nothing to change in the model: its parameters stay whole between passes."""

    def zero_grad(self) -> None:
        """Before a step's first backward."""
        self.store.zero_grad()

    def grads_ready(self, params) -> None:
        """Nothing to start early (the default)."""

    def step(self, lr: float) -> float:
        """Returns the global gradient norm before clipping."""
        return step_together([self], lr)

    def reduce_grads(self) -> None:
        raise NotImplementedError

    def grad_sumsq(self) -> float:
        raise NotImplementedError

    def update(self, lr: float, norm: float) -> None:
        raise NotImplementedError


def step_together(optimizers, lr: float) -> float:
    """Average every store's gradients, take the norm over all of them, clip and update
    each: one optimizer step over every parameter of the model. Returns the norm."""
    for optimizer in optimizers:
        optimizer.reduce_grads()
    norm = math.sqrt(sum(optimizer.grad_sumsq() for optimizer in optimizers))
    for optimizer in optimizers:
        optimizer.update(lr, norm)
    return norm
