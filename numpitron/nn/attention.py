"""Causal multi-head self-attention with its heads split over tensor-parallel ranks.

The fused q|k|v projection is column-parallel, so each rank computes q, k, v for
its own H/tp heads and attends without communication; the output projection is
row-parallel and all-reduces once (Shoeybi et al. 2019, §3, Fig. 3b).

Generation runs the same forward with a key/value cache (`kv`): the new positions'
keys and values are appended to the cached ones and the queries attend to all of
them, so training and sampling share every line of the attention math.
"""

import numpy as np

from numpitron.nn.functional import causal_mask, softmax_lastdim_, softmax_lastdim_backward
from numpitron.nn.layer import Layer
from numpitron.nn.linear import ColumnParallelLinear, RowParallelLinear


class ParallelAttention(Layer):
    def __init__(self, name: str, d_model: int, n_heads: int, topo, out_std: float):
        self.local_heads = n_heads // topo.tp
        self.head_dim = d_model // n_heads
        self.scale = 1.0 / np.sqrt(self.head_dim)
        self.qkv = ColumnParallelLinear(f"{name}.qkv", d_model, d_model, topo, groups=3)
        self.proj = RowParallelLinear(f"{name}.proj", d_model, d_model, topo, std=out_std)
        self._mask = np.zeros((0, 0))

    def parameters(self):
        return self.qkv.parameters() + self.proj.parameters()

    def mask(self, start: int, T: int, dtype) -> np.ndarray:
        """Rows start..start+T of the causal mask over start+T keys. One mask of the
        largest size seen is kept; any top-left block of it is causal too."""
        size = start + T
        if self._mask.shape[0] < size or self._mask.dtype != dtype:
            self._mask = causal_mask(max(size, self._mask.shape[0]), dtype)
        return self._mask[start:size, :size]

    def _split_heads(self, qkv):
        # (B, T, 3 * H/tp * hd) -> q, k, v each (B, H/tp, T, hd), one contiguous copy
        B, T, _ = qkv.shape
        qkv = qkv.reshape(B, T, 3, self.local_heads, self.head_dim)
        q, k, v = np.ascontiguousarray(qkv.transpose(2, 0, 3, 1, 4))
        return q, k, v

    def forward(self, x, kv=None):
        # x: (B, T, C) -> y: (B, T, C); kv: this layer's KVCache slot while generating
        B, T, _ = x.shape
        qkv, qkv_cache = self.qkv.forward(x)
        q, k, v = self._split_heads(qkv)
        start = 0
        if kv is not None:                               # keys of earlier positions too
            k, v, start = kv.append(k, v)
        q *= self.scale                                  # cheaper on (T, hd) than on (T, T)
        probs = q @ k.transpose(0, 1, 3, 2)              # (B, H/tp, T, start + T)
        probs += self.mask(start, T, x.dtype)
        softmax_lastdim_(probs)
        heads = probs @ v                                # (B, H/tp, T, hd)
        merged = heads.transpose(0, 2, 1, 3).reshape(B, T, -1)
        y, proj_cache = self.proj.forward(merged)
        return y, {"qkv": qkv_cache, "q": q, "k": k, "v": v, "probs": probs, "proj": proj_cache}

    def backward_input(self, dy, cache):
        q, k, v, probs = cache["q"], cache["k"], cache["v"], cache["probs"]
        B, _, T, _ = q.shape
        dmerged = self.proj.backward_input(dy, cache["proj"])
        dheads = dmerged.reshape(B, T, self.local_heads, self.head_dim).transpose(0, 2, 1, 3)
        dqkv = np.empty((3, B, self.local_heads, T, self.head_dim), dy.dtype)
        np.matmul(probs.transpose(0, 1, 3, 2), dheads, out=dqkv[2])     # dv = P^T dY
        dscores = softmax_lastdim_backward(dheads @ v.transpose(0, 1, 3, 2), probs)
        np.matmul(dscores, k, out=dqkv[0])                              # dq (pre-scale)
        dqkv[0] *= self.scale
        np.matmul(dscores.transpose(0, 1, 3, 2), q, out=dqkv[1])        # dk (q holds the scale)
        dqkv = dqkv.transpose(1, 3, 0, 2, 4).reshape(B, T, -1)
        return self.qkv.backward_input(dqkv, cache["qkv"])

    def backward_weights(self, cache):
        self.proj.backward_weights(cache["proj"])
        self.qkv.backward_weights(cache["qkv"])
