"""DiLoCo's outer step over one optimizer's slice, and the state it keeps there.

Every replica starts a round from the same parameters θ_start and takes H inner steps
with its own optimizer on its own rows of each batch. Then, on the slice [lo, hi) of
the flat buffer this rank's optimizer updates (the whole stage without ZeRO, its ZeRO
slice with it):

    Δ   = mean over the replicas of (θ_start - θ_replica)      the pseudo-gradient
    m   = μ m + Δ                                               outer momentum
    θ   = θ_start - η (Δ + μ m)                                 Nesterov (Sutskever et al. 2013)

and θ becomes every replica's parameters and the next round's θ_start. The inner
optimizers' states are not touched: each replica keeps its own, as in the paper.

Two identities follow and the tests hold the code to them. With η = 1 and μ = 0,
θ = mean of θ_replica: with one replica, plain training; with one inner step of plain
SGD (linear in θ and g), p(1 - lr wd) - lr mean(g), plain data parallelism.
"""

import numpy as np

from numpitron.optim.training_state import DILOCO_BUFFERS


class RoundState:
    """An optimizer's update rule (AdamW, Muon, SGD) with DiLoCo's two buffers over the
    same slice beside it: θ_start and the outer momentum. It updates as the rule does;
    a checkpoint saves and loads the rule's buffers and these two (`DILOCO_BUFFERS`), so
    a run resumes mid-round exactly: the round's phase is the iteration modulo H."""

    def __init__(self, rule, start: np.ndarray):
        self.rule = rule
        self.start = start.copy()                  # θ_start on the slice
        self.momentum = np.zeros_like(start)       # m

    @property
    def step_count(self) -> int:
        return self.rule.step_count

    @property
    def state_nbytes(self) -> int:
        return self.rule.state_nbytes + self.start.nbytes + self.momentum.nbytes

    def update(self, params, grads, decay_runs, lr: float) -> None:
        self.rule.update(params, grads, decay_runs, lr)

    def flat_state(self) -> dict:
        return {**self.rule.flat_state(), **dict(zip(DILOCO_BUFFERS, (self.start, self.momentum)))}

    def load_state(self, *arrays_and_step) -> None:
        *arrays, step_count = arrays_and_step
        inner = len(self.rule.flat_state())
        self.rule.load_state(*arrays[:inner], step_count)
        self.start[...], self.momentum[...] = arrays[inner:]


def held_slice(optimizer) -> np.ndarray:
    """The parameter values on the slice [lo, hi) this rank's optimizer updates (a view)."""
    state = optimizer.state
    return state.params[optimizer.lo - state.params_lo:optimizer.hi - state.params_lo]


def outer_step(optimizer, round_state: RoundState, across, outer_lr: float, momentum: float) -> None:
    """One outer step on this rank's slice; `across` is the diloco group (its R ranks
    hold the same slice). Under ZeRO-1/2 the replica's ranks then gather the stage again,
    as after any update (ZeRO-3 keeps only its slice; plain dp updated it whole)."""
    theta, start, m = held_slice(optimizer), round_state.start, round_state.momentum
    delta = start - theta
    across.all_reduce(delta)
    delta *= 1.0 / across.size
    if momentum:
        m *= momentum
        m += delta
        delta += momentum * m
    start -= outer_lr * delta
    theta[...] = start
    if optimizer.zero_stage in (1, 2):
        optimizer.group.shard_comm.all_gather(optimizer.store.data, optimizer.param_wire)
