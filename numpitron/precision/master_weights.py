"""fp32 master weights for a mixed-precision run (Micikevicius et al. 2018, §3.1;
docs/07-numbers.md): the optimizer updates an fp32 copy of the parameters it owns, with
fp32 Adam moments, and the parameters the layers use are that copy rounded to the low
format after every update. An update smaller than half a bf16 ulp of the weight (a
relative 2^-9) would vanish if added to the bf16 weight itself; added to the master
copy it accumulates until it shows.

`MasterWeightAdam` has AdamW's interface, so every optimizer (ZeRO 0 to 3) keeps its
update unchanged: it hands over the slice of the low-format parameters it owns, and the
master copy of that slice is what the update rule moves. The rule is AdamW, or any rule
with its interface: Muon (muon/muon.py) keeps its momentum in fp32 and runs Newton-Schulz
on the fp32 master's gradients, which `step_mixed` has already divided by the loss scale. `step_mixed` is `step_together` with the
gradients rounded to the low format, unscaled, and checked for overflow.
"""

import math

import numpy as np

from numpitron.precision.formats import FORMATS, wires


class LowFormat:
    """What a mixed run changes in an optimizer (data_parallel/distributed_optimizer.py;
    `Unrounded` there is the run without one): its rule moves an fp32 master copy, the
    stage's parameters and gradients hold the format's values, and they cross dp in the
    format's bytes (gradients only with --grad-reduce-dtype param)."""

    def __init__(self, fmt, grad_reduce_dtype: str):
        self.fmt, self.mixed, self.itemsize = fmt, True, fmt.itemsize
        self.wires = wires(fmt, grad_reduce_dtype)

    def round(self, x):
        return self.fmt.round(x)

    def round_(self, x) -> None:
        self.fmt.round_(x)

    def master_rule(self, rule, params):
        return MasterWeightAdam(rule, params, self.fmt)


def optimizer_format(train_cfg) -> LowFormat | None:
    """The optimizer's number format for a run: None (as it is) unless mixed."""
    fmt = FORMATS[getattr(train_cfg, "precision", "fp32")]
    return LowFormat(fmt, getattr(train_cfg, "grad_reduce_dtype", "fp32")) if fmt.mixed else None


class MasterWeightAdam:
    def __init__(self, adam, params: np.ndarray, fmt):
        """params: the owned slice's values at the start (fp32), copied as the master."""
        self.adam, self.fmt = adam, fmt
        self.master = np.array(params, dtype=np.float32)

    @property
    def m(self):
        return self.adam.m

    @property
    def v(self):
        return self.adam.v

    @property
    def step_count(self) -> int:
        return self.adam.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.adam.step_count = value

    def flat_state(self) -> dict:
        return self.adam.flat_state()

    def load_state(self, *buffers_and_step) -> None:
        """The rule's own buffers (Adam's m and v; Muon's three), then the step count."""
        self.adam.load_state(*buffers_and_step)

    @property
    def state_nbytes(self) -> int:
        """The rule's fp32 state and the fp32 master weights: 12 bytes a parameter with
        Adam's two moments."""
        return self.adam.state_nbytes + self.master.nbytes

    def update(self, params, grads, decay_runs, lr: float) -> None:
        """The rule on the master copy, then the parameters the layers use are its rounding."""
        self.adam.update(self.master, grads, decay_runs, lr)
        params[...] = self.fmt.round(self.master)


def step_mixed(optimizers, lr: float, scaler) -> float:
    """`data_parallel.distributed_optimizer.step_together` for a mixed-precision run. Each optimizer's
    reduction rounds its gradients to the low format before summing them over dp
    (`low_grads`), in the low format or in fp32 (--grad-reduce-dtype); the mean lands in
    the low-format gradient buffer (rounded here: fp16 gives inf where it overflowed),
    is divided by the loss scale in fp32, and the global norm is taken. A non-finite
    norm, the same on every rank since every rank summed the same squares, skips the
    update: the scaler halves its scale and the parameters and moments stay as they
    were. Returns the norm of the unscaled gradients."""
    for optimizer in optimizers:
        optimizer.reduce_grads()
        grads = optimizer.reduced_grads()
        optimizer.precision.round_(grads)
        grads *= 1.0 / scaler.scale
    with np.errstate(invalid="ignore", over="ignore"):
        norm = math.sqrt(sum(optimizer.grad_sumsq() for optimizer in optimizers))
    if scaler.record(math.isfinite(norm)):
        for optimizer in optimizers:
            optimizer.update(lr, norm)
    return norm
