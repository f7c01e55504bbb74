"""Causal multi-head self-attention, heads split over tensor-parallel ranks and the
sequence split over context-parallel ranks.

The fused q|k|v projection is column-parallel, so each tp rank computes q, k, v for
its own H/tp heads and attends without communication; the output projection is
row-parallel and all-reduces once (Shoeybi et al. 2019, §3, Fig. 3b).

Each cp rank holds two chunks of every sequence (the zigzag split of
context_parallel/zigzag.py). Its queries must see every earlier key, so the key/value
blocks travel around the cp ring (Liu et al. 2023, "Ring Attention"): at step s a
rank attends to the block of rank (r - s) mod cp while passing it on to rank r + 1,
and folds each partial result in with the online softmax (context_parallel/blockwise_attention.py).
The backward sends the blocks around again, with their gradients travelling beside
them, home to their owners after the last step. With cp = 1 the ring is one step
over the rank's own block.

Ulysses (context_parallel/ulysses.py) splits the cp group once more: inside groups of U
ranks an all-to-all gives every rank all the group's tokens of H/(tp U) heads before
attention, and another turns the output back; the ring then runs over the cp/U
groups. The ring alone is U = 1 (both exchanges return their input), Ulysses alone
U = cp (a ring of one).

Generation runs the same forward with a key/value cache (`kv`): the new positions
attend to every cached one, as one more block.
"""

import math

import numpy as np

from numpitron.context_parallel.zigzag import Chunk, zigzag_chunks
from numpitron.distributed.sharding import shard_size
from numpitron.context_parallel.blockwise_attention import AttentionState, attend_block, attend_block_backward, query_tiles
from numpitron.nn.functional import row_sums
from numpitron.nn.layer import Layer
from numpitron.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from numpitron.context_parallel.ulysses import HeadExchange

KV_TAG, GRAD_TAG = 10, 20


class ParallelAttention(Layer):
    def __init__(self, name: str, d_model: int, n_heads: int, topo, out_std: float, region=None,
                 keep_probs: bool = True):
        self.local_heads = shard_size(n_heads, topo.tp)
        self.head_dim = d_model // n_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)   # a Python float keeps float32 passes float32
        self.heads = HeadExchange(topo.cp_ulysses_comm, topo.cp, topo.cp_rank)
        self.ring, self.ring_rank = topo.cp_ring_comm, topo.cp_ring_comm.rank
        self.chunks = zigzag_chunks          # which positions each ring rank holds
        # False: selective recomputation (Korthikanti et al. 2022, §5): the softmax
        # probabilities are not kept but recomputed, block by block, in the backward.
        self.keep_probs = keep_probs
        self.qkv = ColumnParallelLinear(f"{name}.qkv", d_model, d_model, topo, groups=3, region=region)
        self.proj = RowParallelLinear(f"{name}.proj", d_model, d_model, topo, std=out_std, region=region)

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
        state = AttentionState(q, fmt)
        if kv is not None:                               # the new positions, after the cached ones
            keys, values, start = kv.append(k, v)
            groups = [attend_block(q, query_tiles([Chunk(0, T, start)]), keys, values, [Chunk(0, start + T, 0)], state)]
        else:
            groups = self._ring_forward(q, k, v, state)
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

    def _ring_forward(self, q, k, v, state):
        """The softmax groups of every ring step, one list per step."""
        T, cp = q.shape[2], self.ring.size
        mine = query_tiles(self.chunks(T, cp, self.ring_rank))
        groups, block = [], [k, v]
        for step in range(cp):
            owner = (self.ring_rank - step) % cp
            if step + 1 < cp:                            # pass this block on while using it
                incoming, pending = self.ring.ring_pass(block, KV_TAG)
            groups.append(attend_block(q, mine, *block, self.chunks(T, cp, owner), state))
            if step + 1 < cp:
                self.ring.wait_all(pending)
                block = incoming
        return groups

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
        dqkv = np.zeros((3,) + q.shape, dy.dtype)        # every group adds into it
        dq, dk, dv = dqkv
        T, cp = q.shape[2], self.ring.size
        block, grads, steps = [k, v], [dk, dv], len(cache["groups"])
        for step, groups in enumerate(cache["groups"]):
            if step + 1 < steps:
                incoming, pending = self.ring.ring_pass(block, KV_TAG)
            if not self.keep_probs:                      # recompute this block's probabilities
                owner = (self.ring_rank - step) % cp
                groups = attend_block(q, query_tiles(self.chunks(T, cp, self.ring_rank)), *block,
                                      self.chunks(T, cp, owner), AttentionState(q, fmt))
            else:
                groups = [group._replace(probs=fmt.widen(group.probs)) for group in groups]
            attend_block_backward(groups, q, *block, dout, d_rowsum, state, dq, *grads)
            # The block's gradients travel with it; after the last step, home to its owner.
            grads, grad_pending = self.ring.ring_pass(grads, GRAD_TAG)
            self.ring.wait_all(grad_pending)
            if step + 1 < steps:
                self.ring.wait_all(pending)
                block = incoming
        for own, arrived in zip((dk, dv), grads):
            if arrived is not own:                       # came home around the ring
                own[...] = arrived
        dq *= self.scale                                 # q held the scale; dk already has it
        dqkv = self.heads.to_tokens(dqkv).transpose(1, 3, 0, 2, 4).reshape(B, t, -1)
        return self.qkv.start_backward_input(dqkv, cache["qkv"])    # its sum may overlap our weight half

    def backward_weights(self, cache):
        self.proj.backward_weights(cache["proj"])
        self.qkv.backward_weights(cache["qkv"])
