"""What one rank's NumPy code executes for one micro-batch (forward, both backward
halves) and for one optimizer step, counted kernel by kernel from numpitron/nn and
numpitron/optim: the planner's time model (predict.py) prices these counts.

Four kinds of work:

* matmul FLOPs, filed under the FLOPs of one BLAS call (a batched matmul makes one
  per matrix; BLAS runs small calls slower);
* element-wise passes: one NumPy kernel over an array, counted in elements (a pass
  reads two operands and writes one, or reduces or broadcasts along rows);
* exponentials: elements through np.exp (softmax, GELU, the loss), priced apart
  because on a CPU they are bound by arithmetic, not by memory;
* calls: every NumPy call, each paying the interpreter's fixed cost.

The per-kernel counts are the kernels' own table (nn/kernel_counts.py: the fused
bias-GELU of one exp per element, causal query tiles), so that a change to a kernel
changes one line beside it; this module only adds them up over a step.
tests/test_plan_time_model.py checks the exponentials against a real step and the softmax groups
against the probabilities the layer keeps.
"""

from collections import defaultdict
from dataclasses import dataclass, field

from numpitron.transformer.activation_memory import softmax_groups
from numpitron.nn.functional import TILE_ELEMENTS as GELU_TILE      # elements per tile, each its own calls
from numpitron.nn.kernel_counts import EXP_PER_ELEMENT, PASSES, SMALL_CALLS
from numpitron.optim.adamw import CHUNK as ADAMW_CHUNK              # elements per chunk, each its own calls


@dataclass
class Work:
    matmul: dict = field(default_factory=lambda: defaultdict(float))    # FLOPs per BLAS call -> FLOPs
    passes: float = 0.0          # elements over all element-wise passes
    exps: float = 0.0            # elements through np.exp
    calls: float = 0.0           # NumPy calls

    def mm(self, m, k, n, batch=1, times=1):
        self.matmul[2 * m * k * n] += times * 2.0 * batch * m * k * n
        self.calls += times

    def ew(self, elements, passes=1, calls=None):
        self.passes += passes * elements
        self.calls += passes if calls is None else calls

    def exp(self, elements, calls=1):
        self.exps += elements
        self.calls += calls

    def small(self, calls):
        self.calls += calls

    def scaled(self, factor):
        return Work(defaultdict(float, {s: f * factor for s, f in self.matmul.items()}),
                    self.passes * factor, self.exps * factor, self.calls * factor)

    def __iadd__(self, other):
        for size, flops in other.matmul.items():
            self.matmul[size] += flops
        self.passes, self.exps, self.calls = self.passes + other.passes, self.exps + other.exps, self.calls + other.calls
        return self

    @property
    def flops(self):
        return sum(self.matmul.values())


def _linear(w, n, fan_in, fan_out, forward, backward, bias_forward=True):
    """x @ W (+ b) forward; dy @ W^T, x^T @ dy, grad += and the bias' column sum backward."""
    if forward:
        w.mm(n, fan_in, fan_out)
        if bias_forward:
            w.ew(n * fan_out)
    if backward:
        w.mm(n, fan_out, fan_in)
        w.mm(fan_in, n, fan_out)
        w.ew(fan_in * fan_out)
        w.ew(n * fan_out)


def _layernorm(w, n, C, forward, backward):
    for done, passes, small in zip((forward, backward), PASSES["layernorm"], SMALL_CALLS["layernorm"]):
        if done:
            w.ew(n * C, passes)
            w.small(small)


