"""Layers with explicit forward and backward, all following the contract of
`numpitron.nn.layer` (docs/architecture.md, "Layers").

Shapes in comments: B batch, T time, C channels, H heads, V vocabulary, N = B*T.
"""
