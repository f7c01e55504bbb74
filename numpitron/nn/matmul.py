"""The products every layer makes, as they are written, and the two sums BLAS does best.

A linear layer's three products (y = x W, dL/dx = dL/dy W^T, dL/dW = x^T dL/dy) go
through one object, `PlainMatmul`, and so do attention's stacked products, so that a
feature may install another (FP8's scaled products, precision/fp8.py; another BLAS,
blas/products.py) without the layer knowing.
"""

import numpy as np


def rows(x: np.ndarray) -> np.ndarray:
    """(B, T, C) -> (B*T, C), a view when x is contiguous: one BLAS call per matmul."""
    return x.reshape(-1, x.shape[-1])


class PlainMatmul:
    """The three products of a linear layer, computed as they are written."""

    def forward(self, x, w):
        return x @ w                                    # y = x W

    def input_grad(self, dy, w):
        return dy @ w.T                                 # dL/dx = dL/dy W^T

    def weight_grad(self, x, dy):
        return x.T @ dy                                 # dL/dW = x^T dL/dy

    def add_weight_grad(self, x, dy, grad):
        grad += self.weight_grad(x, dy)                 # summed over micro-batches

    def product(self, a, b, out=None):
        return np.matmul(a, b, out=out)                 # attention's, over (B, H) stacks

    def add_product(self, a, b, out):
        out += a @ b


PLAIN = PlainMatmul()

_ONES = {}


def _ones(n: int, dtype) -> np.ndarray:
    key = (n, np.dtype(dtype))
    if key not in _ONES:
        if len(_ONES) > 64:               # generation visits many lengths: keep the cache small
            _ONES.clear()
        _ONES[key] = np.ones(n, dtype)
        _ONES[key].flags.writeable = False
    return _ONES[key]


def row_sums(x):
    """(N, C) -> (N,) sums over each row, as one matrix-vector product: BLAS streams
    the array once, where NumPy's reduction over short rows pays per row."""
    return x @ _ones(x.shape[-1], x.dtype)


def column_sums(x):
    """(N, C) -> (C,) sums over the rows (a bias gradient), as a vector-matrix product."""
    return _ones(x.shape[0], x.dtype) @ x
