"""Element-wise kernels with closed-form backward, written to make few passes over
memory: at d_model 128 these cost as much as the matmuls (the speed appendix of docs/ measures each).
Their plain forms are in numpitron/reference.py, and the tests hold each kernel to it.

GPT-2's tanh GELU is computed through the identity 0.5 (1 + tanh(u)) = sigmoid(2u):

    gelu(x) = x * sigmoid(2u),   u = s (x + a x^3),   s = sqrt(2 / pi),  a = 0.044715

which is the same function, exactly, but takes one exp per element instead of one
tanh, the dearer of the two in NumPy. Its derivative, with sig = sigmoid(2u) and
y = gelu(x) = x sig:

    gelu'(x) = sig + x sig (1 - sig) 2 du/dx = sig + y (1 - sig) 2 s (1 + 3 a x^2)

The forward computes this slope too, while x, x^2, sig and y are in cache, and
stores it over x: the backward is then one multiply (dx = dy gelu'(x)) and keeps
two hidden-sized arrays (slope and y) instead of three (x, sig and y).

The forward runs row tile by row tile (`row_tiles`), so the passes of a tile over its
arrays stay in the CPU's cache instead of streaming the whole (B*T, 4C) activation
from memory many times; the column-parallel layer leaves its bias to the forward
here (Megatron's fused bias-GELU), which then costs no pass of its own.
"""

import math

import numpy as np

from numpitron.nn.matmul import row_sums

# Python floats, not NumPy float64 scalars: a float64 scalar promotes a float32 pass to
# a float64 one with two casts (NEP 50; tests/test_float32_passes.py keeps it out).
_GELU_S = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715
# Elements per tile: 256 KiB of float32 per array. Fewer, longer tiles pay fewer NumPy
# calls; shorter ones stay in L2. benchmarks/README.md gives the sizes tried.
TILE_ELEMENTS = 1 << 16


def rows_per_tile(row_len: int) -> int:
    """Rows of `row_len` elements in one tile of about TILE_ELEMENTS (at least one)."""
    return max(1, TILE_ELEMENTS // max(row_len, 1))


def row_tiles(n_rows: int, row_len: int):
    """Slices of rows covering [0, n_rows), each about TILE_ELEMENTS elements."""
    step = rows_per_tile(row_len)
    for lo in range(0, n_rows, step):
        yield slice(lo, min(lo + step, n_rows))


def bias_gelu_forward(h, bias):
    """GELU of h + bias, and its slope, in one tiled pass over h (reference:
    numpitron.reference.gelu and gelu_slope):

        x = h + bias,   y = gelu(x) = x sigmoid(2u),   slope = gelu'(x)

    h: (..., F), contiguous. It is consumed: its buffer ends up holding the slope.
    Returns (y, slope), slope being h's buffer."""
    y = np.empty_like(h)
    h2, y2 = h.reshape(-1, h.shape[-1]), y.reshape(-1, h.shape[-1])
    tile_rows = min(h2.shape[0], rows_per_tile(h2.shape[1]))
    scratch_a, scratch_b = np.empty((2, tile_rows, h2.shape[1]), h.dtype)
    with np.errstate(over="ignore"):      # exp(-2u) = inf for x < -10: sig = 0, y = -0, as it should
        for t in row_tiles(*h2.shape):
            n = t.stop - t.start
            x = h2[t]
            x += bias                                           # x = h + bias, GELU's input
            x_sq = np.multiply(x, x, out=scratch_a[:n])         # x^2
            minus_2u = np.multiply(x_sq, -2 * _GELU_S * _GELU_A, out=scratch_b[:n])
            minus_2u -= 2 * _GELU_S
            minus_2u *= x                                       # -2u = -2 s (x + a x^3)
            sig = np.exp(minus_2u, out=minus_2u)                # exp(-2u)...
            sig += 1.0
            np.reciprocal(sig, out=sig)                         # ...sig = 1 / (1 + exp(-2u)) = sigmoid(2u)
            y_t = np.multiply(x, sig, out=y2[t])                # y = x sig
            two_du_dx = np.multiply(x_sq, 6 * _GELU_S * _GELU_A, out=x_sq)
            two_du_dx += 2 * _GELU_S                            # 2 du/dx = 2 s (1 + 3 a x^2)
            slope = np.subtract(1.0, sig, out=x)                # x is not needed again: its tile takes the slope
            slope *= y_t
            slope *= two_du_dx
            slope += sig                                        # gelu'(x) = sig + y (1 - sig) 2 du/dx
    return y, h


def gelu_backward_(dy, slope):
    """dL/dx = dL/dy * gelu'(x), written over dy (the caller's own fresh gradient);
    slope is what bias_gelu_forward returned."""
    dy *= slope
    return dy


def softmax_lastdim_with_lse_(x):
    """x becomes softmax(x) over the last axis, in place; returns L = log(sum(exp(x)))
    per row, the normaliser that lets partial softmaxes over blocks of a row be merged
    (reference: numpitron.reference.softmax and logsumexp):

        softmax(x) = exp(x - m) / sum(exp(x - m)),   L = m + log(sum(exp(x - m))),   m = max(x)"""
    row_max = x.max(axis=-1, keepdims=True)
    x -= row_max
    exps = np.exp(x, out=x)                                     # x's buffer now holds exp(x - m)
    row_sum = row_sums(exps.reshape(-1, x.shape[-1])).reshape(x.shape[:-1] + (1,))
    lse = np.log(row_sum)
    lse += row_max
    exps *= np.reciprocal(row_sum, out=row_sum)                 # and now softmax(x)
    return lse
