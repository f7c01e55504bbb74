"""The first stage's input layer: the vocabulary-parallel token embedding
(tensor_parallel/vocab_parallel.py) plus a learned position embedding."""

import numpy as np

from numpitron.nn.layer import Layer
from numpitron.nn.param import Param


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

    def __init__(self, token, position: PositionEmbedding, positions: np.ndarray):
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
