"""A mixture-of-experts MLP (Shazeer et al. 2017; GShard; Switch Transformer): E
expert MLPs and a router; each token goes to its top k experts and comes back as the
gate-weighted sum of their outputs.

    route      router: chosen experts, gates, kept (experts/router.py)
    dispatch   kept (token, expert) pairs sorted by expert; all-to-all over ep
    experts    each local expert's MLP on its rows (experts/local_experts.py; tp inside)
    combine    all-to-all back; y[t] = sum over t's kept choices j of gate[t, j] * out[t, j]

Shared experts (DeepSeekMoE, Dai et al. 2024, eq. 9): N dense experts every token
passes beside its routed ones, y += shared(x). They are one tensor-parallel MLP of
N times the experts' hidden width (N MLPs side by side are one MLP N times as wide,
their output biases one bias), replicated over dp like any dense layer.

Split sequences. Under context parallelism a rank's tokens are T/cp of each sequence:
it routes them, and the router (experts/router.py) gathers what the per-sequence statistics
need; the ep group is carved out of dp x cp (distributed/topology.py), so tokens of
any rank travel to any rank's experts alike. Under sequence parallelism a tp rank holds
T/tp of the (cp-local) sequence, but the experts are split over tp and need their rows
whole on every tp rank: the layer all-gathers its input along the sequence first
(region.gather, the dense MLP's own all-gather), routes as without sp, and keeps its
part of the output; in the backward the output gradient is gathered the same way. The
shared experts are the dense MLP under sp, on this rank's part.

A dropped choice adds nothing to y: if all of a token's choices are dropped, y[t] = 0
and the block's residual carries the token on unchanged. With ep = 1 the all-to-alls
are copies and this is the whole computation of one process.

The backward runs the same path in reverse (token_dispatch.py): the output gradient
goes to the experts like a dispatch, the experts' input gradient comes back like a
combine. The router gets dL/dgate[t, j] = dy[t] . out[t, j] for kept choices.

Overlap (--moe-a2a-overlap, DeepSeek-V3 §3.2.1's filler, within one layer): each
all-to-all is started, then the layer computes what does not need it, then waits. While
the dispatch travels: the shared experts' forward; while the output gradient travels to
the experts: the shared experts' input gradient; while the input gradients come back:
the router's. The combine has nothing to hide behind inside the layer (that is the other
chunk's work under DualPipe). Off, every all-to-all is waited for where it starts; the
arithmetic and the bytes are the same either way.
"""

import numpy as np

from numpitron.distributed.sharding import shard_bounds
from numpitron.experts.local_experts import LocalExperts
from numpitron.nn.layer import Layer
from numpitron.nn.matmul import rows
from numpitron.transformer.mlp import ParallelMLP
from numpitron.tensor_parallel.regions import ReplicatedRegion
from numpitron.experts.router import TopKRouter
from numpitron.experts.token_dispatch import AllToAllDispatcher


class RoutingLog:
    """What the routers of one stage did during an iteration's micro-batches, per block:
    summed aux losses, assignments per expert, dropped assignments. Recorded by the
    backward (once per micro-batch even when a recomputed forward runs twice)."""

    def __init__(self, n_layers: int, num_experts: int):
        self.n_layers, self.num_experts = n_layers, num_experts
        self.reset()

    def reset(self) -> None:
        self.aux_loss = np.zeros(self.n_layers)
        self.tokens = np.zeros((self.n_layers, self.num_experts))
        self.dropped = np.zeros(self.n_layers)

    def record(self, block: int, routing) -> None:
        self.aux_loss[block] += routing.aux_loss
        self.tokens[block] += routing.tokens_per_expert
        self.dropped[block] += np.count_nonzero(~routing.kept)

    def vector(self) -> np.ndarray:
        """Everything in one buffer, for one reduction over the ranks."""
        return np.concatenate([self.aux_loss, self.dropped, self.tokens.reshape(-1)])

    def from_vector(self, buf: np.ndarray) -> None:
        L = self.n_layers
        self.aux_loss, self.dropped, self.tokens = buf[:L], buf[L:2 * L], buf[2 * L:].reshape(L, -1)


