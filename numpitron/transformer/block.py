"""A pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(x)). The MLP
is the dense one unless the block is given another (a mixture of experts, experts/)."""

import math

from numpitron.transformer.attention import ParallelAttention
from numpitron.nn.layer import Layer
from numpitron.nn.layernorm import LayerNorm
from numpitron.transformer.mlp import ParallelMLP


class Block(Layer):
    def __init__(self, name: str, d_model: int, n_heads: int, n_layers: int, topo, region=None,
                 keep_probs: bool = True, mlp: Layer | None = None):
        out_std = self.out_std(n_layers)
        self.ln1 = LayerNorm(f"{name}.ln1", d_model)
        self.attn = ParallelAttention(f"{name}.attn", d_model, n_heads, topo, out_std, region, keep_probs)
        self.ln2 = LayerNorm(f"{name}.ln2", d_model)
        self.mlp = mlp or ParallelMLP(f"{name}.mlp", d_model, topo, out_std, region)

    @staticmethod
    def out_std(n_layers: int) -> float:
        """GPT-2: residual output projections drawn with std 0.02 / sqrt(2 * n_layers)."""
        return 0.02 / math.sqrt(2 * n_layers)

    def parameters(self):
        return self.ln1.parameters() + self.attn.parameters() + self.ln2.parameters() + self.mlp.parameters()

    def forward(self, x, kv=None):
        # x: (B, T, C) residual stream, replicated over tp
        h, ln1_cache = self.ln1.forward(x)
        a, attn_cache = self.attn.forward(h, kv=kv)
        x = self.precision.round(x + a)     # the residual stream, in the low format
        h, ln2_cache = self.ln2.forward(x)
        m, mlp_cache = self.mlp.forward(h)
        x += m
        return x, {"ln1": ln1_cache, "attn": attn_cache, "ln2": ln2_cache, "mlp": mlp_cache}

    def backward_input(self, dx, cache):
        return self._backward(dx, cache, "backward_input")

    def backward_weights(self, cache):
        for name in ("mlp", "ln2", "attn", "ln1"):
            getattr(self, name).backward_weights(cache[name])

    def backward(self, dx, cache):
        """Both halves, sub-layer by sub-layer: the MLP's and the attention's
        input-gradient sums over tp hide behind their own weight gradients (nn/layer.py)."""
        return self._backward(dx, cache, "backward")

    def _backward(self, dx, cache, half: str):
        # half: each sub-layer's "backward_input", or its whole "backward".
        # The residual's gradient is added into the LayerNorm's fresh output, never into
        # dx itself: the inner layers keep the gradient they were given for their
        # weight half.
        dh = getattr(self.mlp, half)(dx, cache["mlp"])
        dln = getattr(self.ln2, half)(dh, cache["ln2"])
        dln += dx
        dh = getattr(self.attn, half)(dln, cache["attn"])
        dx = getattr(self.ln1, half)(dh, cache["ln1"])
        dx += dln
        return dx