def _gelu(w, elements, forward, backward):
    tiles = -(-elements // GELU_TILE)
    f, b = PASSES["gelu"]
    if forward:
        w.ew(elements, f, calls=f * tiles)
        w.exp(EXP_PER_ELEMENT["gelu"] * elements, calls=tiles)
    if backward:
        w.ew(elements, b)                        # one call over the whole array, not in tiles


def attention_groups(T: int, cp: int, cp_rank: int | None = None) -> list:
    """(query rows, key rows, masked, first of its queries) of every softmax group a rank
    computes over a whole ring: the layer's own groups (transformer/activation_memory.py,
    `softmax_groups`), for the busiest rank (the last) unless told."""
    groups, seen = [], set()
    for tile, visible in softmax_groups(T, cp, cp - 1 if cp_rank is None else cp_rank):
        masked = visible[-1].last_position > tile.position      # a key after the tile's first query
        groups.append((tile.stop - tile.start, visible[-1].stop, masked, tile not in seen))
        seen.add(tile)
    return groups


def _softmax_group(w, batch, tq, tk, hd, masked, merge):
    """Q K^T, the mask, the softmax and P V of one group; folded into the running
    output unless it is the first group of its queries."""
    f, _ = PASSES["softmax"]
    w.mm(tq, hd, tk, batch)
    w.ew(batch * tq * tk, f + masked)
    w.exp(EXP_PER_ELEMENT["softmax"] * batch * tq * tk)
    w.mm(tq, tk, hd, batch)
    w.small(SMALL_CALLS["softmax_group"][0])
    if merge:
        w.ew(batch * tq * hd, PASSES["merge"])
        w.small(SMALL_CALLS["merge"])


def _attention_core(w, B, T, heads, hd, cp, forward, backward, recompute_probs):
    """Scores, softmax and the attention-weighted values of `heads` local heads; under
    selective recomputation the backward computes each group's probabilities again."""
    batch = B * heads
    for tq, tk, masked, first in attention_groups(T, cp):
        if forward:
            _softmax_group(w, batch, tq, tk, hd, masked, merge=not first)
        if backward:
            if recompute_probs:
                _softmax_group(w, batch, tq, tk, hd, masked, merge=False)
            if cp > 1:                                     # rescale to the final normaliser
                w.ew(batch * tq * tk)
            w.mm(tk, tq, hd, batch, times=2)               # dV = P^T dO, dK = dS^T Q
            w.mm(tq, hd, tk, batch)                        # dO V^T
            w.mm(tq, tk, hd, batch)                        # dQ = dS K
            w.ew(batch * tq * tk, PASSES["softmax"][1])
            w.small(SMALL_CALLS["softmax_group"][1])


def block_work(B, T, C, H, tp, cp=1, sequence_parallel=False, recompute="none") -> Work:
    """One transformer block, one micro-batch: forward, both backward halves, and the
    forward again under full recomputation."""
    w, n, heads, hd, F = Work(), B * T, H // tp, C // H, 4 * C // tp
    n_ln = n // tp if sequence_parallel else n
    for forward, backward in [(True, False)] * (2 if recompute == "full" else 1) + [(False, True)]:
        for _ in range(2):
            _layernorm(w, n_ln, C, forward, backward)
        w.ew(n_ln * C, 2)                                      # the two residual additions
        _linear(w, n, C, 3 * C // tp, forward, backward)       # q|k|v
        _linear(w, n, C // tp, C, forward, backward)           # output projection
        w.ew(n * C // tp, PASSES["heads"][0 if forward else 1])   # the heads' copies and scalings
        _attention_core(w, B, T, heads, hd, cp, forward, backward, recompute_probs=recompute == "selective")
        w.small(SMALL_CALLS["block"])
    w += mlp_work(n, C, F, recompute)
    return w


def mlp_work(n, C, F, recompute="none") -> Work:
    """An MLP of hidden width F (this rank's part) over n rows, one micro-batch: forward,
    both backward halves, and the forward again under full recomputation. An MoE block
    runs it over the rows its experts receive (plan/experts.py)."""
    w = Work()
    for forward, backward in [(True, False)] * (2 if recompute == "full" else 1) + [(False, True)]:
        _linear(w, n, C, F, forward, backward, bias_forward=False)     # up: GELU adds the bias
        _linear(w, n, F, C, forward, backward)                 # down
        _gelu(w, n * F, forward, backward)
    return w


def head_work(B, T, C, vocab_local, tp, sequence_parallel=False) -> Work:
    """ln_f, the tied head and the loss over this rank's vocabulary slice."""
    w, n = Work(), B * T
    _layernorm(w, n // tp if sequence_parallel else n, C, True, True)
    w.mm(n, C, vocab_local, times=3)                           # logits, dh, dE
    w.ew(vocab_local * C)
    w.ew(n * vocab_local, sum(PASSES["loss"]))
    w.exp(EXP_PER_ELEMENT["loss"] * n * vocab_local)
    w.small(SMALL_CALLS["head"])
    return w


def embedding_work(B, T, C, vocab_local) -> Work:
    """Token rows and positions forward; the token gradient as one-hot @ dy, the
    positions' as a column sum."""
    w, n = Work(), B * T
    w.ew(n * C, PASSES["embedding"])
    w.ew(vocab_local * n, PASSES["one_hot"])
    w.mm(vocab_local, n, C)
    w.ew(vocab_local * C + n * C)
    w.small(SMALL_CALLS["embedding"])
    return w


def optimizer_work(updated: int, grads: int) -> Work:
    """AdamW over the elements this rank updates, chunk by chunk; the norm, clipping and
    zeroing over its gradient buffer."""
    w = Work()
    w.ew(updated, PASSES["adamw"], calls=PASSES["adamw"] * -(-updated // ADAMW_CHUNK))
    w.ew(grads, PASSES["grads"])
    return w
