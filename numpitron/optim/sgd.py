"""Plain stochastic gradient descent: AdamW's interface (optim/adamw.py), no state.

    p = p (1 - lr wd)      on the decay runs (decoupled decay, as AdamW's)
    p = p - lr g

No momentum, so the step is linear in the parameters and the gradient together: the
average of several copies' steps from one point is the step of their averaged
gradient. That is what makes DiLoCo with one inner step equal plain data parallelism
exactly (diloco/, docs/18-across-slow-links.md). `--weight-decay 0` makes it the
textbook p - lr g. Its checkpoint holds the parameters and nothing else.
"""

from numpitron.optim.adamw import runs_within


class SGD:
    def __init__(self, weight_decay: float = 0.0):
        self.weight_decay = weight_decay
        self.step_count = 0

    def load_state(self, step_count: int) -> None:
        self.step_count = step_count

    def flat_state(self) -> dict:
        """No buffers: a checkpoint of an SGD run holds only the parameters."""
        return {}

    @property
    def state_nbytes(self) -> int:
        return 0

    def update(self, params, grads, decay_runs, lr: float) -> None:
        """One step on `params` in place (flat arrays of equal length)."""
        self.step_count += 1
        keep = 1.0 - lr * self.weight_decay
        if keep != 1.0:
            stops = [b for _, b in decay_runs]
            for a, b in runs_within(decay_runs, stops, 0, params.size):
                params[a:b] *= keep
        params -= lr * grads
