"""What a mixed-precision run changes in the training step, as pieces the trainer is
given (trainer.py): the rule that steps the optimizers and the FP8 feature around it.

`MixedPrecisionStep` multiplies the loss by the loss scale before the backward and
steps with `step_mixed` (gradients rounded, unscaled, an overflowing step skipped:
Micikevicius et al. 2018, §3.2); `Fp8Scaling` records each step's amaxes from a clean
start and agrees on them over the world once the gradients are final (precision/fp8.py).
"""

from numpitron.precision.master_weights import step_mixed
from numpitron.trainer import StepFeature


class MixedPrecisionStep:
    def __init__(self, scaler):
        self.scaler = scaler            # formats.LossScaler: saved in every checkpoint

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def step(self, optimizers, lr: float) -> float:
        return step_mixed(optimizers, lr, self.scaler)

    def metrics(self) -> dict:
        return self.scaler.state()


class Fp8Scaling(StepFeature):
    def __init__(self, scaling):
        self.scaling = scaling          # fp8.DelayedScaling

    def begin_step(self, trainer) -> None:
        self.scaling.begin_step()       # what evaluation saw does not count

    def end_backward(self, trainer) -> None:
        self.scaling.end_step()
