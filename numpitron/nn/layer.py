"""The one contract every layer follows (see docs/architecture.md, "Layers").

    layer.parameters()                  -> list[Param]
    layer.forward(x, **context)         -> (y, cache)
    layer.backward_input(dy, cache)     -> dx        gradient w.r.t. the input
    layer.backward_weights(cache)                    accumulate (+=) into Param.grad
    layer.backward(dy, cache)           -> dx        both halves, in that order
    layer.start_backward_input(dy, cache) -> InFlight  the input half, its last collective
                                                     perhaps still running (`.wait()` -> dx)

Activations carry their shape: x and y are (B, T, C) arrays (token ids are (B, T)),
so no layer needs B or T passed beside them. The only context a layer may take is
`kv` (the attention layers' key/value cache during generation) and `targets` (the
loss). A cache is a dict the layer returns and gets back; it is never stored on
the layer, so a pipeline schedule can keep several micro-batches in flight.

The backward is split in two halves because the input gradient is on a pipeline's
critical path and the weight gradient is not (zero-bubble schedules defer it).
`backward_input` leaves in the cache what `backward_weights` needs (the gradient
that arrived at each inner linear layer), so the halves may run far apart.

Run together (`backward`), the halves let a tensor-parallel layer hide communication
(Megatron's async_tensor_model_parallel_allreduce): a column-parallel layer's input gradient must be
summed over tp, and nothing in its own weight gradient needs that sum. So
`start_backward_input` starts the collective and returns at once, the weight half
computes meanwhile, and `wait` finishes it. A layer defines `backward_input` or
`start_backward_input`; the other follows.
"""

class InFlight:
    """An input gradient whose collective may still be running: `wait` finishes it
    (counting the seconds spent waiting) and returns the array."""

    def __init__(self, value, comm=None, pending=None):
        self.value, self.comm, self.pending = value, comm, pending

    def wait(self):
        if self.pending is not None:
            self.comm.wait(self.pending)
            self.pending = None
        return self.value


class FullPrecision:
    """The number format of a run without a low one: every rounding is the identity.
    A mixed-precision run installs its format in every layer instead
    (precision/formats.py, `use_format`), with the same verbs: a layer rounds what it
    produces (`round`), as an accelerator's kernel writes its output in bf16, and keeps
    its activations for the backward in 2 bytes (`keep`, then `widen`)."""

    mixed = False

    def round(self, x):
        return x

    def round_(self, x) -> None:
        """Round x in place: nothing to do."""

    def keep(self, x):
        return x

    def widen(self, kept):
        return kept


FULL_PRECISION = FullPrecision()


class Layer:
    precision = FULL_PRECISION          # the run's number format: FullPrecision, or a mixed run's

    def parameters(self) -> list:
        return []

    def forward(self, x, **context):
        raise NotImplementedError

    def backward_input(self, dy, cache):
        return self.start_backward_input(dy, cache).wait()

    def start_backward_input(self, dy, cache) -> InFlight:
        if type(self).backward_input is Layer.backward_input:
            raise NotImplementedError(f"{type(self).__name__} defines neither half of its input gradient")
        return InFlight(self.backward_input(dy, cache))

    def backward_weights(self, cache) -> None:
        """Nothing to do for a layer without parameters."""

    def splits_backward(self) -> bool:
        """Whether this layer has the two halves of its backward, not only a whole
        `backward` (a zero-bubble schedule runs them apart: the executor asks)."""
        return (type(self).backward_input is not Layer.backward_input
                or type(self).start_backward_input is not Layer.start_backward_input)

    def backward(self, dy, cache):
        dx = self.start_backward_input(dy, cache)
        self.backward_weights(cache)     # while the input gradient's collective runs
        return dx.wait()
