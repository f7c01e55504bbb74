"""The last stage's output layer: final LayerNorm, the LM head tied to the token
embedding, and the vocabulary-parallel loss."""

from numpitron.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from numpitron.tensor_parallel.vocab_parallel import TiedLMHead
from numpitron.nn.layer import Layer
from numpitron.nn.layernorm import LayerNorm


class LanguageModelHead(Layer):
    """ln_f -> tied head -> loss (or, without targets, the vocabulary-sharded logits
    with padding masked). Its parameters are ln_f's: the head's weight is the token
    embedding's, listed by whoever owns that copy."""

    def __init__(self, token_embedding, d_model: int, topo):
        self.ln_f = LayerNorm("ln_f", d_model)
        self.head = TiedLMHead(token_embedding)
        self.loss = VocabParallelCrossEntropy(token_embedding.shard, topo)

    def parameters(self):
        return self.ln_f.parameters()

    def forward(self, x, targets=None):
        # x: (B, T, C) -> mean loss, or logits (B, T, V/tp)
        h, ln_cache = self.ln_f.forward(x)
        logits, head_cache = self.head.forward(h)
        cache = {"ln_f": ln_cache, "head": head_cache}
        if targets is None:
            return self.loss.shard.mask_padding(logits), cache
        loss, cache["loss"] = self.loss.forward(logits, targets)
        return loss, cache

    def backward_input(self, dloss, cache):
        return self._backward(dloss, cache, "backward_input")

    def backward_weights(self, cache):
        self.head.backward_weights(cache["head"])
        self.ln_f.backward_weights(cache["ln_f"])

    def backward(self, dloss, cache):
        """Both halves, layer by layer: the head's input-gradient sum hides behind its
        weight gradient (nn/layer.py)."""
        return self._backward(dloss, cache, "backward")

    def _backward(self, dloss, cache, half: str):
        # half: each layer's "backward_input", or its whole "backward"
        dlogits = self.loss.backward_input(dloss, cache["loss"])      # the loss has no weights
        dh = getattr(self.head, half)(dlogits, cache["head"])
        return getattr(self.ln_f, half)(dh, cache["ln_f"])
