"""The router of a mixture-of-experts layer: which experts see each token, with what
weight, and the load-balancing loss that keeps them all busy.

    logits = x @ W_r              (one linear layer, no bias; W_r is C x E)
    p      = softmax(logits)      over the E experts
    chosen = the k largest p      (ties: the lower expert index)
    gate   = p[chosen]            not renormalised over the k (Switch Transformer, Fedus
                                  et al. 2021, eqs. 1-2): with k = 1 a renormalised gate
                                  would always be 1 and the language-model loss would
                                  never teach the router anything.

Capacity (Switch §2.2). Every statistic of the routing is taken per sequence (a row
of T tokens), so it is the same whatever rows a rank happens to hold: on any mesh,
with any micro-batch size. Expert i accepts at most ceil(c * k * T / E) of a
sequence's assignments, in the order of their tokens' positions (a token's k choices
before the next token's); the rest are dropped, and those tokens skip the expert
(the block's residual carries them on). Position order makes dropping causal: whether
token t is dropped depends only on tokens 0..t, so no token learns of the future
through it. c = 0 is dropless.

Load balancing (Switch eq. 4, taken per sequence as DeepSeek-V3's sequence-wise
auxiliary loss): with f_i the share of the sequence's k*T assignments chosen for
expert i (before dropping) and P_i the mean router probability of expert i over its
T tokens,

    aux = alpha * E * sum_i f_i * P_i,   averaged over the sequences of the micro-batch,

which is alpha when the load is perfectly even. f is a count and has no gradient;
d aux / d p[t, i] = alpha * E * f_i / (B * T) for token t of sequence b.

Balancing without an auxiliary loss (Wang et al. 2024; DeepSeek-V3 §2.1.2, eq. 16):
a per-expert bias b takes part in the choice only,

    chosen = the k largest p + b,   gate = p[chosen]    (b never reaches a gate),

so it steers tokens without changing what the chosen experts' outputs are weighted
by, and it has no gradient. After each step every rank moves it by
`update_balance_bias` from the step's global load: the same counts everywhere, so the
same bias everywhere.

Split sequences (context parallelism: a rank holds T/cp of each sequence's tokens, at
the positions context_parallel/zigzag.py gives it). Each rank routes its own tokens; the
per-sequence statistics need the rest. The capacity's queue positions and f need every
earlier choice of the sequence: the choices (B x T/cp x k integers) are all-gathered
over cp and laid out in position order, so every rank counts exactly what one process
counts. P needs the probabilities summed over the sequence: an all-reduce of B x E
numbers. The aux gradient of a token needs f only, which every rank now has; it is
scaled by 1/(B * T/cp), the rank's own tokens, like its cross-entropy (the gradients
are then averaged over dp x cp). Under sequence parallelism the router sees the whole
(cp-local) sequence on every tp rank (experts/moe.py gathers it), and computes its weight
gradient from this rank's part only: finalize_grads sums it over tp.
"""

import math
from dataclasses import dataclass

import numpy as np

from numpitron.distributed.comm import Comm, CommStats
from numpitron.context_parallel.zigzag import local_positions
from numpitron.nn.layer import Layer
from numpitron.nn.matmul import rows
from numpitron.nn.param import Param
from numpitron.tensor_parallel.regions import ReplicatedRegion


@dataclass
class Routing:
    """The decisions for a micro-batch of N = B*T tokens, each (N, k) unless noted."""
    chosen: np.ndarray           # expert index of every assignment
    gates: np.ndarray            # its weight p[chosen]
    kept: np.ndarray             # False where the expert was full (dropped)
    aux_loss: float              # the load-balancing loss of this micro-batch
    tokens_per_expert: np.ndarray  # (E,) assignments chosen (before dropping)


def capacity(capacity_factor: float, top_k: int, seq_len: int, num_experts: int) -> int:
    """Assignments one expert accepts from one sequence (a sequence has k*T); 0: no limit."""
    return math.ceil(capacity_factor * top_k * seq_len / num_experts) if capacity_factor > 0 else 0


