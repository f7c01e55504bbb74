"""Element-wise kernels with closed-form backward, written to make few passes over
memory (at d_model 128 these cost as much as the matmuls).

GPT-2's tanh GELU is computed through the identity 0.5 (1 + tanh(u)) = sigmoid(2u):

    gelu(x) = x * sigmoid(2u),   u = s (x + a x^3),   s = sqrt(2 / pi),  a = 0.044715

which is the same function, exactly, but costs one exp per element instead of one
tanh (NumPy's float32 tanh is half again as slow as its exp on our CPUs). Its
derivative, with sig = sigmoid(2u) and y = gelu(x) = x sig:

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

# Python floats, not NumPy float64 scalars: a float64 scalar promotes a float32 pass to
# a float64 one with two casts (NEP 50), which costs seven times as much.
_GELU_S = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715
# Elements per tile: 256 KiB of float32 per array. Four arrays in flight spill a 512 KiB L2
# into L3, yet 64 K was the fastest of 4 K to 128 K (fewer calls; 16 K took 1.13x as long).
TILE_ELEMENTS = 1 << 16


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
    """(N, C) -> (N,) sums over each row, as one matrix-vector product: BLAS runs it
    at memory speed, where NumPy's reduction over short rows costs four times more."""
    return x @ _ones(x.shape[-1], x.dtype)


def column_sums(x):
    """(N, C) -> (C,) sums over the rows (a bias gradient), as a vector-matrix product."""
    return _ones(x.shape[0], x.dtype) @ x


def rows_per_tile(row_len: int) -> int:
    """Rows of `row_len` elements in one tile of about TILE_ELEMENTS (at least one)."""
    return max(1, TILE_ELEMENTS // max(row_len, 1))


def row_tiles(n_rows: int, row_len: int):
    """Slices of rows covering [0, n_rows), each about TILE_ELEMENTS elements."""
    step = rows_per_tile(row_len)
    for lo in range(0, n_rows, step):
        yield slice(lo, min(lo + step, n_rows))


def bias_gelu_forward(h, bias):
    """h += bias (h becomes GELU's input x), y = gelu(x), then h is overwritten with
    the slope gelu'(x). h: (..., F), contiguous. Returns (y, slope), slope being h."""
    y = np.empty_like(h)
    x2, y2 = h.reshape(-1, h.shape[-1]), y.reshape(-1, h.shape[-1])
    tile_rows = min(x2.shape[0], rows_per_tile(x2.shape[1]))
    square_tile, sig_tile = np.empty((2, tile_rows, x2.shape[1]), h.dtype)
    with np.errstate(over="ignore"):      # exp(-2u) = inf for x < -10: sig = 0, y = -0, as it should
        for t in row_tiles(*x2.shape):
            x, x_sq, sig = x2[t], square_tile[:t.stop - t.start], sig_tile[:t.stop - t.start]
            x += bias
            np.multiply(x, x, out=x_sq)
            np.multiply(x_sq, -2 * _GELU_S * _GELU_A, out=sig)
            sig -= 2 * _GELU_S
            sig *= x                      # -2u
            np.exp(sig, out=sig)
            sig += 1.0
            np.reciprocal(sig, out=sig)   # sigmoid(2u)
            np.multiply(x, sig, out=y2[t])
            x_sq *= 6 * _GELU_S * _GELU_A
            x_sq += 2 * _GELU_S           # 2 du/dx
            slope = np.subtract(1.0, sig, out=x)      # x is no longer needed: its tile takes the slope
            slope *= y2[t]
            slope *= x_sq
            slope += sig
    return y, h


def gelu_backward_(dy, slope):
    """dL/dx = dL/dy * gelu'(x), written over dy (the caller's own fresh gradient)."""
    dy *= slope
    return dy


def softmax_lastdim_with_lse_(x):
    """In-place softmax over the last axis; returns log(sum(exp(x))) per row, the
    normaliser that lets partial softmaxes over blocks of a row be merged."""
    row_max = x.max(axis=-1, keepdims=True)
    x -= row_max
    np.exp(x, out=x)
    row_sum = row_sums(x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1] + (1,))
    lse = np.log(row_sum)
    lse += row_max
    x *= np.reciprocal(row_sum, out=row_sum)
    return lse
