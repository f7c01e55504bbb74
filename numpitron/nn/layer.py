"""The one contract every layer follows (see docs/architecture.md, "Layers").

    layer.parameters()                  -> list[Param]
    layer.forward(x, **context)         -> (y, cache)
    layer.backward_input(dy, cache)     -> dx        gradient w.r.t. the input
    layer.backward_weights(cache)                    accumulate (+=) into Param.grad
    layer.backward(dy, cache)           -> dx        both halves, in that order

Activations carry their shape: x and y are (B, T, C) arrays (token ids are (B, T)),
so no layer needs B or T passed beside them. The only context a layer may take is
`kv` (the attention layers' key/value cache during generation) and `targets` (the
loss). A cache is a dict the layer returns and gets back; it is never stored on
the layer, so a pipeline schedule can keep several micro-batches in flight.

The backward is split in two halves because the input gradient is on a pipeline's
critical path and the weight gradient is not (zero-bubble schedules defer it).
`backward_input` leaves in the cache what `backward_weights` needs (the gradient
that arrived at each inner linear layer), so the halves may run far apart.
"""

import numpy as np


class Layer:
    def parameters(self) -> list:
        return []

    def forward(self, x, **context):
        raise NotImplementedError

    def backward_input(self, dy, cache):
        raise NotImplementedError

    def backward_weights(self, cache) -> None:
        """Nothing to do for a layer without parameters."""

    def backward(self, dy, cache):
        dx = self.backward_input(dy, cache)
        self.backward_weights(cache)
        return dx


def splits_backward(layer) -> bool:
    """Whether a layer has the two halves of its backward, not only a whole `backward`
    (a zero-bubble schedule runs them apart; pipeline.check_backward_splits asks)."""
    return type(layer).backward_input is not Layer.backward_input


def rows(x: np.ndarray) -> np.ndarray:
    """(B, T, C) -> (B*T, C), a view when x is contiguous: one BLAS call per matmul."""
    return x.reshape(-1, x.shape[-1])


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
