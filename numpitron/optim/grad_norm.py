"""Global gradient norm with every logical parameter counted exactly once.

`norm_mask` is 0 where this rank's elements are counted by another rank (a
tp-replicated tensor on tp ranks other than 0; the tied head's copy of the token
embedding on the last stage), so a sum of squares over ranks adds up to the norm
of the single-process gradient, whatever the mesh.

    norm = sqrt(sum over ranks of sum(norm_mask * g^2))     (numpitron.reference.global_grad_norm)

The mask is fixed per parameter, so it is a handful of long runs over the flat
buffer (`norm_runs`, built with it). Summing squares run by run reads only the
gradients the mask keeps and makes no masked copy of them (the speed appendix of docs/).
"""

import numpy as np


def global_grad_sumsq(grads, norm_runs, comm) -> float:
    """The sum over `comm` of each rank's sum of squares over the runs of its norm mask
    (`nn.mask_runs`), with no masked copy of the gradients."""
    sumsq = np.array([sum(float(np.dot(grads[a:b], grads[a:b])) for a, b in norm_runs)])
    comm.all_reduce(sumsq)
    return float(sumsq[0])


def global_grad_norm(grads, norm_runs, comm) -> float:
    return float(np.sqrt(global_grad_sumsq(grads, norm_runs, comm)))


def clip_(grads, norm: float, max_norm: float) -> None:
    """Scale grads in place so that their global norm is at most max_norm (0: off)."""
    if max_norm > 0 and norm > max_norm:
        grads *= max_norm / (norm + 1e-6)