class TopKRouter(Layer):
    """forward(x (B, T, C)) -> (Routing, cache); the gradient it takes back is dL/dgates
    (N, k); the aux loss's own gradient is added inside, scaled by `loss_weight` (the
    weight the schedule gives each micro-batch's loss: the trainer's 1/m)."""

    def __init__(self, name: str, d_model: int, num_experts: int, top_k: int, capacity_factor: float,
                 aux_loss_coef: float, loss_weight: float = 1.0, balance_bias: np.ndarray | None = None,
                 cp_comm: Comm | None = None, region=None):
        """balance_bias: (E,) the routing bias, moved in place between steps (None: none);
        cp_comm: the ranks holding the other tokens of this rank's sequences; region:
        the tp region (sequence parallelism: the weight gradient from this rank's part)."""
        self.weight = Param(f"{name}.weight", (d_model, num_experts))     # replicated over tp
        self.E, self.k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.aux_loss_coef, self.loss_weight, self.balance_bias = aux_loss_coef, loss_weight, balance_bias
        self.cp = cp_comm or Comm(None, CommStats(), "cp")
        self.region = region or ReplicatedRegion(None)

    def parameters(self):
        return [self.weight]

    def forward(self, x):
        B, t, _ = x.shape                      # t: this rank's tokens of each sequence, T / cp
        E, k, T = self.E, self.k, t * self.cp.size
        logits = rows(x) @ self.weight.data                                   # (N, E)
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        scores = probs if self.balance_bias is None else probs + self.balance_bias
        chosen = np.argsort(-scores, axis=1, kind="stable")[:, :k]          # (N, k)
        gates = np.take_along_axis(probs, chosen, axis=1)
        # Each assignment's place in its expert's queue within its sequence, in token
        # order: a running count over the whole sequence's k*T assignments.
        whole, mine = self._whole_sequences(chosen.reshape(B, t, k), T)      # (B, T, k), my positions
        one_hot = np.zeros((B, T * k, E), np.int64)
        np.put_along_axis(one_hot, whole.reshape(B, T * k, 1), 1, axis=2)
        place = np.take_along_axis(np.cumsum(one_hot, axis=1), whole.reshape(B, T * k, 1), axis=2)
        limit = capacity(self.capacity_factor, k, T, E)
        kept = (place.reshape(B, T, k)[:, mine] <= limit).reshape(-1, k) if limit else np.ones_like(chosen, bool)
        # Switch's load-balancing loss, per sequence (module docstring)
        f = one_hot.sum(axis=1) / (k * T)                                     # (B, E)
        P = self.cp.all_reduce(probs.reshape(B, t, E).sum(axis=1)) / T       # (B, E)
        aux = self.aux_loss_coef * E * float(np.mean(np.sum(f * P, axis=1)))
        routing = Routing(chosen, gates, kept, aux, np.bincount(chosen.reshape(-1), minlength=E))
        # x (a LayerNorm's output) in the low format; the routing probabilities in fp32,
        # as routers compute them (Megatron's moe_router_dtype, DeepSeek-V3's gating).
        return routing, {"x": self.precision.keep(x), "probs": probs, "chosen": chosen, "f": f}

    def _whole_sequences(self, chosen, T: int):
        """chosen: (B, T/cp, k), this rank's tokens -> every rank's, in position order
        (B, T, k) (one all-gather over cp), and the positions of this rank's tokens."""
        cp = self.cp.size
        everyone = np.empty((cp,) + chosen.shape, chosen.dtype)
        everyone[self.cp.rank] = chosen
        self.cp.all_gather(everyone)
        whole = np.empty((chosen.shape[0], T, chosen.shape[2]), chosen.dtype)
        for r in range(cp):
            whole[:, local_positions(T, cp, r)] = everyone[r]
        return whole, local_positions(T, cp, self.cp.rank)

    def backward_input(self, dgates, cache):
        """dgates: dL/dgate (N, k), zero for dropped assignments. Returns dL/dx."""
        probs, chosen, f = cache["probs"], cache["chosen"], cache["f"]
        B, T, _ = cache["x"].shape
        dprobs = np.zeros_like(probs)
        np.put_along_axis(dprobs, chosen, dgates, axis=1)                    # k distinct experts: no collisions
        # the aux loss: d/dp[t, i] = w * alpha * E * f[b, i] / (B * T)
        scale = self.loss_weight * self.aux_loss_coef * self.E / (B * T)
        dprobs += np.repeat(scale * f, T, axis=0)
        # softmax: dlogits = p * (dp - sum_j p_j dp_j)
        dlogits = probs * (dprobs - np.sum(probs * dprobs, axis=1, keepdims=True))
        cache["dlogits"] = dlogits
        return (dlogits @ self.weight.data.T).reshape(cache["x"].shape)

    def backward_weights(self, cache):
        x = self.region.sequence_part(self.precision.widen(cache["x"]))    # this tp rank's part (sp), or all
        dlogits = self.region.sequence_part(cache["dlogits"].reshape(cache["x"].shape[:2] + (self.E,)))
        self.weight.grad += rows(x).T @ rows(dlogits)


def update_balance_bias(bias: np.ndarray, load: np.ndarray, rate: float) -> None:
    """DeepSeek-V3 §2.1.2: b_i += u * sign(mean load - load_i), in place. bias and
    load: (..., E), the load being the step's assignments per expert summed over every
    rank that routes (so every rank computes the same bias). An expert at exactly the
    mean load, and a block without experts (no load at all), stays where it is."""
    bias += rate * np.sign(load.mean(axis=-1, keepdims=True) - load)
