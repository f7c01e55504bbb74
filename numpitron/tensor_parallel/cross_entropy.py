"""Softmax cross-entropy over vocabulary-sharded logits, never gathering them.

Each rank holds logits[..., v0:v1]. Three all-reduces over tp, each of one number
per token, give what the loss needs (Megatron's vocab_parallel_cross_entropy): the
max (for a stable exp), the sum of exponentials, and the target's logit, which
only the rank owning the target's row can see. Padded vocabulary columns are set
to -inf by the shard (`VocabShard.mask_padding`), so the loss equals the unpadded one.
"""

import numpy as np

from numpitron.nn.layer import Layer
from numpitron.nn.matmul import rows


class VocabParallelCrossEntropy(Layer):
    def __init__(self, shard, topo):
        self.tp = topo.tp_comm
        self.shard = shard

    def forward(self, logits, targets):
        # logits: (B, T, V/tp), overwritten; targets: (B, T) -> mean loss (a float)
        shape = logits.shape
        logits = rows(self.shard.mask_padding(logits))
        n = logits.shape[0]
        row_max = logits.max(axis=1)
        self.tp.all_reduce(row_max, op="max")
        logits -= row_max[:, None]
        local, owned = self.shard.local_rows(targets.reshape(-1))
        target_logit = logits[np.arange(n), local] * owned
        self.tp.all_reduce(target_logit)
        probs = np.exp(logits, out=logits)
        sum_exp = probs.sum(axis=1)
        self.tp.all_reduce(sum_exp)
        probs /= sum_exp[:, None]
        loss = float(np.mean(np.log(sum_exp) - target_logit))
        return loss, {"probs": probs, "local": local, "owned": owned, "shape": shape}

    def backward_input(self, dloss: float, cache):
        """dL/dlogits = (softmax - onehot(target)) * dloss / N, (B, T, V/tp)."""
        probs, local, owned = cache["probs"], cache["local"], cache["owned"]
        n = probs.shape[0]
        probs[np.arange(n), local] -= owned.astype(probs.dtype)
        probs *= dloss / n
        return probs.reshape(cache["shape"])
