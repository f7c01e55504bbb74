"""When a run must stop because its numbers left the finite: one line, before anything
is saved, naming the iteration and the number (train.py's loop asks after every step
and evaluation)."""

import math

from numpitron.errors import UserError


def check_diverged(iteration: int, step: dict, applied_every_step: bool = False) -> None:
    """One line, before anything is saved, once a number that training needs finite is not:
    the loss, the validation loss, or (for a step that applies every update, where a
    mixed-precision run would skip it) the gradient norm the update was clipped by."""
    named = {"train_loss": "loss", "validation loss": "validation loss"}
    checked = {named[k]: v for k, v in step.items() if k in named}
    if applied_every_step:
        checked["gradient norm"] = step["grad_norm"]
    for what, value in checked.items():
        if not math.isfinite(value):
            raise UserError(f"training diverged at iteration {iteration}: {what} is {value}")


class SkippedSteps:
    """A mixed-precision step whose gradients overflow is skipped (its norm is not finite)
    and fp16's loss scale halved. Two cases no scale mends end the run in one line: STALLED
    steps in a row overflowing with no lower scale to try (fp16 at 1; bf16 and FP8 never
    scale), and a run whose every step was skipped (a --loss-scale far too large), found
    before its final save."""

    STALLED = 10

    def __init__(self, scaler):
        self.scaler, self.first_scale = scaler, scaler.scale
        self.steps = self.skipped = self.in_a_row = 0

    def record(self, iteration: int, step: dict, scale: float, last: bool) -> None:
        self.steps += 1
        if math.isfinite(step["grad_norm"]):
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row = self.in_a_row + 1 if scale <= 1 or not self.scaler.dynamic else 0
        if self.in_a_row == self.STALLED:
            raise UserError(f"training diverged at iteration {iteration}: the gradients overflowed "
                            f"{self.scaler.precision} in {self.STALLED} steps in a row at loss scale {scale:g}, with "
                            f"no lower scale to try")
        if last and self.skipped == self.steps:
            raise UserError(f"every one of this run's {self.steps} steps overflowed {self.scaler.precision} and was "
                            f"skipped (its loss scale fell from {_power(self.first_scale)} to "
                            f"{_power(self.scaler.scale)}): start again from a smaller --loss-scale (0: the default)")


def _power(scale: float) -> str:
    return f"2^{int(math.log2(scale))}" if scale >= 1 else f"{scale:g}"
