"""AdamW (Loshchilov & Hutter 2019) as one vectorised update over a flat buffer.

The same code updates a whole stage (plain data parallelism) or one rank's
contiguous slice of it (ZeRO-1): it never needs to know where parameters start.
Weight decay is decoupled and applied only where `decay_mask` is 1 (matrices and
embeddings; not biases or LayerNorm), element by element, so a ZeRO slice that cuts
through the middle of a parameter is still decayed correctly.
"""

import numpy as np


class AdamW:
    def __init__(self, size: int, dtype, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1):
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.m = np.zeros(size, dtype)   # first moment
        self.v = np.zeros(size, dtype)   # second moment
        self.step_count = 0

    def update(self, params, grads, decay_mask, lr: float) -> None:
        """One AdamW step on `params` in place (all flat arrays of equal length)."""
        self.step_count += 1
        b1, b2, t = self.beta1, self.beta2, self.step_count
        params -= (lr * self.weight_decay) * decay_mask * params
        self.m *= b1
        self.m += (1 - b1) * grads
        self.v *= b2
        self.v += (1 - b2) * np.square(grads)
        # p -= lr * m_hat / (sqrt(v_hat) + eps), with the bias corrections folded in
        denom = np.sqrt(self.v)
        denom *= 1.0 / np.sqrt(1 - b2 ** t)
        denom += self.eps
        step = self.m / denom
        step *= lr / (1 - b1 ** t)
        params -= step
