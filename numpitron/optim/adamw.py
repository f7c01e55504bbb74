"""AdamW (Loshchilov & Hutter 2019) as a vectorised update over a flat buffer.

The same code updates a whole stage (plain data parallelism) or one rank's
contiguous slice of it (ZeRO-1): it never needs to know where parameters start.
Weight decay is decoupled and applied only to the runs of the buffer that
`decay_runs` lists (matrices and embeddings; not biases or LayerNorm: `mask_runs` of
the store's decay mask), so a ZeRO slice that cuts through the middle of a parameter
is still decayed correctly. The textbook step, all at once, is
numpitron.reference.adamw_step; the tests hold this one to it.
"""

import bisect
import math

import numpy as np

# Elements updated at a time: the thirteen passes of one chunk over p, g, m, v and a
# scratch buffer stay in the CPU's cache instead of streaming the whole buffer from
# memory thirteen times, while a chunk is long enough that its thirteen NumPy calls
# cost little beside its passes (benchmarks/README.md gives the sizes tried).
CHUNK = 1 << 16


def runs_within(runs, stops, lo: int, hi: int):
    """The parts inside [lo, hi) of `runs`, sorted disjoint (start, stop) pairs whose
    stops are `stops`; bisection finds the first run that ends after lo."""
    r = bisect.bisect_right(stops, lo)
    while r < len(runs) and runs[r][0] < hi:
        yield max(runs[r][0], lo), min(stops[r], hi)
        r += 1


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

    def flat_state(self) -> dict:
        """The moments by their checkpoint names, laid out like the updated slice."""
        return {"adam_m": self.m, "adam_v": self.v}

    @property
    def state_nbytes(self) -> int:
        return self.m.nbytes + self.v.nbytes

    def update(self, params, grads, decay_runs, lr: float) -> None:
        """One AdamW step on `params` in place (flat arrays of equal length); decay_runs:
        the (start, stop) runs of params that weight decay applies to, in order.

            p = p (1 - lr wd)                   on the decay runs (decoupled decay)
            m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
            p = p - lr_t m / (sqrt(v) + eps_t)

        with lr_t = lr sqrt(1 - b2^t) / (1 - b1^t) and eps_t = eps sqrt(1 - b2^t). That
        is the textbook lr m_hat / (sqrt(v_hat) + eps), m_hat = m / (1 - b1^t) and
        v_hat = v / (1 - b2^t), multiplied above and below by sqrt(1 - b2^t): the bias
        corrections move onto two scalars and sqrt(v) needs no scaling pass (Kingma &
        Ba 2015, end of §2). Chunk by chunk, each chunk's decay runs first."""
        self.step_count += 1
        b1, b2, t = self.beta1, self.beta2, self.step_count
        keep = 1.0 - lr * self.weight_decay
        root = math.sqrt(1 - b2 ** t)                    # Python floats: the passes stay float32
        eps_t, minus_lr_t = self.eps * root, -lr * root / (1 - b1 ** t)
        stops = [b for _, b in decay_runs]
        for lo in range(0, params.size, CHUNK):
            hi = min(lo + CHUNK, params.size)
            for a, b in runs_within(decay_runs, stops, lo, hi):
                params[a:b] *= keep
            p, g, m, v = params[lo:hi], grads[lo:hi], self.m[lo:hi], self.v[lo:hi]
            scratch = self._scratch[:hi - lo]
            m *= b1
            m += np.multiply(g, 1 - b1, out=scratch)        # m = b1 m + (1 - b1) g
            v *= b2
            g_sq = np.multiply(g, g, out=scratch)
            g_sq *= 1 - b2
            v += g_sq                                        # v = b2 v + (1 - b2) g^2
            denominator = np.sqrt(v, out=scratch)
            denominator += eps_t                             # sqrt(v) + eps_t
            step = np.divide(m, denominator, out=scratch)
            step *= minus_lr_t                               # -lr_t m / (sqrt(v) + eps_t)
            p += step
