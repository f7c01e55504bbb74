"""Element-wise kernels with closed-form backward, written to make few passes over
memory (at d_model 128 these cost as much as the matmuls).

GPT-2's tanh GELU is computed through the identity 0.5 (1 + tanh(u)) = sigmoid(2u):

    gelu(x) = x * sigmoid(2u),   u = s (x + a x^3),   s = sqrt(2 / pi),  a = 0.044715

which is the same function, exactly, but costs one exp per element instead of one
tanh (NumPy's float32 tanh is half again as slow as its exp on our CPUs). Its
derivative, with sig = sigmoid(2u) and y = gelu(x) = x sig:

    d gelu / dx = sig + x sig (1 - sig) 2 du/dx = sig + y (1 - sig) 2 s (1 + 3 a x^2)

Both passes run row tile by row tile (`row_tiles`), so the eight passes of a tile
over its arrays stay in the CPU's cache instead of streaming the whole (B*T, 4C)
activation from memory eight times; the column-parallel layer leaves its bias to
the forward here (Megatron's fused bias-GELU), which then costs no pass of its own.
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


def row_tiles(n_rows: int, row_len: int):
    """Slices of rows covering [0, n_rows), each about TILE_ELEMENTS elements."""
    step = max(1, TILE_ELEMENTS // max(row_len, 1))
    for lo in range(0, n_rows, step):
        yield slice(lo, min(lo + step, n_rows))


def bias_gelu_forward(h, bias):
    """h += bias (in place: h becomes GELU's input x), then y = gelu(x). h: (..., F),
    contiguous. Returns (y, sig), sig = sigmoid(2u), which the backward needs."""
    y, sig = np.empty_like(h), np.empty_like(h)
    x2, s2, y2 = (a.reshape(-1, h.shape[-1]) for a in (h, sig, y))
    with np.errstate(over="ignore"):      # exp(-2u) = inf for x < -10: sig = 0, y = -0, as it should
        for t in row_tiles(*x2.shape):
            x, s = x2[t], s2[t]
            x += bias
            np.multiply(x, x, out=s)
            s *= -2 * _GELU_S * _GELU_A
            s -= 2 * _GELU_S
            s *= x                        # -2u
            np.exp(s, out=s)
            s += 1.0
            np.reciprocal(s, out=s)       # sigmoid(2u)
            np.multiply(x, s, out=y2[t])
    return y, sig


def gelu_backward(dy, x, sig, y):
    """dL/dx from dL/dy, GELU's input x, sig = sigmoid(2u) and its output y; (..., F) each."""
    dx = np.empty_like(x)
    width = x.shape[-1]
    dy, x, sig, y, d2 = (a.reshape(-1, width) for a in (dy, x, sig, y, dx))
    scratch = np.empty_like(x[:max(1, TILE_ELEMENTS // width)])
    for t in row_tiles(*x.shape):
        d, one_minus = d2[t], scratch[:t.stop - t.start]
        np.multiply(x[t], x[t], out=d)
        d *= 6 * _GELU_S * _GELU_A
        d += 2 * _GELU_S                  # 2 du/dx
        np.subtract(1.0, sig[t], out=one_minus)
        one_minus *= y[t]
        d *= one_minus
        d += sig[t]
        d *= dy[t]
    return dx


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
