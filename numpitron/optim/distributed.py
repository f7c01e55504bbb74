"""What every optimizer of a training run does, whatever it shards.

    zero_grad()              before the first backward of a step
    grads_ready(params)      the backward reports gradients that are final: an
                             optimizer may start reducing them over dp at once
    step(lr) -> grad norm    finish averaging gradients over dp, clip by the global
                             norm, apply AdamW to the slice [lo, hi) this rank updates
    full_moments()           Adam's m and v laid out like the store's flat buffer
    state_nbytes()           bytes of optimizer state on this rank
    memory_bytes()           parameters, gradients, state, and in-pass peaks (docs/12)
    residency(model)         where the model's parameters live during a pass (ZeRO-3)

`step` is three phases, so that optimizers of several stores (the dense parameters
and the experts, averaged over different groups) clip by one global norm together
(`step_together`): reduce_grads(), grad_sumsq() (the squared norm of the store's
gradient over every rank), update(lr, norm).

For sharded checkpoints (checkpoint/save.py, load.py), where every rank writes
the part of its store's flat buffers it owns and reads back only what it needs:

    write_range() -> (lo, hi)       the slice of the store's flat buffers this rank writes
    flat_slices(lo, hi)             {"params", "adam_m", "adam_v"}: their values on [lo, hi)
    loaded_ranges()                 the (kind, lo, hi) it needs back
    load_flat(get_range, t)         restore from get_range(kind, lo, hi) -> values on [lo, hi)

Subclasses: `parallel.data_parallel.DataParallelOptimizer` (ZeRO stage 0),
`parallel.zero.ZeroOneOptimizer` and `ZeroTwoOptimizer`, `parallel.zero3.ZeroThreeOptimizer`;
`parallel.optimizer.make_optimizers` picks them.
"""

import math
from typing import NamedTuple

import numpy as np

from numpitron.nn.residency import AlwaysResident
from numpitron.optim.adamw import AdamW


class GradientGroup(NamedTuple):
    """Who shares a store's parameters, and so its gradient reduction."""
    comm: object          # the replicas, averaged over (dp x cp; for experts the dp/ep expert_dp ranks)
    batch_ranks: int      # data-parallel ranks whose tokens the summed gradient covers: the divisor
    replica_comm: object  # ranks holding one whole copy of the store between them: the ZeRO-0 norm

    @classmethod
    def dense(cls, topo) -> "GradientGroup":
        return cls(topo.dp_cp_comm, topo.dp_cp, topo.model_comm)

    @classmethod
    def experts(cls, topo) -> "GradientGroup":
        """An expert's gradient already sums the tokens of its ep group (they came to it
        by all-to-all); summed over expert_dp it covers all dp ranks' tokens."""
        return cls(topo.expert_dp_comm, topo.dp_cp, topo.expert_model_comm)


class DistributedOptimizer:
    zero_stage = None

    def __init__(self, store, topo, train_cfg, lo: int, hi: int, group: GradientGroup | None = None):
        self.store, self.topo, self.train_cfg = store, topo, train_cfg
        self.group = group or GradientGroup.dense(topo)
        self.lo, self.hi = lo, hi
        self.adam = AdamW(hi - lo, store.dtype, train_cfg.beta1, train_cfg.beta2,
                          train_cfg.eps, train_cfg.weight_decay)

    def residency(self, model):
        """Where the model's parameters live during a pass (nn/residency.py): whole."""
        return AlwaysResident()

    def memory_bytes(self) -> dict:
        """Bytes this rank keeps for the whole run (parameters, gradients, optimizer
        state), and the peaks of what exists only during a pass: parameters gathered
        whole (ZeRO-3) and whole gradient buffers (ZeRO-2 and 3). Their sum is the peak."""
        grads = 0 if self.store.grad is None else self.store.grad.nbytes
        return {"params": self.store.data.nbytes, "grads": grads, "optimizer_state": self.state_nbytes(),
                "gathered_params_peak": 0, "backward_grads_peak": 0}

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

    def full_moments(self):
        raise NotImplementedError

    def state_nbytes(self) -> int:
        return self.adam.state_nbytes

    def params_range(self, lo: int, hi: int) -> np.ndarray:
        """This rank's parameter values on [lo, hi) of the stage's flat buffer (ZeRO-3,
        which keeps only its own slice, overrides it)."""
        return self.store.data[lo:hi]

    def write_range(self) -> tuple[int, int]:
        """The slice this rank writes to a checkpoint: the 1/dp of the stage it owns
        under ZeRO; without ZeRO the replicas split the writing the same way."""
        group = self.group.comm
        step = -(-self.store.size // group.size)
        lo = min(group.rank * step, self.store.size)
        return lo, min(lo + step, self.store.size)

    def flat_slices(self, lo: int, hi: int) -> dict:
        """Parameters and Adam moments on [lo, hi), which must lie in what this rank owns."""
        if not (self.lo <= lo <= hi <= self.hi):
            raise ValueError(f"[{lo}, {hi}) is outside this rank's [{self.lo}, {self.hi})")
        return {"params": self.params_range(lo, hi),
                "adam_m": self.adam.m[lo - self.lo:hi - self.lo],
                "adam_v": self.adam.v[lo - self.lo:hi - self.lo]}

    def loaded_ranges(self) -> list[tuple[str, int, int]]:
        """(kind, lo, hi) of every range load_flat asks for: the parameters whole (every
        replica holds them), the moments on the slice this rank updates."""
        return [("params", 0, self.store.size), ("adam_m", self.lo, self.hi), ("adam_v", self.lo, self.hi)]

    def load_flat(self, get_range, step_count: int) -> None:
        """get_range(kind, lo, hi) returns a kind's values on [lo, hi) of the stage's
        flat buffer (zeros where it is padding). Every replica of the parameters reads
        them whole; the moments only on the slice this rank updates."""
        self.store.data[...] = get_range("params", 0, self.store.size)
        self.adam.load_state(get_range("adam_m", self.lo, self.hi), get_range("adam_v", self.lo, self.hi),
                             step_count)

    def full_params(self) -> np.ndarray:
        """The stage's whole flat parameter buffer (tests and exports)."""
        return self.store.data


def step_together(optimizers, lr: float) -> float:
    """Average every store's gradients, take the norm over all of them, clip and update
    each: one optimizer step over every parameter of the model. Returns the norm."""
    for optimizer in optimizers:
        optimizer.reduce_grads()
    norm = math.sqrt(sum(optimizer.grad_sumsq() for optimizer in optimizers))
    for optimizer in optimizers:
        optimizer.update(lr, norm)
    return norm
