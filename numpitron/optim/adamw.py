"""AdamW (Loshchilov & Hutter 2019) as a vectorised update over a flat buffer.

The same code updates a whole stage (plain data parallelism) or one rank's
contiguous slice of it (ZeRO-1): it never needs to know where parameters start.
Weight decay is decoupled and applied only where `decay_mask` is 1 (matrices and
embeddings; not biases or LayerNorm), element by element, so a ZeRO slice that cuts
through the middle of a parameter is still decayed correctly.
"""

import math

import numpy as np

# Elements updated at a time: the sixteen passes of one chunk over p, g, m, v and a
# scratch buffer stay in the CPU's cache instead of streaming the whole buffer
# from memory sixteen times.
CHUNK = 1 << 15


class AdamW:
    def __init__(self, size: int, dtype, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1):
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.m = np.zeros(size, dtype)   # first moment
        self.v = np.zeros(size, dtype)   # second moment
        self.step_count = 0
        self._scratch = np.empty(min(size, CHUNK), dtype)

    def load_state(self, m, v, step_count: int) -> None:
        """Restore the moments (arrays of this optimizer's size) and the step count."""
        self.m[...] = m
        self.v[...] = v
        self.step_count = step_count

    @property
    def state_nbytes(self) -> int:
        return self.m.nbytes + self.v.nbytes

    def update(self, params, grads, decay_mask, lr: float) -> None:
        """One AdamW step on `params` in place (all flat arrays of equal length)."""
        self.step_count += 1
        b1, b2, t = self.beta1, self.beta2, self.step_count
        decay = -lr * self.weight_decay
        # p -= lr * m_hat / (sqrt(v_hat) + eps), with the bias corrections folded in
        v_scale, step_scale = 1.0 / math.sqrt(1 - b2 ** t), -lr / (1 - b1 ** t)   # Python floats: float32 passes
        for lo in range(0, params.size, CHUNK):
            hi = min(lo + CHUNK, params.size)
            p, g, m, v = params[lo:hi], grads[lo:hi], self.m[lo:hi], self.v[lo:hi]
            tmp = self._scratch[:hi - lo]
            np.multiply(p, decay_mask[lo:hi], out=tmp)     # decoupled weight decay
            tmp *= decay
            p += tmp
            m *= b1                                          # m = b1 m + (1 - b1) g
            m += np.multiply(g, 1 - b1, out=tmp)
            v *= b2                                          # v = b2 v + (1 - b2) g^2
            np.multiply(g, g, out=tmp)
            tmp *= 1 - b2
            v += tmp
            np.sqrt(v, out=tmp)
            tmp *= v_scale
            tmp += self.eps
            np.divide(m, tmp, out=tmp)
            tmp *= step_scale
            p += tmp
