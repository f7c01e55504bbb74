"""A pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

import math

from numpitron.nn.attention import ParallelAttention
from numpitron.nn.layernorm import LayerNorm
from numpitron.nn.mlp import ParallelMLP


class Block:
    def __init__(self, name: str, d_model: int, n_heads: int, n_layers: int, topo):
        # GPT-2: residual output projections scaled by 1/sqrt(2 * n_layers)
        out_std = 0.02 / math.sqrt(2 * n_layers)
        self.ln1 = LayerNorm(f"{name}.ln1", d_model)
        self.attn = ParallelAttention(f"{name}.attn", d_model, n_heads, topo, out_std)
        self.ln2 = LayerNorm(f"{name}.ln2", d_model)
        self.mlp = ParallelMLP(f"{name}.mlp", d_model, topo, out_std)

    def parameters(self):
        return self.ln1.parameters() + self.attn.parameters() + self.ln2.parameters() + self.mlp.parameters()

    def forward(self, x, B, T):
        # x: (N, C) residual stream, replicated over tp
        h, ln1_cache = self.ln1.forward(x)
        a, attn_cache = self.attn.forward(h, B, T)
        x = x + a
        h, ln2_cache = self.ln2.forward(x)
        m, mlp_cache = self.mlp.forward(h)
        x += m
        return x, (ln1_cache, attn_cache, ln2_cache, mlp_cache)

    def backward(self, dx, cache):
        ln1_cache, attn_cache, ln2_cache, mlp_cache = cache
        dh = self.mlp.backward(dx, mlp_cache)
        dx = dx + self.ln2.backward(dh, ln2_cache)
        dh = self.attn.backward(dx, attn_cache)
        dx += self.ln1.backward(dh, ln1_cache)
        return dx

    def decode(self, x, kv, pos):
        """Incremental forward for generation; x: (B, t, C)."""
        B, t, C = x.shape
        h, _ = self.ln1.forward(x.reshape(B * t, C))
        x = x + self.attn.decode(h.reshape(B, t, C), kv, pos)
        h, _ = self.ln2.forward(x.reshape(B * t, C))
        m, _ = self.mlp.forward(h)
        return x + m.reshape(B, t, C)
