"""Causal multi-head self-attention, heads split over tensor-parallel ranks and the
sequence split over context-parallel ranks.

The fused q|k|v projection is column-parallel, so each tp rank computes q, k, v for
its own H/tp heads and attends without communication; the output projection is
row-parallel and all-reduces once (Shoeybi et al. 2019, §3, Fig. 3b).

Between them, attention itself is context parallelism's (context_parallel/): the keys
and values of the other cp ranks come around a ring (ring_attention.py), and Ulysses
(ulysses.py) may first trade the sequence split for a head split inside groups of U cp
ranks, turning the output back afterwards. With cp = 1 both are a step over the rank's
own tokens.

Generation runs the same forward with a key/value cache (`kv`): the new positions
attend to every cached one, as one more block.
"""

import math

import numpy as np

from numpitron.context_parallel.blockwise_attention import AttentionState, attend_block, query_tiles
from numpitron.context_parallel.ring_attention import RingAttention
from numpitron.context_parallel.ulysses import HeadExchange
from numpitron.context_parallel.zigzag import Chunk
from numpitron.distributed.sharding import shard_size
from numpitron.nn.layer import Layer
from numpitron.nn.matmul import PLAIN, row_sums
from numpitron.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear


class ParallelAttention(Layer):
    def __init__(self, name: str, d_model: int, n_heads: int, topo, out_std: float, region=None,
                 keep_probs: bool = True):
        self.local_heads = shard_size(n_heads, topo.tp)
        self.head_dim = d_model // n_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)   # a Python float keeps float32 passes float32
        self.heads = HeadExchange(topo.cp_ulysses_comm, topo.cp, topo.cp_rank)
        self.ring = RingAttention(topo.cp_ring_comm)
        # False: selective recomputation (Korthikanti et al. 2022, §5): the softmax
        # probabilities are not kept but recomputed, block by block, in the backward.
        self.keep_probs = keep_probs
        self.qkv = ColumnParallelLinear(f"{name}.qkv", d_model, d_model, topo, groups=3, region=region)
        self.proj = RowParallelLinear(f"{name}.proj", d_model, d_model, topo, std=out_std, region=region)
        self.matmul = PLAIN         # the scores' and the outputs' products (another BLAS: blas/products.py)

    def parameters(self):
        return self.qkv.parameters() + self.proj.parameters()

    def _split_heads(self, qkv):
        # (B, T, 3 * H/tp * hd) -> q|k|v (3, B, H/tp, T, hd), one contiguous copy
        B, T, _ = qkv.shape
        qkv = qkv.reshape(B, T, 3, self.local_heads, self.head_dim)
        return np.ascontiguousarray(qkv.transpose(2, 0, 3, 1, 4))

    def forward(self, x, kv=None):
        # x: (B, T/cp, C) (/tp more with sequence parallelism) -> y: the same shape;
        # kv: this layer's KVCache slot while generating
        qkv, qkv_cache = self.qkv.forward(x)
        B, t, _ = qkv.shape                              # this rank's tokens
        # Ulysses: every token of the group, H/(tp U) heads each
        q, k, v = self.heads.to_heads(self._split_heads(qkv))
        T = q.shape[2]                                   # the tokens attention sees
        q *= self.scale                                  # cheaper on (T, hd) than on (T, T)
        fmt = self.precision
        fmt.round_(q)                                    # q keeps the scale: rounded with it
        state = AttentionState(q, fmt, self.matmul)
        if kv is not None:                               # the new positions, after the cached ones
            keys, values, start = kv.append(k, v)
            groups = [attend_block(q, query_tiles([Chunk(0, T, start)]), keys, values, [Chunk(0, start + T, 0)], state)]
        else:
            groups = self.ring.forward(q, k, v, state)
        out = self.heads.to_tokens(state.out)            # back to this rank's tokens, H/tp heads
        merged = fmt.round(out.transpose(0, 2, 1, 3).reshape(B, t, -1))     # the kernel writes the low format
        state.out = None             # the output projection keeps the merged copy
        # Kept for the backward in the low format (2 bytes): q, k, v, the probabilities;
        # the log-sum-exps stay fp32, as flash attention keeps them.
        groups = [[group._replace(probs=fmt.keep(group.probs) if self.keep_probs else None) for group in step]
                  for step in groups]
        y, proj_cache = self.proj.forward(merged)
        return y, {"qkv": qkv_cache, "q": fmt.keep(q), "k": fmt.keep(k), "v": fmt.keep(v), "state": state,
                   "groups": groups, "proj": proj_cache}

    def start_backward_input(self, dy, cache):
        fmt, state = self.precision, cache["state"]
        q, k, v = (fmt.widen(cache[name]) for name in "qkv")
        dmerged = self.proj.backward_input(dy, cache["proj"])
        B, t, _ = dmerged.shape                          # this rank's tokens
        heads = (B, t, self.local_heads, self.head_dim)
        # D = rowsum(dO * O), from the merged output the projection kept: (B, H/tp, t, 1)
        d_rowsum = row_sums((dmerged * fmt.widen(cache["proj"]["x"])).reshape(-1, self.head_dim))
        d_rowsum = d_rowsum.reshape(heads[:3]).transpose(0, 2, 1)[..., None]
        dout = np.ascontiguousarray(dmerged.reshape(heads).transpose(0, 2, 1, 3))
        dout, d_rowsum = self.heads.to_heads(dout), self.heads.to_heads(d_rowsum)    # as q was

        def probs_of(step, groups, block):
            if not self.keep_probs:                      # recompute this block's probabilities
                return self.ring.recompute(step, q, block, state)
            return [group._replace(probs=fmt.widen(group.probs)) for group in groups]

        dqkv = self.ring.backward(cache["groups"], q, k, v, dout, d_rowsum, state, probs_of)
        dq = dqkv[0]
        dq *= self.scale                                 # q held the scale; dk already has it
        dqkv = self.heads.to_tokens(dqkv).transpose(1, 3, 0, 2, 4).reshape(B, t, -1)
        return self.qkv.start_backward_input(dqkv, cache["qkv"])    # its sum may overlap our weight half

    def backward_weights(self, cache):
        self.proj.backward_weights(cache["proj"])
        self.qkv.backward_weights(cache["qkv"])
