"""Layers with explicit forward and backward.

Every layer follows one contract: `forward(x) -> (y, cache)` and
`backward(dy, cache) -> dx`. Caches are returned, never stored on the layer, so a
pipeline schedule can keep several micro-batches in flight. Gradients accumulate
(`+=`) into `Param.grad`; zeroing them is an explicit step of the training loop.
Shapes in comments: B batch, T time, C channels, H heads, V vocabulary, N = B*T.
"""
