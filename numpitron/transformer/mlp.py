"""GELU MLP of width 4C: column-parallel up-projection, row-parallel down-projection.

    h = x W_fc,   a = gelu(h + b_fc),   y = a W_proj + b_proj

GELU is element-wise, so it applies to each rank's slice of the hidden layer with
no communication in between (Shoeybi et al. 2019, §3, Fig. 3a). This is the one copy
of the MLP's math: the dense block uses it, and so does every expert of a mixture
(experts/local_experts.py), with a region that leaves the sums over tp to the caller.
"""

from numpitron.nn.functional import bias_gelu_forward, gelu_backward_
from numpitron.nn.layer import Layer
from numpitron.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear


class ParallelMLP(Layer):
    def __init__(self, name: str, d_model: int, topo, out_std: float, region=None, add_proj_bias: bool = True,
                 hidden: int = 0):
        """add_proj_bias=False: the caller adds proj's bias after its own sum over tp.
        hidden: the width of the hidden layer, 4C unless given (experts choose theirs)."""
        hidden = hidden or 4 * d_model
        self.fc = ColumnParallelLinear(f"{name}.fc", d_model, hidden, topo, region=region, add_bias=False)
        self.proj = RowParallelLinear(f"{name}.proj", hidden, d_model, topo, std=out_std, region=region,
                                      add_bias=add_proj_bias)

    def parameters(self):
        return self.fc.parameters() + self.proj.parameters()

    def forward(self, x):
        h, fc_cache = self.fc.forward(x)          # (..., 4C / tp), without fc's bias
        # fc's bias goes in here; h is consumed, its buffer becoming gelu'(h + b_fc)
        a, slope = bias_gelu_forward(h, self.fc.bias.data)
        a = self.precision.round(a)               # GELU's kernel writes the low format
        y, proj_cache = self.proj.forward(a)      # (..., C); proj keeps a for its weight gradient
        return y, {"fc": fc_cache, "slope": self.precision.keep(slope), "proj": proj_cache}

    def start_backward_input(self, dy, cache):
        da = self.proj.backward_input(dy, cache["proj"])
        dh = gelu_backward_(da, self.precision.widen(cache["slope"]))
        return self.fc.start_backward_input(dh, cache["fc"])     # its sum may overlap our weight half

    def backward_weights(self, cache):
        self.proj.backward_weights(cache["proj"])
        self.fc.backward_weights(cache["fc"])