class MixtureOfExperts(Layer):
    def __init__(self, name: str, d_model: int, topo, out_std: float, num_experts: int, top_k: int,
                 capacity_factor: float, aux_loss_coef: float, loss_weight: float = 1.0,
                 block: int = 0, log: RoutingLog | None = None, balance_bias: np.ndarray | None = None,
                 shared_experts: int = 0, expert_hidden: int = 0, region=None, a2a_overlap: bool = True):
        """balance_bias: the router's (E,) bias (experts/router.py), None with the aux loss;
        expert_hidden: every expert's hidden width (0: 4C); region: the block's tp region
        (the dense MLP's: under sp the layer gathers its input along the sequence with it,
        and the shared experts use it as the dense MLP does); a2a_overlap: the all-to-alls
        travel while the layer computes what does not need them (False: they block)."""
        self.region = region or ReplicatedRegion(topo.tp_comm)
        self.router = TopKRouter(f"{name}.router", d_model, num_experts, top_k, capacity_factor, aux_loss_coef,
                                 loss_weight, balance_bias, topo.cp_comm, self.region)
        mine = range(*shard_bounds(num_experts, topo.ep, topo.ep_rank))
        self.experts = LocalExperts(f"{name}.experts", d_model, mine, topo, out_std, expert_hidden)
        hidden = expert_hidden or 4 * d_model
        self.shared = ParallelMLP(f"{name}.shared", d_model, topo, out_std, self.region,
                                  hidden=shared_experts * hidden) \
            if shared_experts else None
        self.dispatcher = AllToAllDispatcher(topo.ep_comm, num_experts, a2a_overlap)
        self.E, self.k, self.block, self.log = num_experts, top_k, block, log

    def parameters(self):
        shared = self.shared.parameters() if self.shared else []
        return self.router.parameters() + shared + self.experts.parameters()

    def forward(self, x_mine):
        # x_mine: (B, T, C), or this tp rank's (B, T/tp, C) under sp -> the same shape
        x = self.region.gather(x_mine)                           # (B, T, C) on every tp rank
        routing, router_cache = self.router.forward(x)
        # the kept (token, slot) pairs, sorted by expert (stable: token order within one)
        token, slot = np.nonzero(routing.kept)
        expert = routing.chosen[token, slot]
        by_expert = np.argsort(expert, kind="stable")
        token, slot = token[by_expert], slot[by_expert]
        plan = self.dispatcher.plan(np.bincount(expert, minlength=self.E))
        arriving = self.dispatcher.start_dispatch(rows(x)[token], plan)            # all-to-all, started
        shared = self.shared.forward(x_mine) if self.shared else None              # meanwhile: the filler
        expert_in = arriving()
        expert_out, experts_cache = self.experts.forward(expert_in, plan.expert_rows)
        out = self.dispatcher.combine(expert_out, plan)                            # all-to-all back
        gate = routing.gates[token, slot]
        y = np.zeros(rows(x).shape, x.dtype)
        for j in range(self.k):                 # a token appears once per slot: no index repeats
            at = slot == j
            y[token[at]] += gate[at, None] * out[at]
        cache = {"routing": routing, "router": router_cache, "experts": experts_cache, "plan": plan,
                 "token": token, "slot": slot, "out": out}
        y = self.region.sequence_part(y.reshape(x.shape))
        if self.shared:
            shared_out, cache["shared"] = shared
            y += shared_out
        return y, cache

    def backward_input(self, dy_mine, cache):
        token, slot, out, plan = cache["token"], cache["slot"], cache["out"], cache["plan"]
        routing = cache["routing"]
        dy = self.region.output_grad(dy_mine)                    # whole, as the routing was
        dy_rows = rows(dy)[token]                                                  # (kept, C)
        dgates = np.zeros(routing.gates.shape, dy.dtype)
        dgates[token, slot] = np.sum(dy_rows * out, axis=1)
        d_out = routing.gates[token, slot][:, None] * dy_rows
        arriving = self.dispatcher.start_dispatch(d_out, plan)       # the combine's backward: a dispatch
        d_shared = self.shared.backward_input(dy_mine, cache["shared"]) if self.shared else None   # meanwhile
        d_expert_out = arriving()
        d_expert_in = self.experts.backward_input(d_expert_out, cache["experts"])
        arriving = self.dispatcher.start_combine(d_expert_in, plan)  # the dispatch's backward: a combine
        dx = self.router.backward_input(dgates, cache["router"])      # meanwhile
        d_in = arriving()
        dx_rows = rows(dx)
        for j in range(self.k):
            at = slot == j
            dx_rows[token[at]] += d_in[at]
        dx = self.region.sequence_part(dx)       # every tp rank computed the whole dx alike
        if self.shared:
            dx += d_shared
        if self.log is not None:
            self.log.record(self.block, routing)
        return dx

    def backward_weights(self, cache):
        if self.shared:
            self.shared.backward_weights(cache["shared"])
        self.experts.backward_weights(cache["experts"])
        self.router.backward_weights(cache["router"])
