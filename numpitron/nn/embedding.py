"""Vocabulary-parallel token embedding, learned position embedding, and the LM head
tied to the token embedding.

Each tp rank holds rows [v0, v1) of the (padded) vocabulary: `VocabShard` says which,
and is the one place that knows about the padding. A lookup is masked to the rows
this rank owns and the partial results are all-reduced (Megatron's
VocabParallelEmbedding). The head reuses the same weight to produce this rank's
slice of the logits, so the full (B, T, V) logits never exist on any rank.
"""

import numpy as np

from numpitron.distributed.sharding import pad_to_multiple, shard_bounds
from numpitron.nn.layer import Layer, rows
from numpitron.nn.param import Param
from numpitron.tensor_parallel.regions import ReplicatedRegion


class VocabShard:
    """Rows [start, stop) of the vocabulary padded to a multiple of tp, on this rank."""

    def __init__(self, vocab_size: int, tp_size: int, tp_rank: int):
        self.vocab_size = vocab_size
        self.padded_size = pad_to_multiple(vocab_size, tp_size)
        self.start, self.stop = shard_bounds(self.padded_size, tp_size, tp_rank)

    def local_rows(self, ids):
        """Row of each token id within this shard, and whether this shard owns it
        (rows of ids owned elsewhere are 0, to be masked by `owned`)."""
        local = ids - self.start
        owned = (local >= 0) & (local < self.stop - self.start)
        return np.where(owned, local, 0), owned

    def mask_padding(self, logits):
        """-inf on the logits of padded rows (none on ranks without padding), so they
        get zero probability and the loss equals the unpadded one."""
        logits[..., max(0, self.vocab_size - self.start):] = -np.inf
        return logits


class VocabParallelEmbedding(Layer):
    def __init__(self, name: str, vocab_size: int, d_model: int, topo, in_norm: bool = True, region=None):
        self.region = region or ReplicatedRegion(topo.tp_comm)
        self.shard = VocabShard(vocab_size, topo.tp, topo.tp_rank)
        self.weight = Param(f"{name}.weight", (self.shard.padded_size, d_model), split_axis=0,
                            logical_shape=(vocab_size, d_model), in_norm=in_norm,
                            tp_rank=topo.tp_rank, tp_size=topo.tp)

    def parameters(self):
        return [self.weight]

    def forward(self, ids):
        # ids: (B, T) token ids -> (B, T, C) replicated over tp, or sequence-parallel (B, T/tp, C)
        local, owned = self.shard.local_rows(ids)
        x = self.weight.data[local]
        x *= owned[..., None]        # rows other ranks own contribute zero here...
        x = self.region.reduce(x)    # ...and theirs arrive in this sum (all-reduce or reduce-scatter)
        return x, {"rows": local.reshape(-1), "owned": owned.reshape(-1)}

    def backward_input(self, dx, cache):
        cache["dy"] = dx
        return None                  # token ids have no gradient

    def backward_weights(self, cache):
        # dE[v] = sum of dx over the tokens equal to v: a one-hot (V/tp, N) matrix times
        # dx, one BLAS call instead of NumPy's unbuffered scatter-add np.add.at (the speed appendix of docs/).
        local_vocab = self.weight.data.shape[0]
        onehot = (np.arange(local_vocab)[:, None] == cache["rows"]) & cache["owned"]
        dy = self.region.output_grad(cache["dy"])     # every token's gradient, whole
        self.weight.grad += onehot.astype(self.weight.grad.dtype) @ rows(dy)


class PositionEmbedding(Layer):
    """Learned absolute positions, replicated over tp."""

    def __init__(self, name: str, seq_len: int, d_model: int):
        self.weight = Param(f"{name}.weight", (seq_len, d_model))

    def parameters(self):
        return [self.weight]

    def forward(self, ids, positions):
        # ids: (B, T) -> (B, len(positions), C): the rows of `positions`, broadcast over B
        table = self.weight.data[positions]
        return np.broadcast_to(table, (ids.shape[0],) + table.shape), {"positions": positions}

    def backward_input(self, dx, cache):
        cache["dy"] = dx
        return None

    def backward_weights(self, cache):
        # positions are distinct, so a fancy-indexed += adds each row once
        self.weight.grad[cache["positions"]] += cache["dy"].sum(axis=0)


class Embeddings(Layer):
    """The first stage's input layer: token embedding + position embedding.

    `positions` are the global positions of the tokens this rank holds (all of them,
    in order, unless context parallelism split the sequence: context_parallel/zigzag.py);
    while generating, the positions after those already in the key/value cache."""

    def __init__(self, token: VocabParallelEmbedding, position: PositionEmbedding, positions: np.ndarray):
        # With sequence parallelism this rank adds positions only to its own tokens.
        self.token, self.position, self.positions = token, position, token.region.local(positions)

    def parameters(self):
        return self.token.parameters() + self.position.parameters()

    def forward(self, ids, kv=None):
        x, token_cache = self.token.forward(ids)
        positions = self.positions if kv is None else kv.pos + np.arange(ids.shape[1])
        pos, position_cache = self.position.forward(ids, positions)
        x += pos
        return x, {"token": token_cache, "position": position_cache}

    def backward_input(self, dx, cache):
        self.token.backward_input(dx, cache["token"])
        self.position.backward_input(dx, cache["position"])
        return None

    def backward_weights(self, cache):
        self.token.backward_weights(cache["token"])
        self.position.backward_weights(cache["position"])
