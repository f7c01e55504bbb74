"""Work over the masked elements of a flat buffer, run by run instead of through a
masked copy: the gradient norm (which parameters count), AdamW's weight decay (which
parameters decay), Muon (which elements belong to a matrix)."""

import numpy as np


def mask_runs(mask) -> list[tuple[int, int]]:
    """[(start, stop), ...] in order, covering exactly the nonzero elements of a mask over
    a flat buffer. A mask fixed per parameter is a handful of such runs (one per tensor,
    merged where neighbours agree), so work over the masked elements can go run by run
    instead of through a masked copy."""
    on = np.concatenate([[False], np.asarray(mask) != 0, [False]])
    edges = np.flatnonzero(on[1:] != on[:-1])       # alternately a start and a stop
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))
