"""Causal multi-head self-attention with its heads split over tensor-parallel ranks.

The fused q|k|v projection is column-parallel, so each rank computes q, k, v for
its own H/tp heads and attends without communication; the output projection is
row-parallel and all-reduces once (Shoeybi et al. 2019, §3, Fig. 3b).
"""

import numpy as np

from numpitron.nn.functional import causal_mask, softmax_lastdim_, softmax_lastdim_backward
from numpitron.nn.linear import ColumnParallelLinear, RowParallelLinear


class ParallelAttention:
    def __init__(self, name: str, d_model: int, n_heads: int, topo, out_std: float):
        self.local_heads = n_heads // topo.tp
        self.head_dim = d_model // n_heads
        self.scale = 1.0 / np.sqrt(self.head_dim)
        self.qkv = ColumnParallelLinear(f"{name}.qkv", d_model, d_model, topo, groups=3)
        self.proj = RowParallelLinear(f"{name}.proj", d_model, d_model, topo, std=out_std)
        self._masks = {}

    def parameters(self):
        return self.qkv.parameters() + self.proj.parameters()

    def _mask(self, T, dtype):
        key = (T, np.dtype(dtype))
        if key not in self._masks:
            self._masks[key] = causal_mask(T, dtype)
        return self._masks[key]

    def _split_heads(self, qkv, B, T):
        # (N, 3 * H/tp * hd) -> q, k, v each (B, H/tp, T, hd), one contiguous copy
        qkv = qkv.reshape(B, T, 3, self.local_heads, self.head_dim)
        q, k, v = np.ascontiguousarray(qkv.transpose(2, 0, 3, 1, 4))
        return q, k, v

    def forward(self, x, B, T):
        qkv, qkv_cache = self.qkv.forward(x)
        q, k, v = self._split_heads(qkv, B, T)
        q *= self.scale                                  # cheaper on (T, hd) than on (T, T)
        probs = q @ k.transpose(0, 1, 3, 2)              # (B, H/tp, T, T)
        probs += self._mask(T, x.dtype)
        softmax_lastdim_(probs)
        heads = probs @ v                                # (B, H/tp, T, hd)
        merged = heads.transpose(0, 2, 1, 3).reshape(B * T, -1)
        y, proj_cache = self.proj.forward(merged)
        return y, (qkv_cache, q, k, v, probs, proj_cache, B, T)

    def backward(self, dy, cache):
        qkv_cache, q, k, v, probs, proj_cache, B, T = cache
        dmerged = self.proj.backward(dy, proj_cache)
        dheads = dmerged.reshape(B, T, self.local_heads, self.head_dim).transpose(0, 2, 1, 3)
        dqkv = np.empty((3, B, self.local_heads, T, self.head_dim), dy.dtype)
        np.matmul(probs.transpose(0, 1, 3, 2), dheads, out=dqkv[2])     # dv = P^T dY
        dscores = softmax_lastdim_backward(dheads @ v.transpose(0, 1, 3, 2), probs)
        np.matmul(dscores, k, out=dqkv[0])                              # dq (pre-scale)
        dqkv[0] *= self.scale
        np.matmul(dscores.transpose(0, 1, 3, 2), q, out=dqkv[1])        # dk (q holds the scale)
        dqkv = dqkv.transpose(1, 3, 0, 2, 4).reshape(B * T, -1)
        return self.qkv.backward(dqkv, qkv_cache)

    def decode(self, x, kv, pos):
        """One step of generation for new tokens x (B, t, C) at positions pos..pos+t-1,
        appending to the key/value cache kv = (K, V), each (B, H/tp, T_max, hd)."""
        B, t = x.shape[0], x.shape[1]
        qkv, _ = self.qkv.forward(x.reshape(B * t, -1))
        q, k, v = self._split_heads(qkv, B, t)
        kv[0][:, :, pos:pos + t] = k
        kv[1][:, :, pos:pos + t] = v
        keys, values = kv[0][:, :, :pos + t], kv[1][:, :, :pos + t]
        scores = (q * self.scale) @ keys.transpose(0, 1, 3, 2)          # (B, H/tp, t, pos+t)
        scores += self._mask(pos + t, x.dtype)[pos:pos + t]
        heads = softmax_lastdim_(scores) @ values
        y, _ = self.proj.forward(heads.transpose(0, 2, 1, 3).reshape(B * t, -1))
        return y.reshape(B, t, -1)
