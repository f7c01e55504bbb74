"""LayerNorm over channels, replicated on every tensor-parallel rank.

Its input and the gradient arriving at its output are identical on every tp rank
(the row-parallel "g" and column-parallel "f" all-reduces see to that), so its
parameter gradients are identical too and need no communication.
"""

import numpy as np

from numpitron.nn.param import Param


class LayerNorm:
    def __init__(self, name: str, dim: int, eps: float = 1e-5):
        self.eps = eps
        self.weight = Param(f"{name}.weight", (dim,), init="ones", decay=False)
        self.bias = Param(f"{name}.bias", (dim,), init="zeros", decay=False)

    def parameters(self) -> list[Param]:
        return [self.weight, self.bias]

    def forward(self, x):
        # x: (N, C)
        mean = x.mean(axis=1, keepdims=True)
        xhat = x - mean
        var = np.square(xhat).mean(axis=1, keepdims=True)
        var += self.eps
        rstd = np.sqrt(var, out=var)
        np.reciprocal(rstd, out=rstd)
        xhat *= rstd
        y = xhat * self.weight.data
        y += self.bias.data
        return y, (xhat, rstd)

    def backward(self, dy, cache):
        xhat, rstd = cache
        self.weight.grad += (dy * xhat).sum(axis=0)
        self.bias.grad += dy.sum(axis=0)
        # Closed form: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * weight
        g = dy * self.weight.data
        mean_g = g.mean(axis=1, keepdims=True)
        mean_gx = (g * xhat).mean(axis=1, keepdims=True)
        g -= mean_g
        g -= xhat * mean_gx
        g *= rstd
        return g

