"""LayerNorm over channels, replicated on every tensor-parallel rank.

Its input and the gradient arriving at its output are identical on every tp rank
(the row-parallel "g" and column-parallel "f" all-reduces see to that), so its
parameter gradients are identical too and need no communication.
"""

import numpy as np

from numpitron.nn.layer import Layer
from numpitron.nn.matmul import column_sums, row_sums, rows
from numpitron.nn.param import Param


class LayerNorm(Layer):
    def __init__(self, name: str, dim: int, eps: float = 1e-5):
        self.eps = eps
        self.weight = Param(f"{name}.weight", (dim,), init="ones", decay=False)
        self.bias = Param(f"{name}.bias", (dim,), init="zeros", decay=False)

    def parameters(self) -> list[Param]:
        return [self.weight, self.bias]

    def forward(self, x):
        """y = (x - mean) / sqrt(var + eps) * weight + bias over the C channels of each
        row (reference: numpitron.reference.layernorm). Keeps xhat and 1 / sqrt(var + eps):
        in a mixed run y and xhat in the low format, as a fused LayerNorm kernel writes
        them (it keeps its input, whose rounding xhat's is here), 1/std in fp32."""
        # x: (B, T, C)
        inv_c = 1.0 / x.shape[-1]
        mean = row_sums(rows(x))[:, None]           # row means as matrix-vector products (BLAS)
        mean *= inv_c
        centred = rows(x) - mean
        var = row_sums(centred * centred)[:, None]
        var *= inv_c
        var += self.eps
        rstd = np.sqrt(var, out=var)
        np.reciprocal(rstd, out=rstd)               # 1 / sqrt(var + eps)
        xhat = np.multiply(centred, rstd, out=centred)
        y = xhat * self.weight.data
        y += self.bias.data
        y = self.precision.round(y)
        return y.reshape(x.shape), {"xhat": self.precision.keep(xhat), "rstd": rstd}

    def backward_input(self, dy, cache):
        """dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy * weight (chapter 1 derives
        it; reference: numpitron.reference.layernorm_backward). The weight half needs
        only two column sums, sum(dy xhat) and sum(dy), so the cache keeps those."""
        xhat, rstd, w = rows(self.precision.widen(cache["xhat"])), rows(cache["rstd"]), self.weight.data
        dy2 = rows(dy)
        dy_xhat = dy2 * xhat
        cache["dweight"], cache["dbias"] = column_sums(dy_xhat), column_sums(dy2)
        # Both row means as matrix-vector products (BLAS), without forming g first:
        # mean(g) = dy @ w / C and mean(g * xhat) = (dy * xhat) @ w / C.
        inv_c = 1.0 / xhat.shape[1]
        mean_g = (dy2 @ w)[:, None] * inv_c
        mean_gx = (dy_xhat @ w)[:, None] * inv_c
        g = dy2 * w
        g -= mean_g
        g -= xhat * mean_gx
        g *= rstd
        return g.reshape(dy.shape)

    def backward_weights(self, cache):
        self.weight.grad += cache["dweight"]
        self.bias.grad += cache["dbias"]
