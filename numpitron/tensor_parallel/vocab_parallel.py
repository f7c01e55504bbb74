"""The vocabulary split over tensor-parallel ranks: the token embedding and the LM head
tied to it (Megatron's VocabParallelEmbedding; the loss is cross_entropy.py).

Each tp rank holds rows [v0, v1) of the (padded) vocabulary: `VocabShard` says which,
and is the one place that knows about the padding. A lookup is masked to the rows
this rank owns and the partial results are summed over tp. The head reuses the same
weight to produce this rank's slice of the logits, so the full (B, T, V) logits never
exist on any rank.
"""

import numpy as np

from numpitron.distributed.sharding import pad_to_multiple, shard_bounds
from numpitron.nn.layer import Layer
from numpitron.nn.matmul import rows
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


class TiedLMHead(Layer):
    """logits[..., v0:v1] = h @ E[v0:v1].T, with E the token embedding's weight.
    Its parameter is the embedding's, so it lists none of its own."""

    def __init__(self, embedding):
        self.embedding = embedding
        self.region = embedding.region

    def forward(self, h):
        # h: (B, T, C) (or (B, T/tp, C) sequence-parallel) -> (B, T, V / tp)
        full = self.region.gather(h)
        logits = self.precision.round(rows(full) @ self.embedding.weight.data.T)
        return logits.reshape(*full.shape[:-1], -1), {"h": self.precision.keep(h)}

    def start_backward_input(self, dlogits, cache):
        cache["dy"] = dlogits
        dh = rows(dlogits) @ self.embedding.weight.data   # this vocabulary slice's share of dL/dh
        # "f": sum the shares over tp, perhaps while backward_weights runs
        return self.region.start_input_grad(dh.reshape(dlogits.shape[:-1] + (-1,)))

    def backward_weights(self, cache):
        h = self.precision.widen(cache["h"])
        self.embedding.weight.grad += rows(cache["dy"]).T @ rows(self.region.gather(h))
