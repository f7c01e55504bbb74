"""Global gradient norm with every logical parameter counted exactly once.

`norm_mask` is 0 where this rank's elements are counted by another rank (a
tp-replicated tensor on tp ranks other than 0; the tied head's copy of the token
embedding on the last stage), so a sum of squares over ranks adds up to the norm
of the single-process gradient, whatever the mesh.

The mask is fixed per parameter, so it is a handful of long runs over the flat
buffer (one per tensor, merged where neighbours agree). Summing squares run by run
reads only the gradients the mask keeps and makes no masked copy of them: 4.8 ms
instead of 17 ms at nanoGPT's size (10.7 M parameters).
"""

import numpy as np


def mask_runs(mask) -> list[tuple[int, int]]:
    """[(start, stop), ...] in order, covering exactly the nonzero elements of mask."""
    on = np.concatenate([[False], np.asarray(mask) != 0, [False]])
    edges = np.flatnonzero(on[1:] != on[:-1])       # alternately a start and a stop
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


_CACHE = {}      # id(mask) -> (mask, its runs); holding the mask keeps its id unique


def cached_mask_runs(mask) -> list[tuple[int, int]]:
    """mask_runs, computed once per mask object: the masks are buffers built once per
    store or ZeRO slice and never changed in place."""
    if id(mask) not in _CACHE:
        if len(_CACHE) > 64:
            _CACHE.clear()
        _CACHE[id(mask)] = (mask, mask_runs(mask))
    return _CACHE[id(mask)][1]


def global_grad_sumsq(grads, norm_mask, comm) -> float:
    """The sum over `comm` of each rank's masked sum of squares, run by run of the
    mask (no masked copy of the gradients)."""
    sumsq = np.array([sum(float(np.dot(grads[a:b], grads[a:b])) for a, b in cached_mask_runs(norm_mask))])
    comm.all_reduce(sumsq)
    return float(sumsq[0])


def global_grad_norm(grads, norm_mask, comm) -> float:
    return float(np.sqrt(global_grad_sumsq(grads, norm_mask, comm)))


def clip_(grads, norm: float, max_norm: float) -> None:
    """Scale grads in place so that their global norm is at most max_norm (0: off)."""
    if max_norm > 0 and norm > max_norm:
        grads *= max_norm / (norm + 1e-6)
