"""The bytes a layer's cache keeps alive: what the pipeline executor reports as a
rank's activation memory and the tests hold to the formulas of transformer/activation_memory.py."""

import numpy as np


def cache_nbytes(cache) -> int:
    """Bytes of the arrays a cache keeps alive, each buffer counted once (views of
    one buffer, or one array held in two places, share memory)."""
    seen, total = set(), 0
    stack = [cache]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "__dict__"):             # a small state object (attention's running softmax)
            stack.extend(vars(item).values())
        elif isinstance(item, np.ndarray):
            base = item
            while isinstance(base.base, np.ndarray):
                base = base.base
            if id(base) not in seen:          # alive while the cache holds it: ids are unique
                seen.add(id(base))
                total += base.nbytes
    return total
