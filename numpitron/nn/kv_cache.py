"""Keys and values of every attention layer of one pipeline stage, for generation.

Each tp rank keeps its own heads only. `pos` positions are filled; a forward with
the cache appends t new positions in every layer, then the stage advances `pos`.
"""

import numpy as np


class KVCache:
    def __init__(self, n_layers: int, batch: int, heads: int, max_len: int, head_dim: int, dtype):
        shape = (n_layers, batch, heads, max_len, head_dim)
        self.keys, self.values = np.zeros(shape, dtype), np.zeros(shape, dtype)
        self.max_len = max_len
        self.pos = 0

    def layer(self, index: int) -> "LayerKV":
        return LayerKV(self, index)

    def advance(self, t: int) -> None:
        self.pos += t

    def reset(self) -> None:
        self.pos = 0


class LayerKV:
    """One attention layer's slot in a KVCache."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def append(self, k, v):
        """Store k, v (B, H/tp, t, hd) at positions pos..pos+t; returns every cached
        key and value so far, (B, H/tp, pos+t, hd) each, and pos."""
        pos, t = self.cache.pos, k.shape[2]
        if pos + t > self.cache.max_len:
            raise ValueError(f"key/value cache holds {self.cache.max_len} positions, asked for {pos + t}")
        keys, values = self.cache.keys[self.index], self.cache.values[self.index]
        keys[:, :, pos:pos + t] = k
        values[:, :, pos:pos + t] = v
        return keys[:, :, :pos + t], values[:, :, :pos + t], pos
