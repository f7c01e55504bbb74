"""Element-wise kernels with closed-form backward, written to make few passes over
memory (at d_model 128 these cost as much as the matmuls)."""

import numpy as np

_GELU_S = np.sqrt(2.0 / np.pi)
_GELU_A = 0.044715


def gelu_forward(x):
    """GPT-2's tanh GELU: 0.5 x (1 + tanh(s (x + a x^3))). Returns (y, tanh term)."""
    t = x * x
    t *= _GELU_S * _GELU_A
    t += _GELU_S
    t *= x                  # s (x + a x^3)
    np.tanh(t, out=t)
    y = t + 1.0
    y *= x
    y *= 0.5
    return y, t


def gelu_backward(dy, x, t):
    """d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) s (1 + 3 a x^2), with t the tanh term."""
    inner = x * x
    inner *= 3 * _GELU_A
    inner += 1.0
    inner *= _GELU_S * 0.5
    inner *= x
    sech2 = t * t
    np.subtract(1.0, sech2, out=sech2)
    inner *= sech2
    inner += 0.5
    sech2 = t * 0.5
    inner += sech2
    inner *= dy
    return inner




def softmax_lastdim_with_lse_(x):
    """In-place softmax over the last axis; returns log(sum(exp(x))) per row, the
    normaliser that lets partial softmaxes over blocks of a row be merged."""
    row_max = x.max(axis=-1, keepdims=True)
    x -= row_max
    np.exp(x, out=x)
    row_sum = x.sum(axis=-1, keepdims=True)
    lse = np.log(row_sum)
    lse += row_max
    x *= np.reciprocal(row_sum, out=row_sum)
    return lse
