"""Softmax cross-entropy over vocabulary-sharded logits, never gathering them.

Each rank holds logits[:, v0:v1]. Three all-reduces over tp, each of one number per
token, give what the loss needs (Megatron's vocab_parallel_cross_entropy):
the max (for a stable exp), the sum of exponentials, and the target's logit, which
only the rank owning the target's row can see. Padded vocabulary columns are set
to -inf, so they get zero probability and the loss equals the unpadded one.
"""

import numpy as np


class VocabParallelCrossEntropy:
    def __init__(self, vocab_size: int, vocab_start: int, topo):
        self.tp = topo.tp_comm
        self.vocab_size = vocab_size
        self.vocab_start = vocab_start

    def mask_padding(self, logits):
        """-inf on the columns that pad the vocabulary (a no-op on ranks without them)."""
        logits[:, max(0, self.vocab_size - self.vocab_start):] = -np.inf
        return logits

    def forward(self, logits, targets):
        # logits: (N, V/tp), overwritten; targets: (N,) -> mean loss (scalar)
        n, local_vocab = logits.shape
        self.mask_padding(logits)
        row_max = logits.max(axis=1)
        self.tp.all_reduce(row_max, op="max")
        logits -= row_max[:, None]
        local = targets - self.vocab_start
        owned = (local >= 0) & (local < local_vocab)
        local = np.where(owned, local, 0)
        rows = np.arange(n)
        target_logit = logits[rows, local] * owned
        self.tp.all_reduce(target_logit)
        probs = np.exp(logits, out=logits)
        sum_exp = probs.sum(axis=1)
        self.tp.all_reduce(sum_exp)
        probs /= sum_exp[:, None]
        loss = float(np.mean(np.log(sum_exp) - target_logit))
        return loss, (probs, local, owned)

    def backward(self, dloss: float, cache):
        """dL/dlogits = (softmax - onehot(target)) * dloss / N."""
        probs, local, owned = cache
        n = probs.shape[0]
        probs[np.arange(n), local] -= owned.astype(probs.dtype)
        probs *= dloss / n
        return probs
