"""Activation recomputation (Chen et al. 2016; Korthikanti et al. 2022, §5): a layer
that keeps only its input and runs its forward again when the backward needs it.

No layer knows about this: the wrapper follows the same contract. Its forward keeps
the input and drops everything the inner layer would have kept; its input half of the
backward reruns the inner forward (with its collectives: a tensor-parallel layer
all-reduces again), then the inner input half; its weight half is the inner one's,
on the recomputed cache, which it then lets go.

In a bf16 or fp16 run the input it keeps is a block's input, rounded to the format
where the previous layer handed it on (GPTStage._round), so it is kept in a 2-byte
array, exactly (`Format.keep`): full recomputation's activation memory halves against
fp32, and the rerun forward sees the same float32 values as the first.
"""

from numpitron.nn.layer import Layer


class Recomputed(Layer):
    def __init__(self, inner: Layer):
        self.inner = inner

    def parameters(self):
        return self.inner.parameters()

    def forward(self, x, **context):
        y, _ = self.inner.forward(x, **context)
        return y, {"x": self.precision.keep(x), "context": context}

    def backward_input(self, dy, cache):
        _, cache["inner"] = self.inner.forward(self.precision.widen(cache["x"]), **cache["context"])
        return self.inner.backward_input(dy, cache["inner"])

    def backward_weights(self, cache):
        self.inner.backward_weights(cache.pop("inner"))

    def backward(self, dy, cache):
        """Both halves: the inner layer's own, with whatever communication it overlaps."""
        _, inner = self.inner.forward(self.precision.widen(cache["x"]), **cache["context"])
        return self.inner.backward(dy, inner)
