"""Global gradient norm with every logical parameter counted exactly once.

`norm_mask` is 0 where this rank's elements are counted by another rank (a
tp-replicated tensor on tp ranks other than 0; the tied head's copy of the token
embedding on the last stage), so a sum of squares over ranks adds up to the norm
of the single-process gradient, whatever the mesh.
"""

import numpy as np


def global_grad_sumsq(grads, norm_mask, comm) -> float:
    """The sum over `comm` of each rank's masked sum of squares."""
    sumsq = np.array([np.dot(grads * norm_mask, grads)], dtype=np.float64)
    comm.all_reduce(sumsq)
    return float(sumsq[0])


def global_grad_norm(grads, norm_mask, comm) -> float:
    return float(np.sqrt(global_grad_sumsq(grads, norm_mask, comm)))


def clip_(grads, norm: float, max_norm: float) -> None:
    """Scale grads in place so that their global norm is at most max_norm (0: off)."""
    if max_norm > 0 and norm > max_norm:
        grads *= max_norm / (norm + 1e-6)
