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

Streaming DiLoCo (diloco/streaming.py) takes the same step fragment by fragment, on
[a, b) of the slice (`apply_outer`). Two identities follow and the tests hold the code to them. With η = 1 and μ = 0,
θ = mean of θ_replica: with one replica, plain training; with one inner step of plain
SGD (linear in θ and g), p(1 - lr wd) - lr mean(g), plain data parallelism.
"""

import numpy as np

from numpitron.optim.training_state import DILOCO_BUFFERS


class RoundState:
    """An optimizer's update rule (AdamW, Muon, SGD) with DiLoCo's buffers over the same
    slice beside it: θ_start and the outer momentum, and with streaming overlap (τ > 0)
    the mean Δ of fragments whose exchange has left but not yet been applied. It updates
    as the rule does; a checkpoint saves and loads the rule's buffers and these
    (`DILOCO_BUFFERS`), so a run resumes mid-round exactly: which fragments are due or in
    flight follows from the iteration (diloco/streaming.py)."""

    def __init__(self, rule, start: np.ndarray, overlap: bool = False):
        self.rule = rule
        self.start = start.copy()                  # θ_start on the slice
        self.momentum = np.zeros_like(start)       # m
        self.received = np.zeros_like(start) if overlap else None
        self.in_flight = []                        # diloco/exchange.py's Exchanges, sent, not yet applied

    @property
    def step_count(self) -> int:
        return self.rule.step_count

    @property
    def state_nbytes(self) -> int:
        return self.rule.state_nbytes + sum(buf.nbytes for buf in self.buffers())

    def buffers(self) -> tuple:
        return (self.start, self.momentum) + (() if self.received is None else (self.received,))

    def update(self, params, grads, decay_runs, lr: float) -> None:
        self.rule.update(params, grads, decay_runs, lr)

    def flat_state(self) -> dict:
        """The exchanges in flight are completed first (their collectives only: nothing is
        applied before its step), so a checkpoint holds what has arrived; `received` is
        zero outside them."""
        if self.received is not None:
            self.received[...] = 0
            for exchange in self.in_flight:
                self.received[exchange.a:exchange.b] = exchange.settle()
        return {**self.rule.flat_state(), **dict(zip(DILOCO_BUFFERS, self.buffers()))}

    def load_state(self, *arrays_and_step) -> None:
        *arrays, step_count = arrays_and_step
        inner = len(self.rule.flat_state())
        self.rule.load_state(*arrays[:inner], step_count)
        for buf, saved in zip(self.buffers(), arrays[inner:]):
            buf[...] = saved


def held_slice(optimizer) -> np.ndarray:
    """The parameter values on the slice [lo, hi) this rank's optimizer updates (a view)."""
    state = optimizer.state
    return state.params[optimizer.lo - state.params_lo:optimizer.hi - state.params_lo]


def apply_outer(theta, round_state: RoundState, a: int, b: int, delta: np.ndarray, outer_lr: float,
                momentum: float, alpha: float | None = None) -> None:
    """The outer step on [a, b) of this rank's slice, given the replicas' mean Δ there
    (`delta`, consumed). alpha None: every replica takes the outer step's θ (DiLoCo);
    else it keeps alpha of its own θ, which moved on while Δ travelled (streaming
    DiLoCo's merge with its mixing factor, Douillard et al. 2025)."""
    start, m = round_state.start[a:b], round_state.momentum[a:b]
    if momentum:
        m *= momentum
        m += delta
        delta += momentum * m
    start -= outer_lr * delta
    if alpha is None:
        theta[a:b] = start
    else:
        theta[a:b] *= alpha
        theta[a:b] += (1 - alpha) * start


def gather_stage(optimizer) -> None:
    """Under ZeRO-1/2 the replica's ranks gather the stage again after their slices
    moved, as after any update (ZeRO-3 keeps only its slice; plain dp updated it whole)."""
    if optimizer.zero_stage in (1, 2):
        optimizer.group.shard_comm.all_gather(optimizer.store.data, optimizer.param_wire)
