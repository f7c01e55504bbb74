"""GELU MLP of width 4C: column-parallel up-projection, row-parallel down-projection.

GELU is element-wise, so it applies to each rank's slice of the hidden layer with
no communication in between (Shoeybi et al. 2019, §3, Fig. 3a).
"""

from numpitron.nn.functional import gelu_backward, gelu_forward
from numpitron.nn.linear import ColumnParallelLinear, RowParallelLinear


class ParallelMLP:
    def __init__(self, name: str, d_model: int, topo, out_std: float):
        self.fc = ColumnParallelLinear(f"{name}.fc", d_model, 4 * d_model, topo)
        self.proj = RowParallelLinear(f"{name}.proj", 4 * d_model, d_model, topo, std=out_std)

    def parameters(self):
        return self.fc.parameters() + self.proj.parameters()

    def forward(self, x):
        h, fc_cache = self.fc.forward(x)          # (N, 4C / tp)
        a, tanh_term = gelu_forward(h)
        y, proj_cache = self.proj.forward(a)      # (N, C)
        return y, (fc_cache, h, tanh_term, proj_cache)

    def backward(self, dy, cache):
        fc_cache, h, tanh_term, proj_cache = cache
        da = self.proj.backward(dy, proj_cache)
        dh = gelu_backward(da, h, tanh_term)
        return self.fc.backward(dh, fc_cache)
